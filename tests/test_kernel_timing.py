"""Decoding's CPU kernels chosen by timing them where they run (transformer/kernels/timing.py), driven
by an injected timer (no timed assertions): a tie keeps plain PyTorch, a win in all rounds but one in
five takes it, a decision is kept and reused, a corrupt file of decisions is ignored; and every
configuration the timing can choose decodes as plain PyTorch does, to float32 rounding."""

from __future__ import annotations

import itertools
import json
import logging

import pytest
import torch
from conftest import sources, tiny_model
from test_translate_cli import translate

from transformer.config import ModelConfig, SearchConfig
from transformer.decoding import beam_search, search_weights
from transformer.kernels import Kernels
from transformer.kernels.timing import decoding_kernels

CPU = torch.device("cpu")
CFG = ModelConfig(vocab_size=100, d_model=32, n_heads=4, d_ff=64, n_layers=2)
CANDIDATES = ("packed", "onednn", "short_attention")


def scripted(seconds: dict[str, list[float]], calls: list[str] | None = None):
    """A timer that runs nothing and says each candidate took the next of its `seconds` in turn (keys:
    "plain" and "candidate"); `calls` gets every label it was asked for."""
    turns = {label: itertools.cycle(values) for label, values in seconds.items()}

    def timer(label: str, _work) -> float:
        if calls is not None:
            calls.append(label)
        return next(turns[label.split("/")[1]])

    return timer


def choose(tmp_path, timer, int8: bool = False, setting: str = "auto") -> Kernels:
    return decoding_kernels(CFG, CPU, setting, int8, 64, 512, timer=timer, cache=tmp_path / "kernels.json")


def chosen(kernels: Kernels) -> dict[str, bool]:
    return {name: getattr(kernels, name) for name in CANDIDATES}


def test_a_tie_keeps_plain_pytorch(tmp_path):
    """0.99 ms against 1.00 ms on the medians: within the 3% margin, not a win."""
    timer = scripted({"plain": [1.00e-3], "candidate": [0.97e-3, 0.99e-3, 1.01e-3]})
    assert chosen(choose(tmp_path, timer)) == dict.fromkeys(CANDIDATES, False)


def test_a_win_in_every_round_takes_it(tmp_path):
    timer = scripted({"plain": [1.00e-3], "candidate": [0.79e-3, 0.80e-3, 0.81e-3]})
    assert chosen(choose(tmp_path, timer)) == dict.fromkeys(CANDIDATES, True)


def test_one_round_the_machine_disturbed_does_not_decide(tmp_path):
    """20% faster in four rounds of five, five times slower in one (another job took the cores): a win."""
    timer = scripted({"plain": [1.00e-3], "candidate": [0.8e-3, 0.8e-3, 5e-3, 0.8e-3, 0.8e-3]})
    assert chosen(choose(tmp_path, timer)) == dict.fromkeys(CANDIDATES, True)


def test_a_faster_median_that_loses_two_rounds_in_five_is_no_win(tmp_path):
    timer = scripted({"plain": [1.00e-3], "candidate": [0.8e-3, 1.1e-3, 0.8e-3, 1.1e-3, 0.8e-3]})
    assert chosen(choose(tmp_path, timer)) == dict.fromkeys(CANDIDATES, False)


def test_each_candidate_is_timed_in_interleaved_rounds_within_the_budget(tmp_path):
    """At least five rounds each, plain and candidate in turn, and no more once the budget is spent."""
    calls = []
    choose(tmp_path, scripted({"plain": [0.1], "candidate": [0.1]}, calls))
    for name in CANDIDATES:
        mine = [label for label in calls if label.startswith(f"{name}/")]
        assert mine[:4] == [f"{name}/plain", f"{name}/candidate"] * 2
        assert len(mine) == 2 * 5  # 0.5 s of budget is spent after 3 rounds: the fifth ends it


def test_the_decision_is_kept_and_reused_and_forced_settings_time_nothing(tmp_path, caplog):
    win = scripted({"plain": [1.0e-3], "candidate": [0.5e-3]})
    first = choose(tmp_path, win)
    kept = json.loads((tmp_path / "kernels.json").read_text())
    [(key, decision)] = kept.items()
    assert "threads" in key and "d32 h4/4" in key and decision["kernels"] == chosen(first)
    assert decision["timings"]["packed"]["plain"] == pytest.approx(1.0e-3)

    def untimed(label, _work):
        raise AssertionError(f"timed {label} again")

    with caplog.at_level(logging.INFO, logger="transformer.kernels.timing"):
        again = choose(tmp_path, untimed)
    assert chosen(again) == chosen(first) and "timed before on this machine" in caplog.text
    assert not choose(tmp_path, untimed, setting="off").packed
    assert choose(tmp_path, untimed, setting="on").packed
    off_cpu = decoding_kernels(CFG, torch.device("meta"), "auto", False, 64, 512, untimed, tmp_path / "x")
    assert chosen(off_cpu) == dict.fromkeys(CANDIDATES, False)


