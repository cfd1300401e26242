"""Every GPU check of the project in one command on a CUDA machine, in order of value (a time budget
that runs out loses the last): the real training loop (`benchmark.py --sections loop`: train.py at the
base size on WMT lengths with its defaults, length buckets and CUDA graphs), the same without cuDNN
attention (which decides the backends' default), compiled, the GPU tests, the torch.nn.Transformer loop
on the same batches, ours without CUDA graphs, translation with and without CUDA graphs compared line by
line, ours without buckets, the compiled torch.nn.Transformer loop and the fixed-shape step.
Each step runs in its own process group under `timeout -k` inside one budget (`--budget`), so a failure
or a timeout costs only that step (a loop step keeps the runs it finished; what a step leaves running is
killed); a broken environment stops the check at once. The results go to `summary.json`, `summary.md`
(its table printed last), `benchmark.json`, `loop.json` and `steps.log` (every step's output, with the
end of each train.py log and its profile) in --out. `--steps` runs some steps only.

    python benchmarks/gpu_check.py                 # on a CUDA machine: about 9 minutes on one H200
    python benchmarks/gpu_check.py --dry-run       # anywhere: the same steps at toy sizes on the CPU

The loop runs on the WMT sample (`--corpus`, default data/wmt_sample_raw from benchmarks/wmt_sample_corpus.py)
prepared with a 37,000-piece BPE into `--prepared` (default data/bench_loop37k), else on synthetic
lengths. Preparing takes minutes on a CPU: it may be done on another machine and the two folders copied
(prepare() checks the settings, the relative path included, and skips the work):

    python benchmarks/benchmark.py --device cpu --sections loop --loop-runs "" \
        --loop-corpus data/wmt_sample_raw --loop-data-dir data/bench_loop37k
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

STEPS = (  # in order of value; a compiled step has no dry run (compiling takes minutes on a CPU)
    "loop_eager",
    "loop_no_cudnn",
    "loop_compiled",
    "gpu_tests",
    "loop_peers",
    "loop_no_graphs",
    "translate",
    "loop_no_buckets",
    "loop_peer_compiled",
    "benchmark",
)
LOOP_STEPS = "100,100"  # a CUDA loop run: its first steps from process start, then the steady ones
LEAST = 30  # seconds a step needs to measure anything: with less left it is not started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the plumbing")
    parser.add_argument("--out", type=Path, default=Path("gpu_check"), help="where the results go")
    parser.add_argument("--budget", type=int, default=480, help="seconds for all steps together")
    # relative to the checkout, as when they were prepared: prepare() compares the path as written
    parser.add_argument("--corpus", type=Path, default=Path("data/wmt_sample_raw"), help="loop corpus")
    parser.add_argument("--prepared", type=Path, default=Path("data/bench_loop37k"), help="it prepared")
    parser.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated, of {', '.join(STEPS)}")
    args = parser.parse_args()
    args.steps = [s for s in args.steps.split(",") if s]
    if unknown := sorted(set(args.steps) - set(STEPS)):
        parser.error(f"--steps: {', '.join(unknown)} unknown; the steps are {', '.join(STEPS)}")
    args.out = args.out.resolve()  # the steps run in the checkout's root
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "steps.log").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_", ignore_cleanup_errors=True) as work:
        results = run_all(args, Path(work))
    print("\n" + (args.out / "summary.md").read_text())
    print(f"wrote {args.out / 'summary.md'}")
    sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


def run_all(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """The steps asked for, in order of value (a cut budget loses the last); their results by name."""
    check = Check(args.out, args.dry_run, environment(), time.monotonic() + args.budget)
    if not check.run("environment", [sys.executable, "-c", _ENVIRONMENT], 60):
        return check.results  # nothing else can run
    corpus = ["--loop-corpus", str(args.corpus), "--loop-data-dir", str(args.prepared)]
    corpus = corpus if (ROOT / args.corpus).is_dir() and not args.dry_run else []  # else synthetic lengths
    if corpus and not (ROOT / args.prepared / "meta.json").is_file():
        check.note(f"{args.prepared} is not prepared: the first loop run prepares it (carry it next time)")
    loop = Loop(check, work / "loop", corpus)
    eager = work / "loop" / "eager" / "checkpoints" / "checkpoint_last.pt"
    steps = {
        "loop_eager": lambda: loop.run("loop_eager", "eager", 120),  # the defaults: graphs, buckets
        "loop_no_cudnn": lambda: loop.run("loop_no_cudnn", "no-cudnn", 100),
        "loop_compiled": lambda: loop.run("loop_compiled", "compiled", 150, compiled=True),
        "gpu_tests": lambda: check.run("gpu_tests", _pytest(args.dry_run), 150),  # graphs, regions, backends
        "loop_peers": lambda: loop.run("loop_peers", "peer", 100, needs=eager),  # on the eager run's batches
        "loop_no_graphs": lambda: loop.run("loop_no_graphs", "no-graphs", 100),
        "translate": lambda: check.translations(eager, _source(args, corpus, work), work),
        "loop_no_buckets": lambda: loop.run(
            "loop_no_buckets" if not args.dry_run else "loop_buckets", "buckets", 100
        ),
        "loop_peer_compiled": lambda: loop.run(
            "loop_peer_compiled", "peer-compiled", 180, compiled=True, needs=eager
        ),
        "benchmark": lambda: check.run(
            "benchmark", _benchmark(args.dry_run, args.out / "benchmark.json"), 150
        ),
    }
    for name in STEPS:
        if name in args.steps:
            steps[name]()
    return check.results


def _source(args: argparse.Namespace, corpus: list[str], work: Path) -> Path:
    """The sentences to translate: the WMT sample's first 500 validation lines, else short made-up ones."""
    source, lines = work / "source.txt", ROOT / args.corpus / "valid.en"
    text = lines.read_text(encoding="utf-8").splitlines()[:500] if corpus and lines.is_file() else _words(50)
    source.write_text("".join(line + "\n" for line in text), encoding="utf-8")
    return source


