"""Durable writes: every finished file is synced, renamed into place, then its directory synced, and
every rename in the code goes through that one home (transformer/utils/atomic.py)."""

import ast
import os
import sys
from pathlib import Path

import pytest
import torch

from transformer.checkpoint import save_numbered, set_aside_newer
from transformer.utils import atomic

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


@pytest.fixture
def calls(monkeypatch):
    """The fsync and rename calls made, in order: ("fsync", path synced) and ("replace", source, target)."""
    seen = []
    fsync, replace = os.fsync, os.replace

    def recorded_fsync(fd):
        seen.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        fsync(fd)

    def recorded_replace(source, target):
        seen.append(("replace", Path(source), Path(target)))
        replace(source, target)

    monkeypatch.setattr(os, "fsync", recorded_fsync)
    monkeypatch.setattr(os, "replace", recorded_replace)
    return seen


def durable(calls, target: Path) -> bool:
    """Whether `target` was renamed into place from a file synced before, its directory synced after."""
    for i, call in enumerate(calls):
        if call[0] == "replace" and call[2] == target:
            source = call[1]
            return ("fsync", source.resolve()) in calls[:i] and ("fsync", target.parent.resolve()) in calls[
                i:
            ]
    return False


def test_a_written_file_is_synced_renamed_and_its_directory_synced(tmp_path, calls):
    atomic.write_bytes(tmp_path / "out.txt", b"done\n")
    assert (tmp_path / "out.txt").read_bytes() == b"done\n"
    assert [c[0] for c in calls] == ["fsync", "replace", "fsync"]
    assert durable(calls, tmp_path / "out.txt")


def test_a_saved_checkpoint_and_its_last_link_are_durable(tmp_path, calls):
    ckpt = {"step": 7, "model": {"w": torch.ones(3)}}
    path = save_numbered(ckpt, tmp_path, keep_last=2)
    assert durable(calls, path)
    assert durable(calls, path.with_name("checkpoint_last.pt"))
    assert os.path.samefile(path, path.with_name("checkpoint_last.pt"))


def test_checkpoints_set_aside_are_renamed_durably(tmp_path, calls):
    for step in (1, 2):
        save_numbered({"step": step, "model": {}}, tmp_path, keep_last=5)
    calls.clear()
    moved = set_aside_newer(tmp_path, 1)
    assert sorted(p.name for p in moved) == ["checkpoint_2.pt.not_resumed", "checkpoint_last.pt.not_resumed"]
    assert all(durable(calls, p) for p in moved)


def test_a_finished_directory_is_renamed_with_every_file_in_it_synced(tmp_path, calls):
    made = tmp_path / ".export.tmp"
    (made / "sub").mkdir(parents=True)
    for name in ("model.bin", "sub/vocab.json"):
        (made / name).write_text(name)
    atomic.rename(made, tmp_path / "export")
    synced = {c[1] for c in calls if c[0] == "fsync"}
    assert {made / "model.bin", made / "sub" / "vocab.json", made / "sub", made, tmp_path} <= synced
    assert (tmp_path / "export" / "sub" / "vocab.json").read_text() == "sub/vocab.json"


def test_a_filesystem_that_syncs_no_directory_still_renames(tmp_path, monkeypatch):
    fsync = os.fsync

    def no_directory_sync(fd):
        if Path(os.readlink(f"/proc/self/fd/{fd}")).is_dir():
            raise OSError(22, "Invalid argument")  # EINVAL, as some network filesystems answer
        fsync(fd)

    monkeypatch.setattr(os, "fsync", no_directory_sync)
    atomic.write_bytes(tmp_path / "a", b"1")  # its directory not synced: no error
    assert (tmp_path / "a").read_bytes() == b"1"


def test_a_file_that_cannot_be_synced_is_never_renamed_into_place(tmp_path, monkeypatch):
    def no_sync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", no_sync)
    with pytest.raises(OSError):
        atomic.write_bytes(tmp_path / "b", b"2")
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".*.tmp"))


def test_nothing_renames_a_file_outside_the_atomic_home():
    """os.replace, os.rename, shutil.move and Path.rename are called in transformer/utils/atomic.py only."""
    home = ROOT / "transformer" / "utils" / "atomic.py"
    sources = [
        *ROOT.glob("*.py"),
        *(p for d in ("transformer", "scripts", "benchmarks") for p in (ROOT / d).rglob("*.py")),
    ]
    found = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else None
                if (owner, node.func.attr) in {("os", "replace"), ("os", "rename"), ("shutil", "move")} or (
                    node.func.attr == "rename" and owner != "atomic"
                ):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert len(sources) > 50
    assert [f for f in found if not f.startswith(str(home.relative_to(ROOT)))] == []
    assert found, "the atomic home itself renames"
