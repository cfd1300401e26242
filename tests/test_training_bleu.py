"""BLEU and chrF on the valid split while training, the best checkpoint and early stopping
(trainer.translate_every_steps, trainer.best_metric, trainer.patience), through the real train(cfg): a
toy model trained for 600 steps (tests/data/checkpoint_2b99159.pt) resumed for 20 more, whose BLEU is
not 0, and the tiny reversal corpus of test_training_run. BLEU equals scripts/evaluate.py's on the same
checkpoint, chrF sacreBLEU's on the hypotheses written, and neither changes a trained bit; the best
checkpoint resumes, a resumed run keeps its best-so-far, patience stops the run and the finish stage
runs."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from sacrebleu.metrics import CHRF
from test_old_checkpoints import _recorded_overrides
from test_training_run import ENV, ROOT, compose_config, corpus, overrides, tensorboard_scalars  # noqa: F401

from transformer.checkpoint import BEST, checkpoint_dir, load_checkpoint
from transformer.config import ConfigError, EvaluateConfig, TrainConfig, TrainerConfig, from_dict
from transformer.data.sources import read_split
from transformer.inference.evaluation import evaluate_checkpoint
from transformer.training import train
from transformer.training.finish import finish

pytestmark = pytest.mark.usefixtures("one_torch_thread")

OLD = ROOT / "tests" / "data" / "checkpoint_2b99159.pt"  # a toy model trained for 600 steps
BLEU = ["trainer.translate_every_steps=5", "trainer.best_metric=bleu", "trainer.save_every_steps=5"]


def toy(tmp: Path, run_dir: Path, *extra: str) -> TrainConfig:
    """The old checkpoint's run (tests/test_old_checkpoints.py), resumed from it in run_dir."""
    old = load_checkpoint(OLD)
    settings = [f"{key}={value}" for key, value in _recorded_overrides(old["config"]).items()]
    settings += [f"data.dir={tmp / 'data'}", f"trainer.run_dir={run_dir}", "trainer.eval_every_steps=0"]
    settings += ["trainer.progress=false", "finish.average_last=0", "finish.beam_size=2", *extra]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base=None):
        cfg = compose("train", overrides=["experiment=demo", *settings])
    return from_dict(TrainConfig, OmegaConf.to_container(cfg, resolve=True))


def weights(run_dir: Path, step: int) -> dict:
    return load_checkpoint(checkpoint_dir(run_dir) / f"checkpoint_{step}.pt")["model"]