class Loop:
    """The loop section's runs, each a step of its own; the figures of all gathered in loop.json."""

    def __init__(self, check: Check, work: Path, corpus: list[str]) -> None:
        self.check, self.work, self.corpus = check, work, corpus
        self.rows: list[dict] = []

    def run(
        self, name: str, runs: str, timeout: int, compiled: bool = False, needs: Path | None = None
    ) -> None:
        """The loop runs `runs` as step `name`; `compiled` ones have no dry run; `needs`: a file an earlier
        run wrote (the peers train on the eager run's batches)."""
        if compiled and self.check.dry_run:  # compiling takes minutes on a CPU: the plumbing without it
            return
        if needs is not None and not needs.is_file():
            self.check.skip(name, f"no {needs.parent.parent.name} run")
            return
        out = self.work / f"{name}.json"
        command = [sys.executable, "benchmarks/benchmark.py", "--sections", "loop", "--loop-runs", runs]
        command += ["--loop-work", str(self.work), "--json", str(out), *self.corpus]
        if self.check.dry_run:
            command += ["--device", "cpu", "--size", "tiny", "--threads", "1", "--loop-steps", "2,2"]
        else:
            command += ["--device", "cuda", "--size", "base", "--loop-steps", LOOP_STEPS]
        self.check.run(name, command, timeout)
        self.check.attach([self.work / f"{run}.log" for run in runs.split(",")], 60)  # train.py's last lines
        self.check.attach([self.work / run / "profile" / "ops.txt" for run in runs.split(",")], 50, head=True)
        loop = json.loads(out.read_text()).get("loop") if out.is_file() else None  # its finished runs
        if loop is not None:
            self.rows += loop["rows"]
            for row in loop["rows"]:
                self.check.results[name][row["run"]] = _loop_figures(row)
            self.check.loop = {**loop, "rows": self.rows}
            self.check.write()


def _loop_figures(row: dict) -> str:
    figures = [f"steady {row['steady_tokens_per_s']:,.0f} tok/s", f"first {row['first_tokens_per_s']:,.0f}"]
    figures += [f"step 1 at {row['first_step_s']:.0f} s", f"{row['tokens_per_step']:,.0f} tgt tok/step"]
    if row.get("recompiles") is not None:
        figures.append(f"{row['recompiles']} recompiles")
    if row.get("gpu_busy") is not None:
        figures.append(f"GPU busy {row['gpu_busy']:.0%}")
    if row.get("peak_gib") is not None:
        figures.append(f"peak {row['peak_gib']:.1f} GiB")
    return "; ".join(figures)


