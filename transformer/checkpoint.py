"""Self-describing checkpoints: everything needed to rebuild the model and its tokenizer, written
atomically so that a crash or kill never leaves a half-written file under a final name.

A checkpoint is a dict saved with `torch.save` and loaded with `weights_only=True`:
    format        "transformer-checkpoint"
    model         state_dict of the unwrapped model (no DDP `module.`, no compile `_orig_mod.`)
    model_config  ModelConfig as a dict
    spm_model     the SentencePiece model's bytes (the tokenizer travels with the weights)
    data_meta     the prepared corpus' meta.json (languages, special ids, ...)
    config        the resolved run configuration (dict)
    step          optimizer steps taken
and, for resuming training:
    optimizer     Adam's state_dict (moments, step counts)
    scheduler     the LambdaLR's state_dict (updates taken)
    data_state    the batch sampler's {"epoch", "position"}
    rng           one entry per rank: {"python", "numpy", "torch", "cuda"} generator states
    interim       True for a checkpoint written only because a signal stopped the run
    best          the best validation so far: {"metric", "value", "step", "since"}
    early_stopped True once `trainer.patience` validations in a row did not improve
    kernels       the CPU kernels it trained with ({"onednn", "noise_dropout", "short_attention"})
    batching      {"buckets": the length buckets of its batches, or None}
An average of checkpoints (§6.1) has no resume state and lists its inputs under "averaged_from".
`load_checkpoint` reads older checkpoints in today's terms (parameters renamed since, under their new
names), so they translate, resume, average and export as they did.

A run keeps `<run_dir>/checkpoints/checkpoint_<step>.pt` (the newest `keep_last` of them), the
checkpoint of its best validation as `checkpoint_best.pt` (never rotated away; it resumes too), and
the newest also as `checkpoint_last.pt`: a hard link (a copy where the filesystem has none), never a
symlink, so it survives copying. The resumed run's next checkpoint replaces an interim one, so that a
stopped and resumed run keeps, rotates and averages the same checkpoints as an uninterrupted one.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import zipfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from transformer.config import ConfigError, ModelConfig, from_dict, to_dict
from transformer.model import Transformer
from transformer.utils import atomic
from transformer.vocab import PAD_ID

FORMAT = "transformer-checkpoint"
RESUME_KEYS = ("optimizer", "scheduler", "data_state", "rng")
TRAINED = "trained_model"  # the trained weights, where `model` holds their average (training/ema.py)
_NUMBERED = re.compile(r"checkpoint_(\d+)\.pt")
LAST = "checkpoint_last.pt"  # a copy of the newest numbered checkpoint
BEST = "checkpoint_best.pt"  # the checkpoint of the best validation (trainer.best_metric); never rotated

log = logging.getLogger(__name__)


class CheckpointError(Exception):
    """A path that is missing, unreadable, or not one of our checkpoints."""


def write_checkpoint(obj: Any, path: str | Path) -> None:
    """torch.save, atomically (see `transformer.utils.atomic`), creating the directory if needed; a disk too
    full for it is a CheckpointError, before writing where the free space shows it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    needed = _stored_bytes(obj)
    free = shutil.disk_usage(path.parent).free
    if free < needed:
        raise CheckpointError(_no_space(path, needed, free))
    try:
        with atomic.writing(path) as f:
            torch.save(obj, f)
    except OSError as error:
        if error.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CheckpointError(_no_space(path, needed, shutil.disk_usage(path.parent).free)) from None
        raise
    except RuntimeError as error:  # torch's zip writer reports a failed write (a full disk) this way
        free = shutil.disk_usage(path.parent).free / 2**20
        first = str(error).strip().splitlines()[0] if str(error).strip() else "RuntimeError"
        raise CheckpointError(f"writing {path} failed ({first}); {free:,.0f} MiB free there") from None


