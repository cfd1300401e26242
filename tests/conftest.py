"""Shared test fixtures."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from hydra.core.config_store import ConfigStore

from transformer.checkpoint import FORMAT, write_checkpoint
from transformer.config import ModelConfig, app_defaults, to_dict
from transformer.data.tokenizer import learn_bpe
from transformer.model import Transformer
from transformer.vocab import EOS_ID, PAD_ID

# The CPU kernels decoding timed are kept in a file of this session's (transformer/kernels/timing.py), not
# the user's cache; the apps the tests start inherit it.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="transformer-tests-")

# The suite runs in one worker per core (pytest-xdist, `-n auto`): each worker, and every app it starts,
# takes one thread, so that workers never wait on each other's spinning threads.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The apps' defaults, as each app registers them, for the tests that compose configs/ with Hydra.
for app in ("train", "translate", "evaluate", "visualize", "export", "prepare_data"):
    ConfigStore.instance().store(name=f"{app}_defaults", node=app_defaults(app))

# ------------------------------------------------------------------------------ a tiny checkpoint

TINY_SENTENCES = [
    f"{subject} {verb} {obj}."
    for subject in ("The cat", "A dog", "My friend", "Die Katze", "Ein Hund", "Mein Freund")
    for verb in ("sees", "likes", "sieht", "mag", "finds")
    for obj in ("the house", "a red ball", "das Haus", "einen roten Ball", "the old tree")
]


def tiny_config(vocab: int, max_positions: int) -> ModelConfig:
    """2+2 layers, d_model 32, no dropout, in the Xavier scale the tests that scale its weights were
    written for."""
    return ModelConfig(
        vocab_size=vocab,
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_layers=2,
        dropout=0.0,
        max_positions=max_positions,
        init="xavier",
    )


def make_tiny_checkpoint(path: Path, max_positions: int = 128, seed: int = 0) -> Path:
    """An untrained tiny Transformer with a real SentencePiece tokenizer, in the checkpoint format."""
    spm_model = learn_bpe(TINY_SENTENCES, vocab_size=80)
    torch.manual_seed(seed)
    cfg = tiny_config(80, max_positions)
    ckpt = {
        "format": FORMAT,
        "model": Transformer(cfg).state_dict(),
        "model_config": to_dict(cfg),
        "spm_model": spm_model,
        "data_meta": {"src_lang": "en", "tgt_lang": "de", "vocab_size": 80},
        "config": {},
        "step": 0,
    }
    write_checkpoint(ckpt, path)
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models run fastest on one thread; several threads on a busy machine spin and wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of a tiny untrained checkpoint (decoding, translate.py, evaluation and attention tests)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_checkpoint") / "checkpoint_last.pt")


# ------------------------------------------------------------------------------ decoding tests


def tiny_model(
    vocab: int = 24, seed: int = 0, dtype: torch.dtype = torch.float64, max_positions: int = 1024
) -> Transformer:
    """Random weights, scaled up so that next-token distributions depend on the context (at the init's
    scale a random decoder mostly repeats one token, and every search finds the same output)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(vocab, max_positions)).eval()
    with torch.no_grad():
        model.embed.tokens.weight.mul_(2.0)
        for layer in model.decoder:
            for w in (layer.ffn.w_1, layer.ffn.w_2, layer.self_attn.w_qkv, layer.cross_attn.w_q):
                w.weight.mul_(3.0)
    return model.to(dtype)


def sources(lengths: list[int], vocab: int, seed: int = 1) -> torch.Tensor:
    """(B, S) rows of random pieces + [EOS], padded."""
    g = torch.Generator().manual_seed(seed)
    src = torch.full((len(lengths), max(lengths) + 1), PAD_ID)
    for row, n in enumerate(lengths):
        src[row, :n] = torch.randint(4, vocab, (n,), generator=g)
        src[row, n] = EOS_ID
    return src


@contextmanager
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The calls of the fused attention kernel within the block."""
    calls, fused = [], F.scaled_dot_product_attention
    with monkeypatch.context() as patch:
        patch.setattr(F, "scaled_dot_product_attention", lambda *a, **k: calls.append(1) or fused(*a, **k))
        yield calls
