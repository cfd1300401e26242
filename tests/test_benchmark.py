"""benchmarks/benchmark.py through its command line and its JSON, at tiny sizes on the CPU: every
section runs and reports sane figures, a failing section or compile leaves the rest reported, and a
saved run's goals are those of its device.

Speed itself is never asserted (no timing assertions); the checks are on what the harness must get right
whatever the machine: every contender measured, positive rates, exactly the forced number of output
tokens from every decoder, padding fractions that are fractions, prepare() reading every pair.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import transformer.kernels as kernels_module
from transformer.config import DecodeConfig
from transformer.inference.translation import rows as decoding_rows
from transformer.kernels import Kernels, Products
from transformer.kernels.timing import decoding_kernels
from transformer.utils import devices
from transformer.utils.devices import CpuFeatures

ROOT = Path(__file__).resolve().parents[1]
BENCHMARK = ROOT / "benchmarks" / "benchmark.py"
TINY = [
    "--size", "tiny", "--device", "cpu", "--threads", "1", "--steps", "2", "--warmup", "1",
    "--batch", "4", "--length", "8", "--budget-tokens", "256", "--real-batches", "2",
]  # fmt: skip


def run_benchmark(tmp_path: Path, *flags: str, env: dict[str, str] | None = None, ok: bool = True) -> dict:
    """The command's JSON report; `ok`: whether it must exit 0."""
    out = tmp_path / "bench.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), *TINY, *flags, "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, env=env,
    )  # fmt: skip
    assert (done.returncode == 0) == ok, done.stdout[-2000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


def write_corpus(directory: Path, n: int) -> None:
    subjects = ["The cat", "A dog", "My friend", "The old man", "Her sister"]
    objects = ["the house", "a red ball", "the tree", "a small boat", "the river"]
    en = [f"{subjects[i % 5]} sees {objects[(i // 5) % 5]} number {i}." for i in range(n)]
    de = [f"{subjects[i % 5]} sieht {objects[(i // 5) % 5]} Nummer {i}." for i in range(n)]
    directory.mkdir()
    (directory / "train.en").write_text("\n".join(en) + "\n")
    (directory / "train.de").write_text("\n".join(de) + "\n")


def side_rows() -> list[str]:
    """Ours beside itself on this CPU: without the CPU kernels, and with all of them where this machine
    chooses fewer (e.g. AVX2)."""
    cpu = torch.device("cpu")
    fewer = Kernels.choose(cpu).record() != Kernels.choose(cpu, "on").record()
    return ["ours (kernels off)"] + ["ours (kernels on)"] * fewer


def check_train(train: dict, families: set[str], modes: set[str]) -> None:
    """Every family in every mode; on a CPU also ours beside itself (`side_rows`), eager."""
    rows = train["fixed"]
    families = families | set(side_rows())
    expected = {(f, m) for f in families for m in modes if f not in side_rows() or m == "eager"}
    assert {(r["model"], r["mode"]) for r in rows} == expected
    for r in rows:
        for key in ("tokens_per_s", "ms_per_step", "gflop_per_step", "mfu", "params_m", "first_step_s"):
            assert r[key] > 0, (r["model"], key)
        assert r["ours_over_this"] > 0
    sampled = train["sampled"]
    assert {r["model"] for r in sampled["rows"]} == families
    assert all(r["tokens_per_s"] > 0 for r in sampled["rows"])
    assert all(0 <= f < 1 for f in sampled["padding_fraction"].values())
    assert all(p["hours"] > 0 for p in train["projections"])


def test_every_section_at_tiny_sizes(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("ctranslate2")
    corpus = tmp_path / "corpus"
    write_corpus(corpus, 300)
    sentences, new_tokens = 3, 5
    report = run_benchmark(
        tmp_path, "--no-compile", "--beam-sentences", str(sentences), "--greedy-sentences", str(sentences),
        "--src-len", "6", "--new-tokens", str(new_tokens), "--decode-rounds", "1", "--vocabulary-map", "100",
        "--data-pairs", "20000", "--corpus-dir", str(corpus), "--prepare-vocab", "60",
    )  # fmt: skip
    check_train(report["train"], {"ours", "nn.Transformer", "Marian (HF)"}, {"eager"})
    for name, mode in report["decode"].items():
        policies = ["ours, n-best 4", "ours, 4 samples (top-k 50)"] if name == "beam4" else []
        decoders = [
            "ours",
            "ours, products only",  # the bound: its linear maps alone
            *policies,  # the search's other policies, against beam 4 only
            "ours, 100 candidates",  # --vocabulary-map: a shortlist of 100 pieces per batch
            "ours (kernels off)",  # on a CPU, beside the kernels timed for decoding: none,
            "ours (kernels on)",  # and all (the timed choice never holds training's noise dropout)
            "ours int8",
            "ours int8, products only",
            "CTranslate2 float32",
            "CTranslate2 int8",
            "CTranslate2 int8_float32",
        ]
        assert [r["decoder"] for r in mode["rows"]] == [*decoders, "HF generate"]
        for r in mode["rows"]:
            # EOS suppressed, length capped: every decoder outputs exactly the forced number of tokens
            assert r["output_tokens"] == sentences * new_tokens, r["decoder"]
            assert r["tokens_per_s"] > 0 and r["sentences_per_s"] > 0
    data = report["data"]
    assert data["batches"] > 0 and data["construct_s"] >= 0 and data["epoch_batches_s"] > 0
    assert all(0 <= f < 1 for f in data["padding_fraction"].values() if f is not None)
    assert data["prepare"]["pairs_read"] == 300 and data["prepare"]["pairs_per_s"] > 0
    reading = data["prepare"]["batch_reading"]
    assert reading["batches"] > 0 and reading["sentences_per_batch"] > 0 and reading["ms_per_batch"] > 0
    for rows in (data["buckets"], data["prepare"]["buckets"]):  # synthetic lengths, the prepared corpus
        off, *bucketed = rows
        assert off["length_buckets"] == 0 and off["buckets"] is None
        for r in bucketed:  # a few shapes, bought with padding and so fewer real tokens per step
            assert (
                1 <= r["shapes"] <= len(r["buckets"]) <= r["length_buckets"] and r["shapes"] <= off["shapes"]
            )
            assert r["padding_src"] >= off["padding_src"] and 0 < r["padding_tgt"] < 1
            assert 0 < r["real_tgt_tokens_per_step"] <= off["real_tgt_tokens_per_step"]
    assert data["buckets"][1]["shapes"] < data["buckets"][0]["shapes"]  # 20,000 pairs: fewer with buckets
    goals = {t["goal"]: t for t in report["targets"]}

    def round_by_round(rows: list[dict], name_key: str, times: str, ours: str, peer: str) -> float:
        """The median over the rounds of ours' speed over the peer's, from each round's seconds."""
        seconds = {r[name_key]: r[times] for r in rows}
        return statistics.median(p / o for o, p in zip(seconds[ours], seconds[peer]))

    fixed = report["train"]["fixed"]  # eager only here
    ratio = goals["train step, ours (eager) vs nn.Transformer (eager)"]["ratio"]
    assert ratio == pytest.approx(round_by_round(fixed, "model", "step_times_s", "ours", "nn.Transformer"))
    beam = report["decode"]["beam4"]["rows"]
    ratio = goals["beam 4, ours vs HF generate"]["ratio"]
    assert ratio == pytest.approx(round_by_round(beam, "decoder", "run_times_s", "ours", "HF generate"))
    assert "beam 4, ours vs CTranslate2 float32" in goals
    for goal in report["targets"]:  # the median of the rounds' ratios, within their range
        lo, hi = goal["range"]
        assert lo <= goal["ratio"] <= hi and goal["rounds"] >= 1
    ratio = goals["beam 4, ours int8 vs CTranslate2 int8"]["ratio"]  # int8 against int8
    assert ratio == pytest.approx(
        round_by_round(beam, "decoder", "run_times_s", "ours int8", "CTranslate2 int8")
    )
    # the bound of each goal against CTranslate2: the peer against ours' products alone, round by round
    # (greedy has goals of its own on a CPU without AVX-512)
    rows = {"beam 4": beam, "greedy": report["decode"]["greedy"]["rows"]}
    bounded = [goal for goal in goals if " vs CTranslate2" in goal]
    assert len(bounded) >= 2  # beam 4 in float32 and in int8 at least
    for goal in bounded:
        mode, contest = goal.split(", ", 1)
        ours, peer = contest.split(" vs ")
        products = f"{ours}, products only"
        expected = round_by_round(rows[mode], "decoder", "run_times_s", products, peer)
        assert goals[goal]["bound"] == pytest.approx(expected)


@pytest.mark.slow
def test_compiled_models_and_the_big_model(tmp_path):
    """Every model compiled too; the big model measured, and its measured speed the basis of the big
    budget's fixed-shape projection only (the sampled-batch one scales ours by the FLOPs counted)."""
    report = run_benchmark(tmp_path, "--sections", "train", "--peers", "torch", "--big")
    train = report["train"]
    check_train(train, {"ours", "nn.Transformer"}, {"eager", "compiled"})
    assert train["big_tokens_per_s"] > 0
    rows = {(r["budget"][:4], r["basis"][:5]): r for r in train["projections"]}
    assert rows["big ", "fixed"]["tokens_per_s"] == train["big_tokens_per_s"]
    sampled = next(r for r in train["sampled"]["rows"] if r["model"] == "ours")
    scale = 1 / train["big_over_measured_flops_per_step"]
    assert rows["big ", "sampl"]["tokens_per_s"] == pytest.approx(sampled["tokens_per_s"] * scale)


def test_a_failing_section_leaves_the_others_reported_and_fails_the_run(tmp_path):
    """Sections run in the order given, each written as it ends: one that fails (here the loop, on a
    corpus folder without its files) is noted, those before and after it are reported, the run fails."""
    empty = tmp_path / "empty"
    empty.mkdir()
    flags = ["--sections", "data,loop,data", "--data-pairs", "2000", "--loop-corpus", str(empty)]
    report = run_benchmark(tmp_path, *flags, "--loop-steps", "1,1", ok=False)
    assert "loop" not in report and report["data"]["batches"] > 0
    assert any(note.startswith("section loop failed: ") for note in report["notes"]), report["notes"]


def test_a_compile_that_fails_leaves_only_the_compiled_models_out(tmp_path):
    """A compiler that cannot build (no working C++ compiler here) drops each compiled model with a
    note; the eager figures, measured and written before any compile, stay."""
    flags = ["--sections", "train", "--peers", "torch"]
    report = run_benchmark(tmp_path, *flags, env={"CXX": "false", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    rows = report["train"]["fixed"]
    assert {(r["model"], r["mode"]) for r in rows} == {
        ("ours", "eager"), *((side, "eager") for side in side_rows()), ("nn.Transformer", "eager"),
    }  # fmt: skip
    assert all(r["tokens_per_s"] > 0 for r in rows)
    failed = [note for note in report["notes"] if "compiled failed and is left out" in note]
    assert {note.split(" compiled")[0] for note in failed} == {"ours", "nn.Transformer"}, report["notes"]


def summarize(tmp_path: Path, report: dict, main: Callable[[list[str]], str] | None = None) -> dict[str, str]:
    """`--summarize` on a saved report: each goal's printed line, by goal; the command itself, or its
    `main` in this process (what it prints)."""
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps(report))
    if main is None:
        done = subprocess.run(
            [sys.executable, str(BENCHMARK), "--summarize", str(saved)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        printed = done.stdout
    else:
        printed = main(["--summarize", str(saved)])
    goals = [line.strip() for line in printed.splitlines() if line.startswith("  ")]
    return {line.split(": ")[0]: line.split(": ", 1)[1] for line in goals}


def test_the_goals_of_a_saved_run_are_those_of_its_device(tmp_path, monkeypatch, capsys):
    """On CUDA: vs the compiled nn.Transformer (2x), the peak memory with weights and Adam (<= 10 GiB) and
    beam 4 vs Hugging Face (5x); on an AVX-512 CPU: vs nn.Transformer in its fastest mode (1.3x), beam 4
    vs CTranslate2 (1.2x) and Hugging Face (2x); on AVX2: 1.0x, beam 4 1.0x and 1.2x in 8 bits, greedy
    1.1x, each against CTranslate2 with its bound; on ARM no 8-bit goal. Decoding goals take the fastest
    of ours."""

    def row(model, mode, tokens_per_s, total_mib):
        return {"model": model, "mode": mode, "tokens_per_s": tokens_per_s, "peak_total_mib": total_mib}

    fixed = [
        row("ours", "eager", 900.0, 9000.0),
        row("ours", "compiled", 1000.0, 11000.0),
        row("nn.Transformer", "eager", 520.0, 20000.0),
        row("nn.Transformer", "compiled", 480.0, 21000.0),
    ]
    beam = [
        {"decoder": "ours", "tokens_per_s": 600.0},
        {"decoder": "ours, CUDA graphs", "tokens_per_s": 1100.0},
        {"decoder": "CTranslate2 bfloat16", "tokens_per_s": 1000.0},
        {"decoder": "HF generate", "tokens_per_s": 250.0},
    ]
    report = {
        "train": {"fixed": fixed, "shape": {"target_tokens": 24576}},
        "decode": {"beam4": {"rows": beam}},
    }

    cuda = summarize(tmp_path, {**report, "meta": {"device": "cuda"}})  # the command, once
    benchmark = load_benchmark(monkeypatch)

    def main(argv: list[str]) -> str:
        benchmark.main(argv)
        return capsys.readouterr().out

    assert cuda["train step, ours (compiled) vs nn.Transformer (compiled)"] == "2.08x (target >= 2.0x: met)"
    memory = cuda["train step peak memory, ours (compiled), 24,576 target tokens"]
    assert memory == "10.7 GiB (target <= 10 GiB: NOT met)"
    assert cuda["beam 4, ours, CUDA graphs vs HF generate"] == "4.40x (target >= 5.0x: NOT met)"
    assert cuda["beam 4, ours, CUDA graphs vs CTranslate2 bfloat16"] == "1.10x (target >= 1.0x: met)"

    del beam[1]  # a CPU run has no CUDA graphs, and has int8 rows
    beam += [
        {"decoder": "ours int8", "tokens_per_s": 800.0},
        {"decoder": "CTranslate2 int8", "tokens_per_s": 700.0},
    ]
    cpu = summarize(tmp_path, {**report, "meta": {"device": "cpu", "cpu": {"isa": "AVX512-BF16"}}}, main)
    assert cpu["beam 4, ours int8 vs CTranslate2 int8"] == "1.14x (target >= 1.2x: NOT met)"
    assert cpu["train step, ours (compiled) vs nn.Transformer (eager)"] == "1.92x (target >= 1.3x: met)"
    assert cpu["beam 4, ours vs CTranslate2 bfloat16"] == "0.60x (target >= 1.2x: NOT met)"
    assert cpu["beam 4, ours vs HF generate"] == "2.40x (target >= 2.0x: met)"
    assert not any("memory" in goal for goal in cpu)
    avx2 = summarize(tmp_path, {**report, "meta": {"device": "cpu", "cpu": {"isa": "AVX2"}}}, main)
    assert avx2["train step, ours (compiled) vs nn.Transformer (eager)"].endswith("(target >= 1.0x: met)")
    assert avx2["beam 4, ours vs CTranslate2 bfloat16"].endswith("(target >= 1.0x: NOT met)")
    assert avx2["beam 4, ours int8 vs CTranslate2 int8"].endswith("(target >= 1.2x: NOT met)")
    # greedy has goals there too (1.1x), and a goal against CTranslate2 its bound: the products alone
    greedy = [
        {"decoder": "ours", "tokens_per_s": 900.0},
        {"decoder": "ours, products only", "tokens_per_s": 1400.0},
        {"decoder": "CTranslate2 float32", "tokens_per_s": 1000.0},
    ]
    with_greedy = {**report, "decode": {**report["decode"], "greedy": {"rows": greedy}}}
    avx2 = summarize(tmp_path, {**with_greedy, "meta": {"device": "cpu", "cpu": {"isa": "AVX2"}}}, main)
    assert avx2["greedy, ours vs CTranslate2 float32"] == (
        "0.90x (target >= 1.1x: NOT met; its products alone 1.40x)"
    )
    wide = summarize(tmp_path, {**with_greedy, "meta": {"device": "cpu", "cpu": {"isa": "AVX-512"}}}, main)
    assert not any(goal.startswith("greedy") for goal in wide)  # AVX-512 CPUs: beam 4 goals only
    # each round's times: the median of the rounds' ratios (1.05), not the ratio of the medians (1.30)
    beam[0]["run_times_s"] = [1.0, 1.0, 1.0, 1.0, 1.0]
    beam[1]["run_times_s"] = [1.05, 1.3, 1.05, 1.3, 1.05]
    rounds = summarize(tmp_path, {**report, "meta": {"device": "cpu", "cpu": {"isa": "AVX2"}}}, main)
    assert rounds["beam 4, ours vs CTranslate2 bfloat16"] == (
        "1.05x (median of 5 rounds, 1.05-1.30; target >= 1.0x: met)"
    )
    del beam[-2]  # an ARM CPU: no int8 of ours (fbgemm is x86 only), so no int8 goal
    arm = summarize(tmp_path, {**report, "meta": {"device": "cpu", "cpu": {"isa": "DEFAULT"}}}, main)
    assert "beam 4, ours vs CTranslate2 bfloat16" in arm and not any("int8" in goal for goal in arm)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--loop-steps", "0,3"], "--loop-steps"),
        (["--loop-steps", "5"], "--loop-steps"),
        (["--loop-runs", "fast"], "unknown section(s), peer(s) or loop run(s): fast"),
        (["--vocabulary-map", "3"], "--vocabulary-map=3 must be 0 (off) or 5 to 37,000 pieces"),
    ],
)
def test_bad_flags_are_refused_before_any_work(flags, said):
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), "--sections", "loop", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and said in done.stderr


def load_benchmark(monkeypatch: pytest.MonkeyPatch):
    """benchmarks/benchmark.py as a module, with benchmarks/ on the path as when it runs, for its main(argv)
    in this process (where the CPU can be faked)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("benchmark", BENCHMARK)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    return benchmark


def test_the_nn_transformer_peer_drops_out_where_the_paper_does(monkeypatch):
    """§5.4: dropout on sub-layer outputs and embedding sums only, as ours and Marian: nn.Transformer's
    dropout on attention weights and inside the feed-forward would be work the others do not do."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from harness.peers import TorchTransformerPeer

    from transformer.config import ModelConfig

    peer = TorchTransformerPeer(ModelConfig(vocab_size=50, d_model=16, n_heads=2, d_ff=32, n_layers=2), 0.1)
    layers = [*peer.core.encoder.layers, *peer.core.decoder.layers]
    attentions = [m for m in peer.modules() if isinstance(m, torch.nn.MultiheadAttention)]
    assert len(attentions) == 6 and all(m.dropout == 0.0 for m in attentions)
    assert all(layer.dropout.p == 0.0 and layer.dropout1.p == 0.1 for layer in layers)
    assert all(layer.dropout2.p == 0.1 for layer in layers) and peer.dropout.p == 0.1
    assert all(layer.dropout3.p == 0.1 for layer in peer.core.decoder.layers)


def test_the_loop_section_runs_train_py_and_the_peer_over_the_same_batches(tmp_path):
    """--sections loop: train.py processes (eager; with 12 length buckets, off by default on a CPU) on a
    synthetic corpus it prepares, then torch.nn.Transformer over the eager run's batches: the same real
    target tokens per step, both windows timed, no recompile, every run's log kept."""
    out, work = tmp_path / "bench.json", tmp_path / "work"
    flags = ["--sections", "loop", "--loop-runs", "eager,buckets,peer", "--loop-steps", "2,2"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "benchmark.py"), "--size", "tiny", "--device", "cpu",
         "--threads", "1", *flags, "--loop-work", str(work), "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "loop: train.py from process start" in done.stdout
    loop = json.loads(out.read_text())["loop"]
    rows = {row["run"]: row for row in loop["rows"]}
    assert list(rows) == ["eager", "buckets", "peer"] and loop["vocab_size"] == 500
    assert rows["eager"]["buckets"] is None and 1 < len(rows["buckets"]["buckets"]) <= 12
    assert rows["peer"]["tokens_per_step"] == rows["eager"]["tokens_per_step"] > 0
    assert all(row["first_tokens_per_s"] > 0 and row["steady_tokens_per_s"] > 0 for row in rows.values())
    assert rows["eager"]["recompiles"] == rows["buckets"]["recompiles"] == 0
    assert "length buckets: none" in (work / "eager.log").read_text()


def test_where_the_machine_chooses_fewer_kernels_ours_also_runs_with_all_of_them(monkeypatch, tmp_path):
    """On an AVX2 CPU (faked) ours trains with the kernels its rule chooses there, and decodes with those
    it times here; beside them it runs with none, and with all of them where the choice is fewer, so
    that one run shows whether the choice wins."""
    avx2 = CpuFeatures("AVX2", True, False, False, "x86 with AVX2")
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: avx2)
    packed, prepacked = [], Products.prepacked  # which products decode with packed weights, as translate.py

    def recording(products, weights, int8=False):
        packed.append((products.pack, int8))
        return prepacked(products, weights, int8)

    benchmark = load_benchmark(monkeypatch)
    monkeypatch.setattr(devices, "cpu_features", lambda: avx2)
    cpu, shapes = torch.device("cpu"), decoding_rows(DecodeConfig(checkpoint="-"))
    torch.set_num_threads(1)  # as --threads 1 sets them
    decoding_kernels(benchmark.SIZES["tiny"], cpu, "auto", False, *shapes)  # timed now: the run takes it
    monkeypatch.setattr(Products, "prepacked", recording)
    flags = ["--no-compile", "--peers", "", "--beam-sentences", "2", "--greedy-sentences", "2"]
    flags += ["--src-len", "4", "--new-tokens", "3", "--decode-rounds", "1"]
    report = benchmark.main([*TINY, *flags, "--sections", "train,decode", "--json", str(tmp_path / "b.json")])
    assert report["meta"]["cpu_kernels"] == "noise_dropout, short_attention"
    ours = ["ours", "ours (kernels off)", "ours (kernels on)"]
    assert [r["model"] for r in report["train"]["fixed"]] == ours
    assert [r["model"] for r in report["train"]["sampled"]["rows"]] == ours
    prefix = "ours decodes with CPU kernels "
    [decoding] = [note[len(prefix) :].split(" (")[0] for note in report["notes"] if note.startswith(prefix)]
    fewer = decoding != Kernels.choose(torch.device("cpu"), "on").describe()
    for mode in report["decode"].values():
        names = {r["decoder"] for r in mode["rows"]}
        assert {"ours", "ours (kernels off)"} <= names and ("ours (kernels on)" in names) == fewer
        assert all(r["output_tokens"] == 2 * 3 for r in mode["rows"])
    named = decoding.split(", ")
    ours_packed = "packed" in named or ("onednn" in named and "unpacked" not in named)
    expected = [(ours_packed, False), (False, True)] + [(True, False)] * fewer  # ours, its int8 copy, all on
    assert sorted(packed) == sorted(expected), (decoding, packed)


def test_on_a_cpu_that_is_not_x86_ours_decodes_without_int8_and_says_so(monkeypatch, tmp_path):
    """ARM (faked): no CPU kernel chosen, ours with all of them beside, and no int8 row (fbgemm is x86
    only): the decode section still runs and notes it."""
    arm = CpuFeatures("DEFAULT", False, False, False, "Apple M2")
    monkeypatch.setattr(kernels_module, "cpu_features", lambda: arm)
    benchmark = load_benchmark(monkeypatch)
    monkeypatch.setattr(devices, "cpu_features", lambda: arm)
    flags = ["--peers", "", "--beam-sentences", "2", "--greedy-sentences", "2", "--src-len", "4"]
    flags += ["--new-tokens", "3", "--decode-rounds", "1", "--sections", "decode"]
    report = benchmark.main([*TINY, *flags, "--json", str(tmp_path / "b.json")])
    assert report["meta"]["cpu_kernels"] == "none"
    for mode in report["decode"].values():
        names = [r["decoder"] for r in mode["rows"]]
        assert {"ours", "ours (kernels off)", "ours (kernels on)"} <= set(names) and "ours int8" not in names
    assert (
        "ours int8 left out: precision=int8 multiplies with fbgemm, PyTorch's x86 engine for CPUs with AVX2 "
        "or newer; this CPU is not an x86 one: use precision=fp32" in report["notes"]
    )
