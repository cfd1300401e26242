"""The average of the weights (`trainer.ema_decay`): its recurrence written out from the checkpoints,
training itself unchanged (bitwise), validation translating with the average, exact resume, averaging."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training_run import compose_config, corpus, overrides  # noqa: F401 (corpus: a fixture)

from transformer.checkpoint import average_checkpoints, checkpoint_dir, load_checkpoint
from transformer.config import ConfigError, DecodeConfig, to_dict
from transformer.data.sources import read_split
from transformer.inference.translation import Translator
from transformer.training import Parts, train
from transformer.training.monitor import Monitor

pytestmark = pytest.mark.usefixtures("one_torch_thread")
AVERAGE = Path(__file__).resolve().parents[1] / "scripts" / "average_checkpoints.py"
DECAY, STEPS = 0.9, 8
EVERY_STEP = ("trainer.save_every_steps=1", "trainer.keep_last=20", "trainer.translate_every_steps=4")


def checkpoints(run_dir) -> dict[int, dict]:
    return {k: load_checkpoint(checkpoint_dir(run_dir) / f"checkpoint_{k}.pt") for k in range(1, STEPS + 1)}


VALIDATED: dict[int, torch.Tensor] = {}  # the embedding the EMA run's model held at each validation


def watching() -> Parts:
    """A run's parts that record, at each validation, the embedding its model holds."""
    models = []

    class Watching(Monitor):
        def valid(self, step, loss, nll):
            super().valid(step, loss, nll)
            VALIDATED[step] = models[0].embed.tokens.weight.detach().clone()

    return Parts(monitor=Watching, objective=lambda objective: models.append(objective.model) or objective)


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory):  # noqa: F811
    """The same 8 steps with and without the average, a checkpoint after each."""
    with_ema, without = tmp_path_factory.mktemp("ema"), tmp_path_factory.mktemp("plain")
    common = (f"trainer.max_steps={STEPS}", *EVERY_STEP)
    train(compose_config(overrides(corpus, with_ema, *common, f"trainer.ema_decay={DECAY}")), watching())
    train(compose_config(overrides(corpus, without, *common)))
    return with_ema, without


def test_the_average_follows_its_recurrence_and_training_is_unchanged(runs):
    averaged, plain = (checkpoints(run) for run in runs)
    for k in range(1, STEPS + 1):
        for name, weight in plain[k]["model"].items():  # the trained weights are those of a run without
            assert torch.equal(averaged[k]["trained_model"][name], weight), (k, name)
        assert "trained_model" not in plain[k]
    for k in range(2, STEPS + 1):  # average_k = d_k average_k-1 + (1 - d_k) weights_k
        d = min(DECAY, (1 + k) / (10 + k))
        for name, average in averaged[k]["model"].items():
            if average.is_floating_point():
                expected = d * averaged[k - 1]["model"][name] + (1 - d) * averaged[k]["trained_model"][name]
                torch.testing.assert_close(average, expected, rtol=1e-5, atol=1e-7)
        changed = [n for n, a in averaged[k]["model"].items() if not torch.equal(a, plain[k]["model"][n])]
        assert changed  # the average is not the weights


def test_validation_translates_with_the_average(runs, corpus):  # noqa: F811
    """At every validation the model holds the average (the checkpoint's `model`), not the trained
    weights; the hypotheses the run wrote at step 4 are the average's."""
    run_dir = runs[0]
    assert sorted(VALIDATED) == [5, STEPS]  # (trainer.eval_every_steps=5, and after the last step)
    for step, embedding in VALIDATED.items():
        ckpt = load_checkpoint(checkpoint_dir(run_dir) / f"checkpoint_{step}.pt")
        assert torch.equal(embedding, ckpt["model"]["embed.tokens.weight"])
        assert not torch.equal(embedding, ckpt["trained_model"]["embed.tokens.weight"])
    written = (checkpoint_dir(run_dir) / "valid_step4.hyp.de").read_text().splitlines()
    cfg = compose_config(overrides(corpus, run_dir))
    sources = read_split(cfg.data, "valid").src
    search = to_dict(cfg.finish.search)
    decode = DecodeConfig(
        checkpoint=str(checkpoint_dir(run_dir) / "checkpoint_4.pt"), device="cpu", precision="fp32", **search
    )
    assert Translator.from_checkpoint(decode).translate(sources) == written


def test_a_resumed_run_keeps_its_average_exactly(runs, corpus, tmp_path):  # noqa: F811
    run_dir, args = tmp_path / "resumed", (*EVERY_STEP, f"trainer.ema_decay={DECAY}")
    train(compose_config(overrides(corpus, run_dir, "trainer.max_steps=3", *args)))
    train(compose_config(overrides(corpus, run_dir, f"trainer.max_steps={STEPS}", *args)))
    resumed, whole = (
        load_checkpoint(checkpoint_dir(r) / f"checkpoint_{STEPS}.pt") for r in (run_dir, runs[0])
    )
    for key in ("model", "trained_model"):
        for name, tensor in whole[key].items():
            assert torch.equal(resumed[key][name], tensor), (key, name)


def test_averaging_takes_the_averages_and_leaves_no_trained_weights(runs):
    paths = [checkpoint_dir(runs[0]) / f"checkpoint_{k}.pt" for k in (STEPS - 1, STEPS)]
    averaged = average_checkpoints(paths)
    assert "trained_model" not in averaged
    ckpts = [load_checkpoint(p) for p in paths]
    name = "embed.tokens.weight"
    expected = (ckpts[0]["model"][name].double() + ckpts[1]["model"][name].double()) / 2
    torch.testing.assert_close(averaged["model"][name], expected.float())


def test_the_script_averages_the_trained_weights_as_those_of_a_run_without_the_average(runs):
    """--trained gives what averaging the same run without trainer.ema_decay gives, bitwise, under a name
    of its own; a run without trained weights apart is refused in one line."""
    averaged, plain = runs
    done = subprocess.run(
        [sys.executable, AVERAGE, "--run-dir", averaged, "--last", "3", "--trained"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    written = load_checkpoint(checkpoint_dir(averaged) / "checkpoint_average_last3_trained.pt")
    expected = average_checkpoints(
        [checkpoint_dir(plain) / f"checkpoint_{k}.pt" for k in range(STEPS - 2, STEPS + 1)]
    )
    assert written["model"].keys() == expected["model"].keys() and "trained_model" not in written
    for name, tensor in expected["model"].items():
        assert torch.equal(written["model"][name], tensor), name
    refused = subprocess.run(
        [sys.executable, AVERAGE, "--run-dir", plain, "--last", "1", "--trained"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert f"checkpoint_{STEPS}.pt holds no trained weights apart from its model" in refused.stderr


def test_a_decay_of_one_is_refused(corpus, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError, match=r"trainer.ema_decay=1.0 must be in \[0, 1\) \(0 = off\)"):
        compose_config(overrides(corpus, tmp_path, "trainer.ema_decay=1.0"))