class Check:
    """Runs the steps in order within one time budget and writes the summary after each step (a kill
    keeps what was measured)."""

    def __init__(self, out: Path, dry_run: bool, env: dict[str, str], deadline: float) -> None:
        self.out, self.dry_run, self.env, self.deadline = out, dry_run, env, deadline
        self.device = "cpu" if dry_run else "cuda"
        self.results: dict[str, dict] = {}
        self.loop: dict | None = None

    def run(self, name: str, command: list[str], timeout: int) -> bool:
        """`command` under `timeout -k 10` (a process busy compiling may ignore a plain SIGTERM), in the
        process group `timeout` makes; whatever of it is still running afterwards (a train.py writing a
        checkpoint on SIGTERM) is killed before the next step."""
        start = time.monotonic()
        timeout = min(timeout, int(self.deadline - start))
        status: int | str = "no time left"
        if timeout >= LEAST:
            with open(self.out / "steps.log", "a") as log:
                log.write(f"\n===== {name}: {' '.join(command)}\n")
                log.flush()
                limited = ["timeout", "-k", "10", str(timeout), *command]
                process = subprocess.Popen(limited, cwd=ROOT, env=self.env, stdout=log, stderr=log)
                try:
                    status = process.wait(timeout=timeout + 30)
                except subprocess.TimeoutExpired:
                    status = f"timeout ({timeout} s)"
                finally:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(process.pid, signal.SIGKILL)
                    process.wait()
                status = f"timeout ({timeout} s)" if status in (124, 137) else status
        self.results[name] = {"ok": status == 0, "status": status, "seconds": round(time.monotonic() - start)}
        print(f"{name}: {'ok' if status == 0 else f'FAILED: {status}'} in {self.results[name]['seconds']} s")
        self.write()
        return status == 0

    def skip(self, name: str, why: str) -> None:
        self.results[name] = {"ok": False, "status": f"skipped: {why}", "seconds": 0}
        print(f"{name}: skipped: {why}")
        self.write()

    def note(self, text: str) -> None:
        with open(self.out / "steps.log", "a") as log:
            log.write(f"\nnote: {text}\n")
        print(f"note: {text}")

    def attach(self, paths: list[Path], lines: int, head: bool = False) -> None:
        """The last (or first) `lines` lines of each of `paths` that exists, into steps.log."""
        with open(self.out / "steps.log", "a") as log:
            for path in (p for p in paths if p.is_file()):
                text = path.read_text(errors="replace").splitlines()
                log.write(f"----- {'/'.join(path.parts[-3:])}\n")
                log.write("".join(line + "\n" for line in (text[:lines] if head else text[-lines:])))

    def translations(self, checkpoint: Path, source: Path, work: Path) -> None:
        """translate.py without and with CUDA graphs (a dry run: twice without), compared line by line, in
        float32 (bf16 would round the two searches' different shapes apart)."""
        if not checkpoint.is_file():
            self.skip("translate", "no eager loop run to translate with")
            return
        outputs = []
        for name, graphs in (("translate", False), ("translate_cuda_graphs", not self.dry_run)):
            output = work / f"{name}.de"
            command = [sys.executable, "translate.py", f"checkpoint={checkpoint}", f"input={source}"]
            command += [f"output={output}", f"cuda_graphs={str(graphs).lower()}", f"device={self.device}"]
            command += ["precision=fp32"]
            if self.run(name, command, 60):
                outputs.append(output.read_text(encoding="utf-8").splitlines())
        if len(outputs) == 2:
            same = sum(a == b for a, b in zip(*outputs))
            self.results["translate_cuda_graphs"]["lines_equal"] = f"{same}/{len(outputs[0])}"
            self.write()

    def write(self) -> None:
        (self.out / "summary.json").write_text(json.dumps(self.results, indent=2) + "\n")
        if self.loop is not None:
            (self.out / "loop.json").write_text(json.dumps(self.loop, indent=2) + "\n")
        rows = [f"| {n} | {r['status']} | {r['seconds']} | {_figures(r)} |" for n, r in self.results.items()]
        kind = "dry run on the CPU" if self.dry_run else "CUDA"
        table = "| step | status | seconds | figures |\n|---|---|---|---|\n" + "\n".join(rows)
        (self.out / "summary.md").write_text(f"GPU check ({kind})\n\n{table}\n{_ratios(self.loop)}")


def _ratios(loop: dict | None) -> str:
    """Ours against the torch.nn.Transformer loop on the same batches, steady state."""
    runs = {row["run"]: row["steady_tokens_per_s"] for row in (loop or {}).get("rows", [])}
    lines = [
        f"- {ours} / {peer}: {runs[ours] / runs[peer]:.2f}x"
        for ours in ("eager", "compiled", "no-graphs")
        for peer in ("peer", "peer-compiled")
        if ours in runs and peer in runs
    ]
    return "\nsteady state, ours / torch.nn.Transformer loop:\n" + "\n".join(lines) + "\n" if lines else ""


def _figures(result: dict) -> str:
    return ", ".join(f"{k} {v}" for k, v in result.items() if k not in ("ok", "status", "seconds"))


def environment() -> dict[str, str]:
    """This process's environment, with the checkout on PYTHONPATH (the steps' scripts import it)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


_ENVIRONMENT = """
import platform, torch
import hydra, omegaconf, sacremoses  # the steps' scripts import them: without them nothing runs
print("python", platform.python_version(), "torch", torch.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 2**30, "GiB")
"""


def _pytest(dry_run: bool) -> list[str]:
    """The GPU tests (a dry run only collects them)."""
    # each test's outcome as it ends (a cut step keeps them), the failures' reasons summarized at the end
    collect = ["--collect-only", "-q"] if dry_run else ["-v", "--tb=short", "-rfE"]
    if importlib.util.find_spec("pytest_timeout") and not dry_run:
        collect.append("--timeout=90")  # a hung test fails with its stack instead of taking the step
    # in one process: workers would share the one GPU
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "0", "-p", "no:cacheprovider", *collect]


def _benchmark(dry_run: bool, json_path: Path) -> list[str]:
    """The fixed-shape training step at the base size against torch.nn.Transformer (a dry run: the data
    section, tiny)."""
    command = [sys.executable, "benchmarks/benchmark.py", "--json", str(json_path)]
    if dry_run:
        return [*command, "--device", "cpu", "--size", "tiny", "--sections", "data", "--data-pairs", "20000"]
    return [*command, "--device", "cuda", "--size", "base", "--sections", "train", "--peers", "torch"]


def _words(n: int) -> list[str]:
    """`n` short English sentences for the dry run's translations."""
    return [f"the house number {i} is small" for i in range(n)]


if __name__ == "__main__":
    main()
