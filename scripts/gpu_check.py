"""Every GPU check of the project in one command, for a GPU machine lent for minutes, in order of value
(a cut budget loses the last): the real training loop (`benchmark.py --sections loop`: train.py at the
base size on WMT lengths with its defaults, length buckets and CUDA graphs, eager and compiled), the GPU
tests, more of the loop (without CUDA graphs, the torch.nn.Transformer loop on the same batches, without
cuDNN attention, without buckets), translation with and without CUDA graphs compared line by line, and
the fixed-shape step.
Each step runs in its own process under `timeout -k` inside one budget, so a failure or a timeout costs
only that step (a loop step keeps the runs it finished);
the results go to `summary.json`, `summary.md` (its table printed last), `benchmark.json`, `loop.json`
and `steps.log` (every step's output) in --out (default $OUT, else gpu_check/).

    python scripts/gpu_check.py                 # on a CUDA machine: about 8 minutes on one H200
    python scripts/gpu_check.py --dry-run       # anywhere: the same steps at toy sizes on the CPU

The loop runs on the WMT sample (`--corpus`, default data/wmt_sample_raw from scripts/wmt_sample_corpus.py)
prepared with a 37,000-piece BPE into `--prepared` (default data/bench_loop37k), else on synthetic
lengths. Prepare it on any machine first and carry both folders (prepare() checks the settings, the
relative path included, and skips the work):

    python scripts/benchmark.py --device cpu --sections loop --loop-runs "" \
        --loop-corpus data/wmt_sample_raw --loop-data-dir data/bench_loop37k

The GPU machine of this project's device tool has torch, sentencepiece, sacrebleu, tensorboard and
transformers but not hydra-core, omegaconf or sacremoses. Their wheels are pure Python, so a folder
built on any machine serves (--wheels, default .whl; installed into a temporary folder when needed):

    pip wheel --no-deps -w .whl hydra-core==1.3.2 omegaconf==2.3.0 antlr4-python3-runtime==4.9.3 \
        sacremoses==0.1.1
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

NEEDED = ("hydra", "omegaconf", "sacremoses")  # imported by train.py, translate.py and the evaluation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the plumbing")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")))
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels of missing packages")
    parser.add_argument("--budget", type=int, default=480, help="seconds for all steps together")
    # relative to the checkout, as when they were prepared: prepare() compares the path as written
    parser.add_argument("--corpus", type=Path, default=Path("data/wmt_sample_raw"), help="loop corpus")
    parser.add_argument("--prepared", type=Path, default=Path("data/bench_loop37k"), help="it prepared")
    args = parser.parse_args()
    args.out = args.out.resolve()  # the steps run in the checkout's root
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "steps.log").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        results = run_all(args, Path(work))
    print("\n" + (args.out / "summary.md").read_text())
    print(f"wrote {args.out / 'summary.md'}")
    sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


def run_all(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """The steps in order of value (a cut budget loses the last); their results by name."""
    check = Check(
        args.out, args.dry_run, environment(args.wheels, work / "site"), time.monotonic() + args.budget
    )
    check.run("environment", [sys.executable, "-c", _ENVIRONMENT], 60)
    corpus = ["--loop-corpus", str(args.corpus), "--loop-data-dir", str(args.prepared)]
    corpus = corpus if (ROOT / args.corpus).is_dir() and not args.dry_run else []  # else synthetic lengths
    loop = Loop(check, work / "loop", corpus)
    loop.run("loop_eager", "eager", 120)  # the defaults: CUDA graphs, length buckets
    loop.run("loop_compiled", "compiled", 150, compiled=True)
    check.run("gpu_tests", _pytest(args.dry_run), 150)  # graphed steps, compiled regions, backends
    loop.run("loop_no_graphs", "no-graphs", 90)
    loop.run("loop_peers", "peer,peer-compiled", 180, compiled=True)
    loop.run("loop_no_cudnn", "no-cudnn", 90)
    loop.run("loop_no_buckets" if not args.dry_run else "loop_buckets", "buckets", 90)
    checkpoint = work / "loop" / "eager" / "checkpoints" / "checkpoint_last.pt"
    if checkpoint.is_file():
        source = work / "source.txt"
        lines = (
            ROOT / args.corpus / "valid.en"
            if corpus and (ROOT / args.corpus / "valid.en").is_file()
            else None
        )
        text = lines.read_text(encoding="utf-8").splitlines()[:500] if lines else _words(50)
        source.write_text("".join(line + "\n" for line in text), encoding="utf-8")
        check.translations(checkpoint, source, work)
    check.run("benchmark", _benchmark(args.dry_run, args.out / "benchmark.json"), 150)
    return check.results


class Loop:
    """The loop section's runs, each a step of its own; the figures of all gathered in loop.json."""

    def __init__(self, check: Check, work: Path, corpus: list[str]) -> None:
        self.check, self.work, self.corpus = check, work, corpus
        self.rows: list[dict] = []

    def run(self, name: str, runs: str, timeout: int, compiled: bool = False) -> None:
        if compiled and self.check.dry_run:  # compiling takes minutes on a CPU: the plumbing without it
            runs = ",".join(r for r in runs.split(",") if r in ("peer",))
            if not runs:
                return
        out = self.work / f"{name}.json"
        command = [sys.executable, "scripts/benchmark.py", "--sections", "loop", "--loop-runs", runs]
        command += ["--loop-work", str(self.work), "--json", str(out), *self.corpus]
        if self.check.dry_run:
            command += ["--device", "cpu", "--size", "tiny", "--threads", "1", "--loop-steps", "2,2"]
        else:
            command += ["--device", "cuda", "--size", "base"]
        self.check.run(name, command, timeout)
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
        """`command` under `timeout -k 10` (a process busy compiling may ignore a plain SIGTERM)."""
        start = time.monotonic()
        timeout = min(timeout, int(self.deadline - start))
        status: int | str = "no time left"
        if timeout > 0:
            with open(self.out / "steps.log", "a") as log:
                log.write(f"\n===== {name}: {' '.join(command)}\n")
                log.flush()
                limited = ["timeout", "-k", "10", str(timeout), *command]
                try:
                    status = subprocess.run(
                        limited, cwd=ROOT, env=self.env, stdout=log, stderr=log, timeout=timeout + 30
                    ).returncode
                except subprocess.TimeoutExpired:
                    status = f"timeout ({timeout} s)"
                status = f"timeout ({timeout} s)" if status in (124, 137) else status
        self.results[name] = {"ok": status == 0, "status": status, "seconds": round(time.monotonic() - start)}
        print(f"{name}: {'ok' if status == 0 else f'FAILED: {status}'} in {self.results[name]['seconds']} s")
        self.write()
        return status == 0

    def translations(self, checkpoint: Path, source: Path, work: Path) -> None:
        """translate.py without and with CUDA graphs (a dry run: twice without), compared line by line."""
        outputs = []
        for name, graphs in (("translate", False), ("translate_cuda_graphs", not self.dry_run)):
            output = work / f"{name}.de"
            command = [sys.executable, "translate.py", f"checkpoint={checkpoint}", f"input={source}"]
            command += [f"output={output}", f"cuda_graphs={str(graphs).lower()}", f"device={self.device}"]
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