@pytest.fixture(scope="module")
def with_bleu(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("toy")
    run_dir = tmp / "with_bleu"
    train(toy(tmp, run_dir, *BLEU, f"trainer.resume={OLD}", "trainer.max_steps=620"))
    return run_dir


def test_bleu_validation_changes_no_trained_bit(with_bleu, tmp_path):
    shutil.copytree(with_bleu.parent / "data", tmp_path / "data")
    train(
        toy(
            tmp_path,
            tmp_path / "run",
            "trainer.translate_every_steps=0",  # (the demo's own is on)
            "trainer.best_metric=loss",
            "trainer.save_every_steps=5",
            f"trainer.resume={OLD}",
            "trainer.max_steps=620",
        )
    )
    for name, tensor in weights(tmp_path / "run", 620).items():
        assert torch.equal(tensor, weights(with_bleu, 620)[name]), name
    assert not list(checkpoint_dir(tmp_path / "run").glob("valid_step*"))


def test_valid_bleu_is_the_evaluation_scripts_and_its_hypotheses_are_kept(with_bleu):
    logged = tensorboard_scalars(with_bleu, "valid/bleu")  # the paper's tokenized BLEU (toy: as WMT)
    sacrebleu = tensorboard_scalars(with_bleu, "valid/sacrebleu")
    assert len(logged) == len(sacrebleu) == 4 and max(logged) > 0 and min(sacrebleu) > 0  # steps 605 ... 620
    data = toy(with_bleu.parent, with_bleu).data
    for step, bleu, sacre in zip((605, 610, 615, 620), logged, sacrebleu):
        hypotheses = (checkpoint_dir(with_bleu) / f"valid_step{step}.hyp.de").read_text().splitlines()
        assert len(hypotheses) == 50  # the valid split's
        checkpoint = checkpoint_dir(with_bleu) / f"checkpoint_{step}.pt"
        evaluation = EvaluateConfig(
            checkpoint=str(checkpoint), data=data, split="valid", beam_size=2, device="cpu"
        )
        result = evaluate_checkpoint(evaluation)
        assert result["scores"]["tokenized"]["score"] == pytest.approx(bleu, abs=1e-6)
        assert result["scores"]["sacrebleu"]["score"] == pytest.approx(sacre, abs=1e-6)
        assert Path(result["hypotheses"]).read_text().splitlines() == hypotheses


def test_valid_chrf_is_sacrebleus_on_the_hypotheses_training_wrote(with_bleu):
    """chrF and chrF++ of each validation: sacreBLEU's on its valid_step<N>.hyp.de and the references."""
    references = read_split(toy(with_bleu.parent, with_bleu).data, "valid").tgt
    chrf, chrf_plus = (tensorboard_scalars(with_bleu, f"valid/{name}") for name in ("chrf", "chrf++"))
    assert len(chrf) == len(chrf_plus) == 4 and min(chrf) > 0
    for step, ours, ours_plus in zip((605, 610, 615, 620), chrf, chrf_plus):
        hypotheses = (checkpoint_dir(with_bleu) / f"valid_step{step}.hyp.de").read_text().splitlines()
        assert len(hypotheses) == len(references) == 50
        expected = CHRF().corpus_score(hypotheses, [references]).score
        expected_plus = CHRF(word_order=2).corpus_score(hypotheses, [references]).score
        assert ours == pytest.approx(expected, rel=1e-6)
        assert ours_plus == pytest.approx(expected_plus, rel=1e-6)
        assert expected != expected_plus


def test_the_best_checkpoint_is_the_best_validations_and_resumes(with_bleu, tmp_path):
    logged = tensorboard_scalars(with_bleu, "valid/bleu")
    best = load_checkpoint(checkpoint_dir(with_bleu) / BEST)
    step = (605, 610, 615, 620)[logged.index(max(logged))]
    assert best["step"] == step and best["best"] == {
        "metric": "bleu",
        "value": pytest.approx(max(logged)),
        "step": step,
        "since": 0,
    }
    shutil.copytree(with_bleu.parent / "data", tmp_path / "data")
    end = 620 if step < 620 else 625  # resumed from the best: the same run on, where there is one to compare
    resumed = toy(
        tmp_path,
        tmp_path / "run",
        *BLEU,
        f"trainer.resume={checkpoint_dir(with_bleu) / BEST}",
        f"trainer.max_steps={end}",
    )
    train(resumed)
    assert load_checkpoint(checkpoint_dir(tmp_path / "run") / f"checkpoint_{end}.pt")["step"] == end
    if end == 620:
        for name, tensor in weights(tmp_path / "run", 620).items():
            assert torch.equal(tensor, weights(with_bleu, 620)[name]), name


def test_best_metric_chrf_keeps_the_highest_chrf_and_patience_stops_on_it(with_bleu, tmp_path):
    """Resumed from the BLEU run's step 610 (its BLEU record, of another metric, starts anew) with chrF
    every 2 steps and a patience of 3: the best checkpoint is that of the highest chrF, and three
    validations in a row below it stop the run. Resumed from that best by BLEU, the chrF record starts
    anew in turn: a BLEU far below it is the new run's first best."""
    shutil.copytree(with_bleu.parent / "data", tmp_path / "data")
    every = ["trainer.translate_every_steps=2", "trainer.save_every_steps=2"]
    run, start = tmp_path / "chrf", checkpoint_dir(with_bleu) / "checkpoint_610.pt"
    chrf = [*every, "trainer.best_metric=chrf", "trainer.patience=3", "trainer.max_steps=640"]
    train(toy(tmp_path, run, *chrf, f"trainer.resume={start}"))
    logged = tensorboard_scalars(run, "valid/chrf")
    last = load_checkpoint(checkpoint_dir(run) / "checkpoint_last.pt")
    steps = list(range(612, last["step"] + 1, 2))
    best = steps[logged.index(max(logged))]
    assert last["early_stopped"] and last["step"] < 640 and len(logged) == len(steps)
    assert last["best"] == {"metric": "chrf", "value": pytest.approx(max(logged)), "step": best, "since": 3}
    assert last["step"] == best + 3 * 2 and load_checkpoint(checkpoint_dir(run) / BEST)["step"] == best
    again = tmp_path / "bleu"
    by_bleu = [*every, "trainer.best_metric=bleu", f"trainer.max_steps={best + 2}"]
    train(toy(tmp_path, again, *by_bleu, f"trainer.resume={checkpoint_dir(run) / BEST}"))
    record = load_checkpoint(checkpoint_dir(again) / "checkpoint_last.pt")["best"]
    assert record["value"] < max(logged) and record == {
        "metric": "bleu",
        "value": pytest.approx(tensorboard_scalars(again, "valid/bleu")[0]),
        "step": best + 2,
        "since": 0,
    }


def test_a_resumed_run_keeps_its_best_so_far(with_bleu, tmp_path):
    shutil.copytree(with_bleu.parent / "data", tmp_path / "data")
    train(toy(tmp_path, tmp_path / "run", *BLEU, f"trainer.resume={OLD}", "trainer.max_steps=610"))
    train(toy(tmp_path, tmp_path / "run", *BLEU, "trainer.max_steps=620"))  # trainer.resume=auto
    ours = load_checkpoint(checkpoint_dir(tmp_path / "run") / "checkpoint_620.pt")
    assert ours["best"] == load_checkpoint(checkpoint_dir(with_bleu) / "checkpoint_620.pt")["best"]
    assert load_checkpoint(checkpoint_dir(tmp_path / "run") / BEST)["step"] == ours["best"]["step"]


def test_patience_stops_early_and_the_finish_stage_runs(corpus, tmp_path, capsys):  # noqa: F811
    """A learning rate so large that the valid loss soon stops falling, and a patience of 1: the
    first validation that is no better stops the run, with a checkpoint; the finish stage averages and
    names the best checkpoint; the same command again trains no further."""
    settings = [
        "trainer.eval_every_steps=2",
        "trainer.patience=1",
        "trainer.max_steps=40",
        "optim.lr_scale=30",
    ]
    settings += ["trainer.save_every_steps=2", "finish.average_last=2", "finish.evaluate_split=null"]
    cfg = compose_config(overrides(corpus, tmp_path, *settings))
    train(cfg)
    last = load_checkpoint(checkpoint_dir(tmp_path) / "checkpoint_last.pt")
    assert last["early_stopped"] and last["step"] < 40 and last["best"]["since"] == 1
    assert last["step"] == last["best"]["step"] + 2  # the first validation no better than the best
    assert load_checkpoint(checkpoint_dir(tmp_path) / BEST)["step"] == last["best"]["step"]
    assert finish(cfg, tmp_path) is not None
    out = capsys.readouterr().out
    assert "best checkpoint:" in out and "averaged the last 2 checkpoints" in out
    train(cfg)  # nothing more to train
    assert load_checkpoint(checkpoint_dir(tmp_path) / "checkpoint_last.pt")["step"] == last["step"]


def test_best_metric_by_translation_without_its_validations_is_refused():
    for metric in ("bleu", "chrf", "chrf++"):
        with pytest.raises(
            ConfigError,
            match=rf"^trainer.best_metric='{re.escape(metric)}' needs its validations: "
            "trainer.translate_every_steps is 0$",
        ):
            TrainerConfig(best_metric=metric)
    with pytest.raises(ConfigError, match="needs its validations: trainer.eval_every_steps is 0"):
        TrainerConfig(eval_every_steps=0, patience=3)


def test_under_ddp_every_rank_stops_together(corpus, tmp_path):  # noqa: F811
    """Two processes: rank 0 computes BLEU, both ranks learn it and stop at the same validation (the
    tiny corpus' 4-gram BLEU stays 0: the second validation is no better than the first)."""
    settings = ["trainer.translate_every_steps=2", "trainer.best_metric=bleu", "trainer.patience=1"]
    settings += ["trainer.max_steps=20", "trainer.eval_every_steps=0", "finish.beam_size=1"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    args = overrides(corpus, tmp_path / "ddp", *settings)
    done = subprocess.run(
        [*launcher, ROOT / "train.py", *args], env=ENV, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    last = load_checkpoint(checkpoint_dir(tmp_path / "ddp") / "checkpoint_last.pt")
    assert (
        last["early_stopped"]
        and last["step"] == 4
        and last["best"] == {"metric": "bleu", "value": 0.0, "step": 2, "since": 1}
    )
    assert len(last["rng"]) == 2 and tensorboard_scalars(tmp_path / "ddp", "valid/bleu") == [0.0, 0.0]