def _stored_bytes(obj: Any) -> int:
    """About the bytes torch.save writes for obj: its tensors' storages, its byte strings, 1 MiB more."""
    seen, total, todo = set(), 1 << 20, [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif isinstance(item, bytes):
            total += len(item)
    return total


def _no_space(path: Path, needed: int, free: int) -> str:
    return (
        f"not enough disk space in {path.parent} for {path.name}: it needs about {needed / 2**20:,.0f} MiB "
        f"and {free / 2**20:,.0f} MiB are free; free some space (or lower trainer.keep_last) and resume"
    )


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and check a checkpoint on the CPU; any problem becomes one CheckpointError line. A file
    whose bytes do not match the CRC-32s written with them (torch does not check) is refused."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():  # a run directory, or its checkpoints/
        inside = [p for p in (checkpoint_dir(path) / LAST, path / LAST) if p.is_file()]
        example = inside[0] if inside else checkpoint_dir(path) / LAST
        raise CheckpointError(f"{path} is a directory; pass a checkpoint file (e.g. {example})")
    _check_archive(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # what torch cannot read, or what weights_only refuses (it could run code)
        refused = re.search(r"GLOBAL ([\w.]+)", str(e))
        if refused:
            raise CheckpointError(
                f"{path} refers to {refused.group(1)}, which no checkpoint holds; refused (loading it could "
                "run code)"
            ) from None
        first = str(e).strip().split(". ")[0].splitlines()[0] if str(e).strip() else ""
        reason = f"{type(e).__name__}: {first[:120]}"
        raise CheckpointError(f"{path} is not a readable checkpoint ({reason})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint written by this project")
    return _upgraded(ckpt)


# Parameter names changed since older checkpoints were written: (pattern, replacement) on their keys.
RENAMED = [(re.compile(r"^(encoder\.\d+\.)res_attn\."), r"\1res_self.")]  # as the decoder's layers name it


def _upgraded(ckpt: dict[str, Any]) -> dict[str, Any]:
    """An older checkpoint in today's terms: its parameters under today's names (`RENAMED`); and its
    model settings without the padding id (it was always the tokenizer's 0) and with the initialisation
    (it was always "xavier") where it names neither."""
    for key in ("model", TRAINED):
        if isinstance(ckpt.get(key), dict):
            ckpt[key] = current_names(ckpt[key])
    for model_config in (ckpt.get("model_config"), ckpt.get("config", {}).get("model")):
        if isinstance(model_config, dict):
            if model_config.get("pad_id") == PAD_ID:
                del model_config["pad_id"]
            model_config.setdefault("init", "xavier")
    return ckpt


def current_names(state_dict: dict[str, Any]) -> dict[str, Any]:
    """A model's state_dict written before a parameter was renamed, under today's names."""
    renamed = {}
    for key, value in state_dict.items():
        for pattern, replacement in RENAMED:
            key = pattern.sub(replacement, key)
        renamed[key] = value
    return renamed


def _check_archive(path: Path) -> None:
    """torch.save writes a zip archive with a CRC-32 per entry: anything else, a file cut short, or
    bytes changed since they were written raise CheckpointError."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as file:
            magic = file.read(4)
        if size == 0:
            raise CheckpointError(f"{path} is empty (0 bytes): not a checkpoint")
        if magic != b"PK\x03\x04":
            raise CheckpointError(f"{path} is not a checkpoint (not a file written by torch.save)")
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # reads every entry and compares its CRC-32
    except (zipfile.BadZipFile, EOFError):
        raise CheckpointError(f"{path} is truncated ({size:,} bytes; its end is missing)") from None
    except OSError as error:
        raise CheckpointError(f"{path} cannot be read: {error.strerror or error}") from None
    if damaged is not None:
        raise CheckpointError(f"{path} is corrupt: {damaged} does not match the checksum written with it")


def model_from_checkpoint(ckpt: dict[str, Any], device: str | torch.device = "cpu") -> Transformer:
    """Rebuild the model from the checkpoint alone, in eval mode."""
    model = Transformer(from_dict(ModelConfig, ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()


# ------------------------------------------------------------------------------------- run directory


def checkpoint_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def averaged_path(run_dir: str | Path, last: int) -> Path:
    """Where the average of a run's last `last` checkpoints goes (a name resume=auto never picks)."""
    return checkpoint_dir(run_dir) / f"checkpoint_average_last{last}.pt"


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """The run's numbered checkpoints, oldest first (by step, not by file time)."""
    found = []
    for path in checkpoint_dir(run_dir).glob("checkpoint_*.pt"):
        match = _NUMBERED.fullmatch(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def save_numbered(
    ckpt: dict[str, Any], run_dir: str | Path, keep_last: int, replaces: Path | None = None
) -> Path:
    """Write checkpoint_<step>.pt atomically, make checkpoint_last.pt the same file, delete `replaces`
    (the interim checkpoint the run resumed from), then keep only the newest `keep_last` numbered ones."""
    directory = checkpoint_dir(run_dir)
    path = directory / f"checkpoint_{ckpt['step']}.pt"
    write_checkpoint(ckpt, path)
    _link_last(path, directory / LAST)
    if replaces is not None and replaces != path:
        replaces.unlink(missing_ok=True)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    return path


def save_best(ckpt: dict[str, Any], run_dir: str | Path, numbered: Path | None) -> Path:
    """checkpoint_best.pt: the same file as `numbered` where this step was saved (a hard link), else
    `ckpt` written atomically."""
    best = checkpoint_dir(run_dir) / BEST
    if numbered is not None:
        _link_last(numbered, best)
    else:
        write_checkpoint(ckpt, best)
    return best


def _link_last(newest: Path, last: Path) -> None:
    """`last` (checkpoint_last.pt, checkpoint_best.pt) as a hard link to the newest numbered file (no
    second copy on disk), replaced atomically; a copy where the filesystem has no hard links. A copy
    that fails leaves no older file under the name."""
    temp = atomic.temp_name(last)
    try:
        os.link(newest, temp)
    except OSError:
        try:
            with atomic.writing(last) as f, open(newest, "rb") as source:
                shutil.copyfileobj(source, f, length=1 << 24)
        except OSError as error:
            last.unlink(missing_ok=True)
            raise CheckpointError(
                f"{newest} was saved, but copying it to {last.name} failed: {error}"
            ) from None
        return
    atomic.rename(temp, last)


def latest_checkpoint(run_dir: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of the run that loads and can resume training: the newest numbered one, or
    checkpoint_last.pt where that one is unusable and it is newer; None if the run has none at all.

    Unusable files (truncated by a full disk, changed bytes) are reported by name and skipped; a run
    whose checkpoints are all unusable raises CheckpointError rather than train again from step 0 over
    them.
    """
    numbered = list_checkpoints(run_dir)
    last = checkpoint_dir(run_dir) / LAST
    found, problems = [], []
    for path in reversed(numbered):
        if (ckpt := _resumable(path, problems)) is not None:
            found.append((path, ckpt))
            break
    if last.is_file() and not (found and found[0][0] == numbered[-1]):
        if (ckpt := _resumable(last, problems)) is not None:
            found.append((last, ckpt))
    if found:
        return max(found, key=lambda pair: pair[1]["step"])
    if problems:
        raise CheckpointError(
            f"none of the {len(problems)} checkpoints in {checkpoint_dir(run_dir)} can resume training "
            f"(newest: {problems[0]}); move them away to train again from step 0, or choose another "
            "trainer.run_dir"
        )
    return None


def check_same_model(model: ModelConfig, path: Path, ckpt: dict[str, Any], but: tuple[str, ...] = ()) -> None:
    """Refuse to resume from `ckpt` (at path) a model of other settings than `model` (its initialisation
    and the keys `but` aside)."""
    mine = to_dict(replace(model, init=ckpt["model_config"]["init"]))
    changed = sorted(k for k in mine if k not in but and ckpt["model_config"].get(k) != mine[k])
    if changed:
        raise ConfigError(
            f"{path} holds a model with other settings ({', '.join(changed)}); "
            "set trainer.run_dir to a new directory, or trainer.resume=<checkpoint of this model>"
        )


def set_aside_newer(run_dir: str | Path, step: int) -> list[Path]:
    """Rename the checkpoints past `step` (unusable ones that resuming skipped, or later ones when
    trainer.resume named an earlier file; checkpoint_last.pt and checkpoint_best.pt of those steps too)
    to `<name>.not_resumed`, so that resuming, rotation, averaging and the finish stage never take them;
    returns their new paths."""
    numbered = [(p, int(_NUMBERED.fullmatch(p.name).group(1))) for p in list_checkpoints(run_dir)]
    named = [checkpoint_dir(run_dir) / name for name in (LAST, BEST)]
    moved = []
    for path, at in [*numbered, *((p, _step_of(p)) for p in named if p.is_file())]:
        if at is not None and at > step:
            moved.append(path.with_name(path.name + ".not_resumed"))
            atomic.rename(path, moved[-1])
            log.warning("moved %s aside to %s: this run continues from step %d", path, moved[-1].name, step)
    return moved


def _step_of(path: Path) -> int | None:
    """The step of the checkpoint at path, its tensors left on disk; None if it cannot be read."""
    try:
        return int(torch.load(path, map_location="cpu", mmap=True, weights_only=True)["step"])
    except Exception:  # unreadable: not a file this run would resume from
        return None


def _resumable(path: Path, problems: list[str]) -> dict[str, Any] | None:
    """The checkpoint at path if it loads and holds a resume state, else None with a warning."""
    try:
        ckpt = load_checkpoint(path)
    except CheckpointError as error:
        problems.append(str(error))
        log.warning("skipping an unusable checkpoint: %s", error)
        return None
    missing = [key for key in RESUME_KEYS if key not in ckpt]
    if missing:
        problems.append(f"{path} has no {', '.join(missing)}")
        log.warning("skipping %s: it has no %s to resume from", path, ", ".join(missing))
        return None
    return ckpt


# ----------------------------------------------------------------------------------------- averaging


def average_checkpoints(paths: Sequence[str | Path], trained: bool = False) -> dict[str, Any]:
    """The element-wise arithmetic mean of the models' parameters (§6.1), as a standalone checkpoint;
    with `trained`, of the trained weights of checkpoints whose model is their average
    (`trainer.ema_decay`): the weights of the same run without it.

    Everything else (config, tokenizer, step) comes from the last path; the resume state is dropped.
    Floating-point tensors are summed in float64 and cast back to their own dtype.
    """
    if not paths:
        raise CheckpointError("no checkpoints to average")
    weights = TRAINED if trained else "model"
    sums: dict[str, torch.Tensor] = {}
    last: dict[str, Any] = {}
    for path in paths:
        ckpt = load_checkpoint(path)
        if weights not in ckpt:
            raise CheckpointError(
                f"{path} holds no trained weights apart from its model (trained without trainer.ema_decay, "
                "or an average already): drop --trained"
            )
        if last and ckpt["model_config"] != last["model_config"]:
            raise CheckpointError(f"{path} has another model configuration than {paths[0]}; cannot average")
        if last and ckpt[weights].keys() != last[weights].keys():
            raise CheckpointError(f"{path} has different parameter names from {paths[0]}; cannot average")
        for name, tensor in ckpt[weights].items():
            if tensor.is_floating_point():
                sums[name] = sums.get(name, 0) + tensor.double()
        last = ckpt
    model = {
        name: (sums[name] / len(paths)).to(tensor.dtype) if name in sums else tensor
        for name, tensor in last[weights].items()
    }
    averaged = {key: value for key, value in last.items() if key not in (*RESUME_KEYS, TRAINED, "interim")}
    averaged["model"] = model
    averaged["averaged_from"] = [str(path) for path in paths]
    return averaged
