"""Corpus sources: read every configured split of a parallel corpus into memory as stripped text.

Three sources (`data.source`): `hf` (a Hugging Face dataset from the hub or saved to disk), `local`
(plain-text files `<path>/<split>.<lang>`, optionally gzipped) and `toy` (the built-in synthetic corpus).
Every check of the user's input happens here, before any heavy work: a missing split, an empty file,
sides of different lengths, invalid UTF-8, each reported with the file (and line) at fault.
"""

from __future__ import annotations

import copy
import gzip
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from transformer.config import ConfigError, DataConfig

_READ_BLOCK_BYTES = 1 << 22  # read about 4 MB of lines at a time: fast, and a bounded memory spike
_HF_BATCH = 100_000


class DataError(ValueError):
    """The corpus itself is unusable (as opposed to the configuration); the message names the file."""


@dataclass
class Split:
    """One split of a parallel corpus: line i of `src` translates to line i of `tgt`."""

    role: str  # train | valid | test
    name: str  # the split's name in the source (e.g. "validation", "newstest2013")
    src: list[str]
    tgt: list[str]
    origin: str  # where the text came from, for messages


def load_splits(cfg: DataConfig) -> dict[str, Split]:
    """Every configured split of the corpus, stripped of surrounding whitespace; nothing dropped yet."""
    readers = {"local": _read_local, "hf": _read_hf, "toy": _read_toy}
    return readers[cfg.source](cfg)


def read_split(cfg: DataConfig, role: str) -> Split:
    """The raw source and reference text of one split (role), reading only that split."""
    names = cfg.split_names
    if role not in names:
        raise ConfigError(f"data {cfg.name} has no '{role}' split; it has: {', '.join(names)}")
    only = copy.copy(cfg)  # the same corpus, asked for one split (no validation: 'train' is left out)
    only.splits, only.local_splits = {role: names[role]}, None
    return load_splits(only)[role]


# --------------------------------------------------------------------------------------------- local


def _read_local(cfg: DataConfig) -> dict[str, Split]:
    directory = Path(cfg.path)
    if not directory.is_dir():
        raise DataError(f"data.path={cfg.path} is not a directory")
    splits = {}
    for role, name in cfg.split_names.items():
        src_path = _find_file(directory, name, cfg.src_lang, role)
        tgt_path = _find_file(directory, name, cfg.tgt_lang, role)
        src, tgt = read_lines(src_path), read_lines(tgt_path)
        if len(src) != len(tgt):
            raise DataError(
                f"{src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; "
                "the two sides of a split must align line by line"
            )
        splits[role] = Split(role, name, src, tgt, origin=f"{src_path} + {tgt_path}")
    return splits


def _find_file(directory: Path, name: str, lang: str, role: str) -> Path:
    plain = directory / f"{name}.{lang}"
    packed = directory / f"{name}.{lang}.gz"
    if plain.is_file() and packed.is_file():
        raise DataError(f"both {plain} and {packed} exist; keep one of them")
    if plain.is_file():
        return plain
    if packed.is_file():
        return packed
    raise DataError(f"the '{role}' split is missing: expected {plain} or {packed}")


