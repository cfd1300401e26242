"""`python train.py experiment=demo`, shortened, end to end through the real command line."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import sacrebleu
import torch

from transformer.checkpoint import load_checkpoint
from transformer.config import ToyConfig
from transformer.data import toy

ROOT = Path(__file__).resolve().parents[1]


def test_short_demo_prepares_trains_averages_evaluates_translates_and_draws(tmp_path):
    run_dir, data_dir = tmp_path / "run", tmp_path / "toy"
    command = [
        sys.executable,
        "train.py",
        "experiment=demo",
        f"trainer.run_dir={run_dir}",
        f"data.dir={data_dir}",
        "data.toy.n_train=600",
        "data.toy.n_valid=20",
        "data.toy.n_test=12",
        "data.vocab_size=400",
        "trainer.max_steps=6",
        "trainer.save_every_steps=2",
        "trainer.eval_every_steps=3",
        "trainer.max_tokens=512",
        "trainer.tokens_per_step=1024",
        "trainer.progress=false",
        "finish.beam_size=2",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout

    # data: the synthetic corpus went through the real pipeline
    meta = json.loads((data_dir / "meta.json").read_text())
    assert meta["splits"]["train"]["pairs"] == 600 and meta["splits"]["test"]["pairs"] == 12

    # training wrote numbered checkpoints; the last 3 were averaged (fewer exist than finish.average_last)
    averaged = run_dir / "checkpoints" / "checkpoint_average_last3.pt"
    steps = [load_checkpoint(run_dir / "checkpoints" / f"checkpoint_{s}.pt") for s in (2, 4, 6)]
    mean = torch.stack([c["model"]["embed.tokens.weight"] for c in steps]).mean(0)
    torch.testing.assert_close(load_checkpoint(averaged)["model"]["embed.tokens.weight"], mean)

    # BLEU on the toy test set beside the paper's WMT figures (for context), written as JSON too
    assert "this checkpoint: sacrebleu" in out and "another corpus: for context only" in out
    report = json.loads(Path(f"{averaged}.toy.test.beam2.alpha0.6.bleu.json").read_text())
    hypotheses = Path(report["hypotheses"]).read_text(encoding="utf-8").splitlines()
    references = [de for _, de in toy.generate_splits(600, 20, 12, ToyConfig().seed)["test"]]
    assert len(hypotheses) == report["sentences"] == 12
    expected = sacrebleu.corpus_bleu(hypotheses, [references]).score  # sacreBLEU's own defaults: 13a, cased
    assert report["scores"]["sacrebleu"]["score"] == pytest.approx(expected)

    # example translations, the attention heatmaps and the next commands
    assert "Today the dog sees the cat.\n    -> " in out
    for kind in ("encoder_self", "decoder_self", "cross"):
        assert (run_dir / "attention" / f"{kind}.png").stat().st_size > 0
    assert "python translate.py checkpoint=" in out and "tensorboard --logdir" in out
