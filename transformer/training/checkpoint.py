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
    and, for resuming training: optimizer, scheduler, data_state, rng.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from transformer.config import ModelConfig, from_dict
from transformer.model import Transformer

FORMAT = "transformer-checkpoint"


class CheckpointError(Exception):
    """A path that is missing, unreadable, or not one of our checkpoints."""


def atomic_save(obj: Any, path: str | Path) -> None:
    """torch.save to a temp file in the same directory, fsync, then rename over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and check a checkpoint on the CPU; any problem becomes one CheckpointError line."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint not found: {path}")
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a directory; pass a checkpoint file (e.g. {path}/checkpoint_last.pt)"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt or not a torch file at all
        raise CheckpointError(f"{path} is not a readable checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a checkpoint written by this project")
    return ckpt


def model_from_checkpoint(ckpt: dict[str, Any], device: str | torch.device = "cpu") -> Transformer:
    """Rebuild the model from the checkpoint alone, in eval mode."""
    model = Transformer(from_dict(ModelConfig, ckpt["model_config"]))
    model.load_state_dict(ckpt["model"])
    return model.to(device).eval()
