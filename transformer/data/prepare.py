"""Prepare a corpus for training (§5.1): read -> clean -> shared SentencePiece BPE -> binary shards.

Everything for one corpus lands in `data.dir`:
  spm.model                      the shared source/target BPE model
  <role>.<lang>.bin / .idx       token shards per split (train, valid, test) and side (see binarize.py)
  meta.json                      what was built, from what, and how much was dropped and why
The run is resumable and idempotent: meta.json records each finished step with the checksum or size of
its outputs, so a re-run redoes only steps whose outputs are missing or changed (data.force=true redoes
all). A directory prepared from a different configuration is refused rather than silently overwritten.
Encoding runs in data.num_workers processes: like any multiprocessing code, a script that calls
prepare() belongs under `if __name__ == "__main__":` on platforms that spawn processes.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from transformer.config import ConfigError, DataConfig, to_dict
from transformer.data import tokenizer as spm_tokenizer
from transformer.data.binarize import (
    LengthFilter,
    SplitStats,
    encode_split,
    sha256_file,
    shard_dtype,
    shard_files,
)
from transformer.data.sources import DataError, Split, load_splits
from transformer.utils import atomic
from transformer.utils.atomic import remove_temp_files
from transformer.vocab import SPECIAL_IDS

log = logging.getLogger(__name__)

META_FORMAT = 1
SPM_FILE = "spm.model"
SPM_SAMPLE_SEED = 0  # the BPE sample is a fixed function of the corpus: re-runs learn the same vocabulary
_OPERATIONAL_KEYS = ("dir", "force", "num_workers")  # they change how data is built, never what
_DEFAULTS = to_dict(DataConfig())


def prepare(cfg: DataConfig, tokenizer: bytes | None = None) -> Path:
    """Build (or finish, or verify) the prepared corpus in `cfg.dir`; returns that directory. tokenizer: a
    SentencePiece model to encode with (a fine-tuned checkpoint's) instead of learning one."""
    out = Path(cfg.dir)
    if out.is_dir():
        remove_temp_files(out)
    meta = _resume_or_start(out, cfg)
    tokenizer_done = _tokenizer_done(out, meta)
    if tokenizer is not None and tokenizer_done and (out / SPM_FILE).read_bytes() != tokenizer:
        raise ConfigError(
            f"{out} holds data encoded with another tokenizer than trainer.finetune_from's; choose another "
            "data.dir, or data.force=true to encode it anew with the checkpoint's"
        )
    if not tokenizer_done:
        meta["splits"] = {}  # shards encoded with another tokenizer are stale
    pending = [role for role in meta["split_names"] if not _split_done(out, meta, role)]
    if tokenizer_done and not pending and meta["complete"]:
        log.info("%s is already prepared; nothing to do (data.force=true rebuilds it)", out)
        return out
    if not tokenizer_done or pending:
        splits = load_splits(cfg)  # every check of the input happens here, before anything is written
        splits["train"], n_empty = _drop_empty(splits["train"])
        out.mkdir(parents=True, exist_ok=True)
        meta["complete"] = False
        _write_meta(out, meta)  # readers must not trust shards while they are being replaced
        if not tokenizer_done and tokenizer is not None:
            _keep_tokenizer(out, meta, tokenizer, model_type="given")
        elif not tokenizer_done:
            _learn_tokenizer(out, cfg, meta, splits["train"])
        model_bytes = (out / SPM_FILE).read_bytes()
        for role in pending:
            _binarize(out, cfg, meta, splits[role], model_bytes, n_empty if role == "train" else 0)
    meta["complete"] = True
    _write_meta(out, meta)
    log.info("prepared %s: %s", out, _summary(meta))
    return out


def _resume_or_start(out: Path, cfg: DataConfig) -> dict[str, Any]:
    """The meta of an earlier run of the same configuration, or a fresh one."""
    config = {key: value for key, value in to_dict(cfg).items() if key not in _OPERATIONAL_KEYS}
    if cfg.source != "toy":
        config.pop("toy")  # the toy corpus sizes do not affect another source
    path = out / "meta.json"
    if cfg.force or not path.exists():
        return _fresh_meta(cfg, config)
    old = json.loads(path.read_text(encoding="utf-8"))
    if old.get("tokenizer") is None:  # no step finished: nothing to keep
        return _fresh_meta(cfg, config)
    # a key added to DataConfig after that run was built with the key's default
    before = {**{key: value for key, value in _DEFAULTS.items() if key in config}, **old.get("config", {})}
    if old.get("format") != META_FORMAT or before != config:
        changed = sorted(key for key in config.keys() | before.keys() if config.get(key) != before.get(key))
        raise ConfigError(
            f"{out} holds data prepared with a different configuration (changed: {', '.join(changed)}); "
            "pass data.force=true to rebuild it, or choose another data.dir"
        )
    return old


def _fresh_meta(cfg: DataConfig, config: dict[str, Any]) -> dict[str, Any]:
    """meta.json before any step: the steps fill in the tokenizer, vocab_size, dtype and splits."""
    return {
        "format": META_FORMAT,
        "name": cfg.name,
        "src_lang": cfg.src_lang,
        "tgt_lang": cfg.tgt_lang,
        "split_names": cfg.split_names,  # role -> the split's name in the source
        "vocab_size": None,
        "dtype": None,
        "special_ids": dict(SPECIAL_IDS),
        "tokenizer": None,
        "splits": {},
        "config": config,
        "complete": False,
    }


def _tokenizer_done(out: Path, meta: dict[str, Any]) -> bool:
    recorded = meta.get("tokenizer")
    path = out / SPM_FILE
    return recorded is not None and path.is_file() and sha256_file(path) == recorded["sha256"]


def _split_done(out: Path, meta: dict[str, Any], role: str) -> bool:
    entry = meta["splits"].get(role)
    return entry is not None and all(
        (out / name).is_file() and (out / name).stat().st_size == size
        for name, size in entry["files"].items()
    )


def _drop_empty(split: Split) -> tuple[Split, int]:
    """Training pairs with an empty side teach nothing; valid/test keep theirs (as empty sequences)."""
    keep = [i for i, (s, t) in enumerate(zip(split.src, split.tgt)) if s and t]
    if not keep:
        raise DataError(f"the training split ({split.origin}) has no pair with text on both sides")
    if len(keep) == len(split.src):
        return split, 0
    src, tgt = [split.src[i] for i in keep], [split.tgt[i] for i in keep]
    return Split(split.role, split.name, src, tgt, split.origin), len(split.src) - len(keep)


def _learn_tokenizer(out: Path, cfg: DataConfig, meta: dict[str, Any], train: Split) -> None:
    """One BPE model for both languages, learned on a seeded random sample of both sides (§5.1)."""
    sample = _bpe_sample(train, cfg.spm_sample_size)
    log.info("learning a shared BPE vocabulary of %d pieces from %d sentences", cfg.vocab_size, len(sample))
    start = time.perf_counter()
    try:
        model_bytes = spm_tokenizer.learn_bpe(
            sample, cfg.vocab_size, lowercase=cfg.lowercase, num_threads=cfg.num_workers
        )
    except ValueError as error:
        raise DataError(str(error)) from None
    log.info("learned the BPE model in %.1f s", time.perf_counter() - start)
    _keep_tokenizer(out, meta, model_bytes, model_type="bpe", sample_sentences=len(sample))


def _keep_tokenizer(out: Path, meta: dict[str, Any], model_bytes: bytes, **about: Any) -> None:
    """The SentencePiece model the shards are encoded with, in `out` and recorded in meta.json."""
    atomic.write_bytes(out / SPM_FILE, model_bytes)
    vocab_size = spm_tokenizer.Tokenizer.from_bytes(model_bytes).vocab_size
    meta["tokenizer"] = {"file": SPM_FILE, "sha256": sha256_file(out / SPM_FILE), **about}
    meta["vocab_size"] = vocab_size
    meta["dtype"] = shard_dtype(vocab_size).name
    _write_meta(out, meta)


def _bpe_sample(train: Split, size: int) -> list[str]:
    """`size` sentences drawn without replacement from both sides of the training split together."""
    n = len(train.src)
    rng = np.random.default_rng(SPM_SAMPLE_SEED)
    picks = np.arange(2 * n) if size >= 2 * n else np.sort(rng.choice(2 * n, size=size, replace=False))
    picked = tqdm(picks.tolist(), desc="sampling for BPE", unit=" sentences", unit_scale=True)
    return [train.src[i] if i < n else train.tgt[i - n] for i in picked]


def _binarize(
    out: Path, cfg: DataConfig, meta: dict[str, Any], split: Split, model_bytes: bytes, n_empty: int
) -> None:
    """Encode one split into shards; only the training split is filtered by length (§5.1 batches)."""
    role = split.role
    files = {}
    for side, lang in (("src", cfg.src_lang), ("tgt", cfg.tgt_lang)):
        files[f"{side}_bin"], files[f"{side}_idx"] = (out / name for name in shard_files(role, lang))
    length_filter = (
        LengthFilter(cfg.max_tokens_per_sentence, cfg.max_length_ratio) if role == "train" else None
    )
    stats = encode_split(
        split.src,
        split.tgt,
        files,
        model_bytes,
        length_filter=length_filter,
        num_workers=cfg.num_workers,
        desc=f"encoding {role}",
    )
    if role == "train":
        stats.dropped["empty"] += n_empty
        if stats.pairs == 0:
            raise DataError(f"every training pair was dropped by the length filters: {stats.dropped}")
    meta["splits"][role] = _split_entry(split, stats, files, n_read=len(split.src) + n_empty)
    _write_meta(out, meta)
    dropped = (
        ", ".join(f"{count} {reason}" for reason, count in stats.dropped.items()) or "none (not filtered)"
    )
    log.info("%s: %d of %d pairs kept; dropped: %s", role, stats.pairs, len(split.src) + n_empty, dropped)


def _split_entry(split: Split, stats: SplitStats, files: dict[str, Path], n_read: int) -> dict[str, Any]:
    return {
        "name": split.name,
        "pairs": stats.pairs,
        "read": n_read,
        "dropped": stats.dropped,
        "src_tokens": stats.src_tokens,
        "tgt_tokens": stats.tgt_tokens,
        "unk_tokens": stats.unk_tokens,
        "files": {path.name: path.stat().st_size for path in files.values()},
    }


def _write_meta(out: Path, meta: dict[str, Any]) -> None:
    atomic.write_bytes(
        out / "meta.json", (json.dumps(meta, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    )


def _summary(meta: dict[str, Any]) -> str:
    sizes = ", ".join(f"{role} {entry['pairs']}" for role, entry in meta["splits"].items())
    return f"vocabulary {meta['vocab_size']} ({meta['dtype']}), pairs: {sizes}"