def environment(wheels: Path, site: Path) -> dict[str, str]:
    """This process's environment, with the wheels in `wheels` installed into `site` (and on PYTHONPATH)
    where one of NEEDED is missing."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), env.get("PYTHONPATH")])
    )  # the steps' scripts
    if all(importlib.util.find_spec(name) for name in NEEDED) or not wheels.is_dir():
        return env
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site)]
    subprocess.run([*install, *map(str, sorted(wheels.glob("*.whl")))], check=True)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


_ENVIRONMENT = """
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__)
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 2**30, "GiB")
"""


def _pytest(dry_run: bool) -> list[str]:
    """The GPU tests (a dry run only collects them)."""
    collect = ["--collect-only", "-q"] if dry_run else ["-q"]
    return [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "no:cacheprovider", *collect]


def _benchmark(dry_run: bool, json_path: Path) -> list[str]:
    """The fixed-shape training step at the base size against torch.nn.Transformer (a dry run: the data
    section, tiny)."""
    command = [sys.executable, "scripts/benchmark.py", "--json", str(json_path)]
    if dry_run:
        return [*command, "--device", "cpu", "--size", "tiny", "--sections", "data", "--data-pairs", "20000"]
    return [*command, "--device", "cuda", "--size", "base", "--sections", "train", "--peers", "torch"]


def _words(n: int) -> list[str]:
    """`n` short English sentences for the dry run's translations."""
    return [f"the house number {i} is small" for i in range(n)]


if __name__ == "__main__":
    main()
