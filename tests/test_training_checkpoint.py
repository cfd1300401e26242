"""Checkpoint files: atomic writes, rotation, fallback past a corrupt file, RNG state, averaging."""

import errno
import logging
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from transformer.checkpoint import (
    FORMAT,
    CheckpointError,
    average_checkpoints,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    model_from_checkpoint,
    save_numbered,
)
from transformer.config import ModelConfig, to_dict
from transformer.model import Transformer
from transformer.training.state import rng_state, set_rng_state

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=20, d_model=16, n_heads=2, d_ff=32, n_layers=1, dropout=0.0)


def make_checkpoint(step: int, seed: int, cfg: ModelConfig = CFG) -> dict:
    torch.manual_seed(seed)
    model = Transformer(cfg)
    optimizer = torch.optim.Adam(model.parameters())
    return {
        "format": FORMAT,
        "model": model.state_dict(),
        "model_config": to_dict(cfg),
        "spm_model": b"not a real tokenizer",
        "data_meta": {"vocab_size": cfg.vocab_size},
        "config": {},
        "step": step,
        "optimizer": optimizer.state_dict(),
        "scheduler": {"last_epoch": step},
        "data_state": {"epoch": 0, "position": step},
        "rng": [rng_state()],
    }


def test_save_rotates_keeps_a_last_copy_and_leaves_no_temp_files(tmp_path):
    for step in (10, 20, 30, 40):
        save_numbered(make_checkpoint(step, seed=step), tmp_path, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["checkpoint_30.pt", "checkpoint_40.pt"]
    directory = tmp_path / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == [
        "checkpoint_30.pt",
        "checkpoint_40.pt",
        "checkpoint_last.pt",
    ]
    assert (directory / "checkpoint_last.pt").samefile(
        directory / "checkpoint_40.pt"
    )  # a hard link: no 2nd copy
    assert load_checkpoint(directory / "checkpoint_last.pt")["step"] == 40


def test_without_hard_links_the_last_checkpoint_is_a_copy_and_a_failed_copy_leaves_no_older_one(
    tmp_path, monkeypatch
):
    save_numbered(make_checkpoint(1, seed=1), tmp_path, keep_last=5)

    def no_links(*_args):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    save_numbered(make_checkpoint(2, seed=2), tmp_path, keep_last=5)
    directory = tmp_path / "checkpoints"
    last = directory / "checkpoint_last.pt"
    assert not last.samefile(directory / "checkpoint_2.pt")
    assert last.read_bytes() == (directory / "checkpoint_2.pt").read_bytes()

    def full_disk(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfileobj", full_disk)
    with pytest.raises(
        CheckpointError, match=r"checkpoint_3\.pt was saved, but copying it to checkpoint_last\.pt failed"
    ):
        save_numbered(make_checkpoint(3, seed=3), tmp_path, keep_last=5)
    assert sorted(p.name for p in directory.iterdir()) == [
        "checkpoint_1.pt",
        "checkpoint_2.pt",
        "checkpoint_3.pt",
    ]


def test_a_save_that_cannot_fit_is_refused_before_writing_and_one_that_fills_the_disk_says_so(
    tmp_path, monkeypatch
):
    save_numbered(make_checkpoint(1, seed=1), tmp_path, keep_last=5)
    directory = tmp_path / "checkpoints"
    size = (directory / "checkpoint_1.pt").stat().st_size
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real_usage(path)._replace(free=size // 2))
    with pytest.raises(
        CheckpointError, match=rf"not enough disk space in {directory} for checkpoint_2\.pt: it needs about"
    ):
        save_numbered(make_checkpoint(2, seed=2), tmp_path, keep_last=5)
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint_1.pt", "checkpoint_last.pt"]

    monkeypatch.setattr(shutil, "disk_usage", real_usage)
    real_save = torch.save

    def disk_fills_while_writing(obj, file):
        real_save(obj, file)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", disk_fills_while_writing)
    with pytest.raises(CheckpointError, match=r"not enough disk space .* for checkpoint_2\.pt"):
        save_numbered(make_checkpoint(2, seed=2), tmp_path, keep_last=5)
    assert sorted(p.name for p in directory.iterdir()) == ["checkpoint_1.pt", "checkpoint_last.pt"]  # no temp
    assert (directory / "checkpoint_last.pt").samefile(directory / "checkpoint_1.pt")


def test_steps_sort_numerically_not_by_name(tmp_path):
    for step in (9, 10, 100):
        save_numbered(make_checkpoint(step, seed=0), tmp_path, keep_last=5)
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == "checkpoint_100.pt"


def test_corrupt_newest_is_reported_and_the_previous_one_used(tmp_path, caplog):
    for step in (1, 2, 3):
        save_numbered(make_checkpoint(step, seed=step), tmp_path, keep_last=5)
    newest = tmp_path / "checkpoints" / "checkpoint_3.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated, e.g. by a full disk
    with caplog.at_level(logging.WARNING):
        path, ckpt = latest_checkpoint(tmp_path)
    assert path.name == "checkpoint_2.pt" and ckpt["step"] == 2
    assert "checkpoint_3.pt" in caplog.text


def test_no_checkpoint_means_none(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def _damage_separately(path: Path) -> None:
    """Truncate this file alone (a new inode: checkpoint_last.pt may be a hard link to it)."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data[: len(data) // 3])


def test_the_last_checkpoint_resumes_where_every_numbered_one_is_unreadable(tmp_path, caplog):
    for step in (1, 2):
        save_numbered(make_checkpoint(step, seed=step), tmp_path, keep_last=5)
    for path in list_checkpoints(tmp_path):
        _damage_separately(path)
    with caplog.at_level(logging.WARNING):
        path, ckpt = latest_checkpoint(tmp_path)
    assert path.name == "checkpoint_last.pt" and ckpt["step"] == 2
    assert "checkpoint_2.pt is truncated" in caplog.text


def test_a_run_whose_checkpoints_are_all_unusable_is_not_restarted_from_scratch(tmp_path):
    for step in (1, 2):
        save_numbered(make_checkpoint(step, seed=step), tmp_path, keep_last=5)
    for path in [*list_checkpoints(tmp_path), tmp_path / "checkpoints" / "checkpoint_last.pt"]:
        _damage_separately(path)
    with pytest.raises(
        CheckpointError, match=r"none of the 3 checkpoints in .* can resume training \(newest: "
    ):
        latest_checkpoint(tmp_path)


def test_bytes_changed_after_writing_make_a_checkpoint_unreadable(tmp_path, caplog):
    """torch.load does not check the CRC-32s of its zip archive; load_checkpoint does."""
    for step in (1, 2):
        save_numbered(make_checkpoint(step, seed=step), tmp_path, keep_last=5)
    newest = tmp_path / "checkpoints" / "checkpoint_2.pt"
    data = bytearray(newest.read_bytes())
    middle = data.index(b"PK\x03\x04", len(data) // 2) - 64  # inside the bytes of an entry
    data[middle : middle + 4] = bytes(b ^ 0xFF for b in data[middle : middle + 4])
    newest.write_bytes(bytes(data))  # checkpoint_last.pt, the same file, changes with it
    torch.load(newest, weights_only=True)  # torch reads it without a word
    with pytest.raises(CheckpointError, match=r"checkpoint_2\.pt is corrupt: .* does not match the checksum"):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING):
        path, ckpt = latest_checkpoint(tmp_path)
    assert path.name == "checkpoint_1.pt" and ckpt["step"] == 1


def test_rng_state_round_trip():
    state = rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    set_rng_state(state)
    assert random.random() == expected[0]
    assert np.random.rand() == expected[1]
    assert torch.equal(torch.rand(3), expected[2])


def test_average_is_the_arithmetic_mean(tmp_path):
    ckpts = [make_checkpoint(step, seed=step) for step in (1, 2, 3)]
    paths = []
    for ckpt in ckpts:
        paths.append(tmp_path / f"checkpoint_{ckpt['step']}.pt")
        torch.save(ckpt, paths[-1])
    averaged = average_checkpoints(paths)
    for name, tensor in averaged["model"].items():
        expected = (ckpts[0]["model"][name] + ckpts[1]["model"][name] + ckpts[2]["model"][name]) / 3
        torch.testing.assert_close(tensor, expected)
    assert not {"optimizer", "scheduler", "data_state", "rng"} & averaged.keys()
    assert averaged["step"] == 3 and len(averaged["averaged_from"]) == 3
    model = model_from_checkpoint(averaged)  # loads like any other checkpoint
    assert sum(p.numel() for p in model.parameters()) > 0


def test_average_refuses_different_models(tmp_path):
    other = ModelConfig(vocab_size=20, d_model=16, n_heads=2, d_ff=64, n_layers=1)
    torch.save(make_checkpoint(1, seed=1), tmp_path / "a.pt")
    torch.save(make_checkpoint(2, seed=2, cfg=other), tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match="model configuration"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"])


def test_average_script(tmp_path):
    for step in (10, 20, 30):
        save_numbered(make_checkpoint(step, seed=step), tmp_path, keep_last=5)
    script = ROOT / "scripts" / "average_checkpoints.py"
    done = subprocess.run(
        [sys.executable, script, "--run-dir", tmp_path, "--last", "2"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    averaged = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_average_last2.pt")
    assert averaged["averaged_from"] == [str(p) for p in list_checkpoints(tmp_path)[-2:]]
    assert [p.name for p in list_checkpoints(tmp_path)][-1] == "checkpoint_30.pt"  # not taken for a resume
    too_many = subprocess.run(
        [sys.executable, script, "--run-dir", tmp_path, "--last", "7"], capture_output=True, text=True
    )
    assert too_many.returncode == 2 and too_many.stderr.startswith("error:") and "--last=7" in too_many.stderr
    for run_dir, message in [
        (tmp_path / "checkpoints", f"--run-dir takes the run directory ({tmp_path}), not its checkpoints/"),
        (tmp_path / "nope", f"--run-dir={tmp_path / 'nope'} is not a directory"),
    ]:
        wrong = subprocess.run([sys.executable, script, "--run-dir", run_dir], capture_output=True, text=True)
        assert wrong.returncode == 2 and wrong.stderr == f"error: {message}\n"


def test_a_checkpoint_without_resume_state_is_not_resumed_from(tmp_path, caplog):
    save_numbered(make_checkpoint(1, seed=1), tmp_path, keep_last=5)
    averaged = {k: v for k, v in make_checkpoint(2, seed=2).items() if k not in ("optimizer", "rng")}
    save_numbered(averaged, tmp_path, keep_last=5)
    with caplog.at_level(logging.WARNING):
        path, _ = latest_checkpoint(tmp_path)
    assert path.name == "checkpoint_1.pt"
    assert "checkpoint_2.pt" in caplog.text and "optimizer, rng" in caplog.text


def test_a_checkpoint_of_older_settings_loads_as_written_and_averages(tmp_path):
    """Checkpoints written while the model's settings held pad_id (always the tokenizer's 0) and before
    they named the initialisation (always "xavier") load with the same weights, and average with
    today's."""
    old = make_checkpoint(1, seed=1, cfg=ModelConfig(**{**to_dict(CFG), "init": "xavier"}))
    old["model_config"]["pad_id"] = 0
    del old["model_config"]["init"]
    old["config"] = {"model": {**old["model_config"]}}
    save_numbered(old, tmp_path, keep_last=5)
    save_numbered(
        make_checkpoint(2, seed=2, cfg=ModelConfig(**{**to_dict(CFG), "init": "xavier"})), tmp_path, 5
    )
    loaded = load_checkpoint(tmp_path / "checkpoints" / "checkpoint_1.pt")
    assert "pad_id" not in loaded["model_config"] and "pad_id" not in loaded["config"]["model"]
    assert loaded["model_config"]["init"] == loaded["config"]["model"]["init"] == "xavier"
    model = model_from_checkpoint(loaded)
    src, tgt = torch.tensor([[5, 6, 7, 3]]), torch.tensor([[2, 8, 9]])
    torch.manual_seed(1)
    written = Transformer(ModelConfig(**{**to_dict(CFG), "init": "xavier"})).eval()
    torch.testing.assert_close(model(src, tgt), written(src, tgt), rtol=0, atol=0)
    average_checkpoints(list_checkpoints(tmp_path))  # one model configuration


@pytest.mark.parametrize("given", ["run", "checkpoints"])
def test_a_directory_given_as_checkpoint_is_answered_with_the_file_inside(tmp_path, given):
    last = tmp_path / "run" / "checkpoints" / "checkpoint_last.pt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")
    directory = tmp_path / "run" if given == "run" else last.parent
    with pytest.raises(CheckpointError, match=f"is a directory; pass a checkpoint file .e.g. {last}.$"):
        load_checkpoint(directory)