def test_in_8_bits_only_attention_is_timed(tmp_path):
    """The linear maps multiply in 8 bits whatever the choice."""
    calls = []
    kernels = choose(tmp_path, scripted({"plain": [1e-3], "candidate": [1e-3]}, calls), int8=True)
    assert {label.split("/")[0] for label in calls} == {"short_attention"} and kernels.int8


@pytest.mark.parametrize("content", [b"{not json", b"[1, 2]", b'{"key": {"kernels": 3}}', b"\xff\xfe"])
def test_an_unreadable_file_of_decisions_is_ignored_with_a_warning_and_replaced(tmp_path, caplog, content):
    (tmp_path / "kernels.json").write_bytes(content)
    with caplog.at_level(logging.WARNING):
        kernels = choose(tmp_path, scripted({"plain": [1.0e-3], "candidate": [0.5e-3]}))
    assert "ignoring the CPU kernels' decisions in" in caplog.text and kernels.packed
    assert list(json.loads((tmp_path / "kernels.json").read_text()).values())[0]["kernels"]["packed"]


@pytest.mark.parametrize("onednn, packed, short", list(itertools.product([False, True], repeat=3)))
def test_every_configuration_decodes_as_plain_pytorch(onednn, packed, short):
    """In eval mode: the same logits to float32 rounding, the same beam search outputs and scores."""
    model = tiny_model(seed=5, dtype=torch.float32)
    src, tgt = sources([9, 2, 5, 1], 24, seed=6), sources([4, 6, 3, 2], 24, seed=7)
    search = SearchConfig(beam_size=3, max_len_b=6)
    with torch.no_grad():
        plain_logits, plain = model(src, tgt), beam_search(model, src, search)
        kernels = Kernels(onednn=onednn, packed=packed, short_attention=short)
        fast = kernels.apply(model)
        torch.testing.assert_close(fast(src, tgt), plain_logits, rtol=1e-5, atol=1e-5)
        with kernels.products.prepacked(search_weights(fast)):
            found = beam_search(fast, src, search, linear=kernels.products)
    assert found.tokens == plain.tokens
    torch.testing.assert_close(found.scores, plain.scores, rtol=1e-5, atol=1e-5)


def test_a_model_with_training_kernels_takes_decodings_choice_and_back():
    """`Kernels.apply` gives each module the class of its choice, a kernel's or the plain one: training's
    kernels on the live model become decoding's for a validation, on the same parameters."""
    model = tiny_model(seed=1, dtype=torch.float32)
    training = Kernels(onednn=True, noise_dropout=True, short_attention=True).apply(model)
    plain = Kernels().apply(training)
    kinds = {type(m).__name__ for m in plain.modules()}
    assert not kinds & {"OneDNNLinear", "OneDNNFeedForward", "NoiseDropout", "ShortAttention"}
    assert {type(m).__name__ for m in Kernels(packed=True).apply(training).modules()} >= {"OneDNNLinear"}
    assert all(a is b for a, b in zip(plain.parameters(), model.parameters()))


def test_translate_py_says_in_one_line_which_kernels_decoding_takes(tiny_checkpoint, tmp_path):
    """The first run times them and says so with the timings; the next takes the decision kept."""
    env, lines = {"XDG_CACHE_HOME": str(tmp_path)}, []
    for _ in range(2):
        done = translate(f"checkpoint={tiny_checkpoint}", stdin=b"The cat sees the house.\n", env=env)
        assert done.returncode == 0, done.stderr.decode()
        lines.append([line for line in done.stderr.decode().splitlines() if "CPU kernels" in line])
    assert len(lines[0]) == len(lines[1]) == 1
    assert lines[0][0].startswith("INFO: CPU kernels for decoding: ") and "(timed now: packed " in lines[0][0]
    assert lines[1][0].endswith("(timed before on this machine)")
    assert [p.name for p in tmp_path.iterdir()] == ["transformer"]
