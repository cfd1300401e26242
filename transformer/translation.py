"""Translate lines of text with a checkpoint: the part shared by translate.py, evaluate.py and the
attention script. Bad input never stops a run: an empty line translates to an empty line, invalid
UTF-8 is replaced, an over-long line is truncated (each with a warning naming the line), and there is
always exactly one output line per input line.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from tqdm import tqdm

from transformer.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from transformer.config import ConfigError, DecodeConfig
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import SearchResult, beam_search, search_weights
from transformer.devices import decoding_dtype, resolve_device
from transformer.kernels import Kernels
from transformer.model import Transformer
from transformer.vocab import EOS_ID, PAD_ID

log = logging.getLogger(__name__)


class Translator:
    """A checkpoint's model and tokenizer with the decoding settings of `DecodeConfig` (§6.1)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        cfg: DecodeConfig,
        info: dict[str, Any] | None = None,
        kernels: Kernels | None = None,
    ) -> None:
        """model: with `kernels` in place already (`from_checkpoint` does both)."""
        self.model, self.tokenizer, self.cfg = model, tokenizer, cfg
        self.kernels = Kernels() if kernels is None else kernels
        self.info = info or {}  # the checkpoint's step, data_meta and run config
        self.device = next(model.parameters()).device
        positions = model.cfg.max_positions
        # Longest source (pieces + EOS) that still leaves room for max_len_a * |X| + max_len_b outputs.
        if cfg.max_len_a == 0:
            room = positions if cfg.max_len_b <= positions else 0
        else:
            room = int((positions - cfg.max_len_b) / cfg.max_len_a)
        self.max_source_tokens = min(positions, room)
        if self.max_source_tokens < 2:
            raise ConfigError(
                f"max_len_b={cfg.max_len_b} leaves no room for a source in this model's "
                f"{positions} positions; lower max_len_b or max_len_a"
            )

    @classmethod
    def from_checkpoint(cls, cfg: DecodeConfig) -> Translator:
        """Everything comes from the checkpoint file; problems raise CheckpointError or ConfigError."""
        device = resolve_device(cfg.device)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        if cfg.cuda_graphs and device.type != "cuda":
            raise ConfigError(f"cuda_graphs=true needs a CUDA device; device={cfg.device} gives the CPU")
        if cfg.cuda_graphs is None:
            cfg = dataclasses.replace(cfg, cuda_graphs=device.type == "cuda")
        dtype = decoding_dtype(cfg.precision, device)  # scores still add up in float32 (decoding/search.py)
        ckpt = load_checkpoint(cfg.checkpoint)
        if not ckpt.get("spm_model"):
            raise CheckpointError(f"{cfg.checkpoint} carries no tokenizer (spm_model)")
        try:
            tokenizer = Tokenizer.from_bytes(ckpt["spm_model"])
            model = model_from_checkpoint(ckpt)
        except (RuntimeError, ValueError, KeyError, TypeError) as error:  # mismatched weights or config
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CheckpointError(f"{cfg.checkpoint} cannot be loaded: {first}") from None
        model = model.to(device, dtype)  # out of the try: a device's error (out of memory) is not the file's
        kernels = Kernels.for_device(device)
        info = {k: ckpt.get(k) for k in ("step", "data_meta", "config")}
        return cls(kernels.apply(model), tokenizer, cfg, info, kernels)

    def encode(self, lines: list[str]) -> list[list[int]]:
        """Source ids (pieces + [EOS]) per line; over-long lines are truncated with a warning."""
        sources, too_long, room = [], [], self.max_source_tokens - 1
        for number, line in enumerate(lines, start=1):
            ids = self.tokenizer.encode(line) if line.strip() else []
            if len(ids) > room:
                too_long.append((number, f"{len(ids)} pieces exceed the {room} this model can take"))
                ids = ids[:room]
            sources.append(ids + [EOS_ID] if ids else [])
        warn_lines(too_long, f"translating the first {room} pieces")
        return sources

    def packed(self) -> AbstractContextManager[None]:
        """The weights packed once for every batch (`Products.prepacked`), in 8 bits for precision=int8."""
        int8 = self.cfg.precision == "int8"
        return self.kernels.products.prepacked(search_weights(self.model, int8), int8)

    def search(self, src: torch.Tensor) -> SearchResult:
        """Beam search as in §6.1 (beam_size=1: greedy, without length penalty) on a padded batch (B, S);
        with cuda_graphs, in static shapes and CUDA graphs."""
        cfg = self.cfg
        alpha = cfg.alpha if cfg.beam_size > 1 else 0.0
        limits = dict(max_len_a=cfg.max_len_a, max_len_b=cfg.max_len_b)
        static, linear = cfg.cuda_graphs, self.kernels.products
        return beam_search(self.model, src, cfg.beam_size, alpha, **limits, static=static, linear=linear)

    def translate_ids(self, sources: list[list[int]], progress: bool = False) -> list[list[int]]:
        """Output piece ids per source; sources are batched by length and results put back in order."""
        outputs: list[list[int]] = [[] for _ in sources]
        todo = sorted((i for i, ids in enumerate(sources) if ids), key=lambda i: -len(sources[i]))
        bar = tqdm(total=len(todo), unit=" sent", disable=not progress, desc="translating")
        with bar, self.packed():
            lengths, cfg = [len(ids) for ids in sources], self.cfg
            for batch in _batches(todo, lengths, cfg.max_tokens, cfg.max_sentences):
                src = torch.full((len(batch), len(sources[batch[0]])), PAD_ID, dtype=torch.long)  # (B, S)
                for row, i in enumerate(batch):
                    src[row, : len(sources[i])] = torch.tensor(sources[i])
                result = self.search(src.to(self.device))
                for i, tokens in zip(batch, result.tokens):
                    outputs[i] = tokens
                bar.update(len(batch))
        return outputs

    def translate(self, lines: list[str], progress: bool = False) -> list[str]:
        """One output line per input line (line breaks inside a translation become spaces)."""
        outputs = self.translate_ids(self.encode(lines), progress)
        return [" ".join(self.tokenizer.decode(ids).splitlines()) if ids else "" for ids in outputs]


