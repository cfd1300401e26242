"""Every GPU check of the project in one command, for a GPU machine lent for minutes: the GPU tests, the
benchmark, a short bf16 training run through train.py eager and then compiled, translation with and
without CUDA graphs compared line by line, and peak memory. Each step runs in its own process with its
own time limit inside one budget, so a failure or a timeout costs only that step; the results go to
`summary.json`, `summary.md`, `benchmark.json` and `steps.log` (every step's output) in --out (default
$OUT, else gpu_check/).

    python scripts/gpu_check.py                 # on a CUDA machine: about 8 minutes on one H200
    python scripts/gpu_check.py --dry-run       # anywhere: the same steps at toy sizes on the CPU

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
sys.path.insert(0, str(ROOT))  # a GPU machine runs the checkout as it is, not pip-installed

from transformer.data.toy import generate_splits  # noqa: E402

NEEDED = ("hydra", "omegaconf", "sacremoses")  # imported by train.py, translate.py and the evaluation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="toy sizes on the CPU: checks the plumbing")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "gpu_check")))
    parser.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels of missing packages")
    parser.add_argument("--budget", type=int, default=480, help="seconds for all steps together")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "steps.log").unlink(missing_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        results = run_all(args, Path(work))
    print(f"wrote {args.out / 'summary.md'}")
    sys.exit(0 if all(r["ok"] for r in results.values()) else 1)


def run_all(args: argparse.Namespace, work: Path) -> dict[str, dict]:
    """The steps in order of value (a cut budget loses the last); their results by name."""
    n_train, n_test = (2000, 50) if args.dry_run else (20000, 500)
    data = ["data=toy", f"data.toy.n_train={n_train}", f"data.toy.n_valid={n_test}"]
    data += [f"data.toy.n_test={n_test}", f"data.dir={work / 'toy'}"]
    check = Check(
        args.out, args.dry_run, environment(args.wheels, work / "site"), time.monotonic() + args.budget
    )
    check.run("environment", [sys.executable, "-c", _ENVIRONMENT], 60)
    check.run("gpu_tests", _pytest(args.dry_run), 100)
    check.run("benchmark", _benchmark(args.dry_run, args.out / "benchmark.json"), 300)
    check.run("prepare", [sys.executable, "scripts/prepare_data.py", *data], 60)
    if check.train("train_eager", work / "eager", data, compile=False):
        source = work / "test.en"
        source.write_text("".join(en + "\n" for en, _ in generate_splits(0, 0, n_test, 1234)["test"]))
        check.translations(work / "eager" / "checkpoints" / "checkpoint_last.pt", source, work)
    check.train("train_compiled", work / "compiled", data, compile=not args.dry_run)
    return check.results


class Check:
    """Runs the steps in order within one time budget and writes the summary after each step (a kill
    keeps what was measured)."""

    def __init__(self, out: Path, dry_run: bool, env: dict[str, str], deadline: float) -> None:
        self.out, self.dry_run, self.env, self.deadline = out, dry_run, env, deadline
        self.device = "cpu" if dry_run else "cuda"
        self.results: dict[str, dict] = {}

    def run(self, name: str, command: list[str], timeout: int) -> bool:
        start = time.monotonic()
        timeout = min(timeout, int(self.deadline - start))
        status: int | str = "no time left"
        if timeout > 0:
            with open(self.out / "steps.log", "a") as log:
                log.write(f"\n===== {name}: {' '.join(command)}\n")
                log.flush()
                try:
                    status = subprocess.run(
                        command, cwd=ROOT, env=self.env, stdout=log, stderr=log, timeout=timeout
                    ).returncode
                except subprocess.TimeoutExpired:
                    status = f"timeout ({timeout} s)"
        self.results[name] = {"ok": status == 0, "status": status, "seconds": round(time.monotonic() - start)}
        print(f"{name}: {'ok' if status == 0 else f'FAILED: {status}'} in {self.results[name]['seconds']} s")
        self.write()
        return status == 0

    def train(self, name: str, run_dir: Path, data: list[str], compile: bool) -> bool:
        """train.py: the base model on the toy corpus in bf16 for 120 steps (a dry run: the demo's
        model, 3 steps in fp32 on the CPU, never compiled: that takes minutes on a CPU), then its last
        logged speed and memory."""
        command = [sys.executable, "train.py", *data, f"trainer.run_dir={run_dir}", "trainer.progress=false"]
        command += ["trainer.save_every_minutes=0", f"trainer.compile={str(compile).lower()}"]
        command += ["finish.average_last=0", "finish.evaluate_split=null", f"trainer.device={self.device}"]
        if self.dry_run:
            command += ["experiment=demo", "trainer.max_steps=3", "trainer.log_every_steps=1"]
        else:
            command += ["model=base", "trainer.max_steps=120", "trainer.save_every_steps=120"]
            command += ["trainer.log_every_steps=20", "trainer.eval_every_steps=120"]
        if not self.run(name, command, 150 if compile else 90):
            return False
        self.results[name].update(_training_figures(run_dir))
        self.write()
        return True

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
        rows = [f"| {n} | {r['status']} | {r['seconds']} | {_figures(r)} |" for n, r in self.results.items()]
        kind = "dry run on the CPU" if self.dry_run else "CUDA"
        table = "| step | status | seconds | figures |\n|---|---|---|---|\n" + "\n".join(rows)
        (self.out / "summary.md").write_text(f"GPU check ({kind})\n\n{table}\n")


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
    """Every section at the base size (a dry run: the data section, tiny)."""
    command = [sys.executable, "scripts/benchmark.py", "--json", str(json_path)]
    if dry_run:
        return [*command, "--device", "cpu", "--size", "tiny", "--sections", "data", "--data-pairs", "20000"]
    return [*command, "--device", "cuda", "--size", "base"]


def _training_figures(run_dir: Path) -> dict:
    """The last logged target tokens/s, model FLOP utilisation and peak memory of a run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    logged = events.Tags()["scalars"]
    tags = ("train/tokens_per_s", "train/mfu", "train/peak_mem_gib")
    return {tag[6:]: round(events.Scalars(tag)[-1].value, 3) for tag in tags if tag in logged}


if __name__ == "__main__":
    main()