def read_lines(path: Path) -> list[str]:
    """The stripped lines of a UTF-8 text file (`.gz` is decompressed); CRLF and a BOM are accepted."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    lines: list[str] = []
    bar = tqdm(desc=f"reading {path.name}", unit=" lines", unit_scale=True)
    try:
        with opener(path, "rb") as file, bar:
            while block := file.readlines(_READ_BLOCK_BYTES):
                lines.extend(_decode_block(b"".join(block), path, first_line=len(lines) + 1))
                bar.update(len(block))
    except _GZIP_ERRORS as error:  # cut short, or not gzip at all
        reason = str(error).strip() or type(error).__name__
        line = _whole_gzip_lines(path) + 1
        raise DataError(f"{path}, line {line}: truncated or not gzip ({reason})") from None
    if not lines:
        raise DataError(f"{path} is empty")
    if lines[0].startswith("\ufeff"):  # a byte-order mark some editors write; not part of the text
        lines[0] = lines[0][1:].strip()
    return lines


_GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error)


def _whole_gzip_lines(path: Path) -> int:
    """How many lines of a damaged gzip file decompress whole."""
    count = 0
    try:
        with gzip.open(path, "rb") as file:
            for _ in file:
                count += 1
    except _GZIP_ERRORS:
        pass
    return count


def _decode_block(block: bytes, path: Path, first_line: int) -> list[str]:
    """Split a block of whole lines on b"\\n" only (str.splitlines would also split on U+2028 and
    friends, and silently misalign the two sides)."""
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError as error:
        line = first_line + block.count(b"\n", 0, error.start)
        raise DataError(f"{path}, line {line}: invalid UTF-8 ({error.reason})") from None
    lines = text.split("\n")
    if lines[-1] == "":  # the block ended with a newline
        lines.pop()
    return [line.strip() for line in lines]


# ------------------------------------------------------------------------------------------------ hf


def _read_hf(cfg: DataConfig) -> dict[str, Split]:
    import datasets  # imported here: slow to import, and only this source needs it

    where = cfg.path if cfg.path is not None else f"{cfg.hf_dataset} (config {cfg.hf_config})"
    try:
        if cfg.path is not None:
            corpus = datasets.load_from_disk(cfg.path)
        else:
            corpus = datasets.load_dataset(cfg.hf_dataset, cfg.hf_config)
    except (FileNotFoundError, ConnectionError, ValueError) as error:  # not found, offline, bad config
        message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        unreachable = isinstance(error, ConnectionError) and cfg.path is None  # the hub, offline
        hint = "; offline, data.source=local data.path=DIR reads text files" if unreachable else ""
        raise DataError(f"cannot load the Hugging Face dataset {where}: {message}{hint}") from None
    if not isinstance(corpus, datasets.DatasetDict):
        raise DataError(f"{where} holds a single dataset; it must be a DatasetDict with named splits")
    splits = {}
    for role, name in cfg.split_names.items():
        if name not in corpus:
            raise DataError(
                f"{where} has no split {name!r} (data.splits.{role}); it has: {', '.join(corpus.keys())}"
            )
        src, tgt = _hf_columns(corpus[name], cfg, f"{where} split {name!r}")
        splits[role] = Split(role, name, src, tgt, origin=f"{where} split {name!r}")
    return splits


def _hf_columns(dataset: Any, cfg: DataConfig, where: str) -> tuple[list[str], list[str]]:
    """Both sides of one split, from the WMT schema {"translation": {lang: text}} or flat {lang: text}."""
    import pyarrow.compute as pc

    schema = dataset.data.schema
    nested = "translation" in schema.names
    available = [field.name for field in schema.field("translation").type] if nested else list(schema.names)

    def column(batch: Any, lang: str) -> Any:
        return pc.struct_field(batch.column("translation"), lang) if nested else batch.column(lang)

    missing = [lang for lang in (cfg.src_lang, cfg.tgt_lang) if lang not in available]
    if missing:
        raise DataError(f"{where} has no {', '.join(missing)} text; it has: {', '.join(available)}")
    src: list[str] = []
    tgt: list[str] = []
    with tqdm(total=len(dataset), desc=f"reading {where}", unit=" pairs", unit_scale=True) as bar:
        for batch in dataset.with_format("arrow").iter(batch_size=_HF_BATCH):
            src.extend((text or "").strip() for text in column(batch, cfg.src_lang).to_pylist())
            tgt.extend((text or "").strip() for text in column(batch, cfg.tgt_lang).to_pylist())
            bar.update(batch.num_rows)
    return src, tgt


# ----------------------------------------------------------------------------------------------- toy


def _read_toy(cfg: DataConfig) -> dict[str, Split]:
    from transformer.data.toy import generate_splits  # the synthetic corpus is only built when asked for

    toy = cfg.toy
    corpus = generate_splits(toy.n_train, toy.n_valid, toy.n_test, toy.seed)
    english_first = cfg.src_lang == "en"  # the generator yields (english, german) pairs
    splits = {}
    for role, name in cfg.split_names.items():
        if name not in corpus:
            raise DataError(
                f"the toy corpus has no split {name!r} (data.splits.{role}); it has: {sorted(corpus)}"
            )
        first = [a.strip() for a, _ in corpus[name]]
        second = [b.strip() for _, b in corpus[name]]
        src, tgt = (first, second) if english_first else (second, first)
        splits[role] = Split(role, name, src, tgt, origin=f"toy corpus split {name!r}")
    return splits