def _batches(
    order: list[int], lengths: list[int], max_tokens: int, max_sentences: int
) -> Iterator[list[int]]:
    """Consecutive runs of `order` (longest first) whose padded size n x longest stays in budget, of at
    most max_sentences: the decoder's keys and values take n x beam x (a x |X| + b) positions per layer,
    so many short lines would take far more memory than the source tokens' budget suggests."""
    batch: list[int] = []
    for i in order:
        if batch and ((len(batch) + 1) * lengths[batch[0]] > max_tokens or len(batch) == max_sentences):
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch


def split_input(data: bytes) -> list[str]:
    """Lines of raw input, split on b"\\n" only (so a stray U+2028 or form feed cannot add a line);
    invalid UTF-8 is replaced by U+FFFD with a warning naming the line."""
    lines = data.split(b"\n")
    if lines[-1] == b"":  # the input ended with a newline (or was empty)
        lines.pop()
    text, invalid = [], []
    for number, raw in enumerate(lines, start=1):
        raw = raw.removesuffix(b"\r")
        try:
            text.append(raw.decode("utf-8"))
        except UnicodeDecodeError as error:
            invalid.append((number, f"invalid UTF-8 ({error.reason})"))
            text.append(raw.decode("utf-8", errors="replace"))
    warn_lines(invalid, "undecodable bytes replaced")
    return text


def warn_lines(problems: list[tuple[int, str]], action: str, shown: int = 5) -> None:
    """One warning per bad input line for the first `shown`, then one with the count of them all."""
    for number, problem in problems[:shown]:
        log.warning("line %d: %s; %s", number, problem, action)
    if len(problems) > shown:
        first = ", ".join(str(number) for number, _ in problems[:shown])
        log.warning("%d lines in all like these (lines %s, ...): %s", len(problems), first, action)
