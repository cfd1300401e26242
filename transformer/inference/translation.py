"""Translate lines of text with a checkpoint: the part shared by translate.py, evaluate.py, the server
and the attention script. Bad input never stops a run: an empty line translates to an empty line,
invalid UTF-8 is replaced, a line longer than the model takes is split at its sentence ends (Moses'
rules, by the `sentence_splitter` package, as WMT's pipelines split; a sentence still too long is cut
into parts at word starts), its parts translated alone and joined, or truncated with
`long_inputs=truncate` (each with a warning naming the line); there is always exactly one output line
per input line.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sentence_splitter import SentenceSplitter, SentenceSplitterException
from tqdm import tqdm

from transformer.checkpoint import CheckpointError, load_checkpoint, model_from_checkpoint
from transformer.config import ConfigError, DecodeConfig, GuideFiles, SearchConfig
from transformer.data.tokenizer import Tokenizer
from transformer.decoding import (
    Ensemble,
    Hypothesis,
    SearchResult,
    Shortlist,
    beam_search,
    length_penalty,
    search_weights,
)
from transformer.decoding.scoring import Linear, project
from transformer.inference.alignment import Alignment, cross_attention, from_links, hard_links, joined
from transformer.inference.vocabulary_map import VocabularyMap
from transformer.kernels import Kernels
from transformer.kernels.timing import KEYS, decoding_kernels
from transformer.model import Transformer
from transformer.utils.devices import decoding_dtype, resolve_device
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

log = logging.getLogger(__name__)


@dataclass
class Translation:
    """One output for one input line: its text; its score, log P(Y|X) / lp(Y) as the search ranks it
    (GNMT length penalty with the decoding's alpha; a beam of 1 and sampling without: log P(Y|X));
    log P(Y|X) itself (natural log, EOS included); its pieces, "</s>" last where it ended in EOS; and
    each piece's log-probability; with `alignment=true`, its hard alignment to the source."""

    text: str
    score: float
    log_prob: float
    pieces: list[str]
    token_log_probs: list[float]
    alignment: Alignment | None = None


class Translator:
    """A checkpoint's model (or an ensemble of several) and tokenizer with the decoding settings of
    `DecodeConfig` (§6.1): `translate` (text), `translate_nbest` (hypotheses with scores), `score`
    (given translations). Each takes a list of lines, or one line as a string (its result alone), and
    a `SearchConfig` for that call instead of the settings' own (`search`)."""

    def __init__(
        self,
        model: Transformer | list[Transformer],
        tokenizer: Tokenizer,
        cfg: DecodeConfig,
        info: dict[str, Any] | None = None,
        kernels: Kernels | None = None,
        vocabulary_map: VocabularyMap | None = None,
    ) -> None:
        """model: with `kernels` in place already (`from_checkpoint` does both); several: an ensemble,
        weighted by cfg.weights; vocabulary_map: cfg.vocabulary_map's, read already (default: read
        here)."""
        self.models = model if isinstance(model, list) else [model]
        self.model = self.models[0]
        self.tokenizer, self.cfg = tokenizer, cfg
        self.kernels = Kernels() if kernels is None else kernels
        if cfg.precision == "int8" and not self.kernels.int8:  # the linear maps would stay float32
            raise ValueError(
                "precision=int8 needs the models' kernels chosen with int8=True (as from_checkpoint)"
            )
        self.info = info or {}  # the checkpoint's step, data_meta and run config
        self.device = next(self.model.parameters()).device
        # an ensemble's sources and outputs fit its shortest member
        self.max_positions = min(m.cfg.max_positions for m in self.models)
        self.max_source_tokens(cfg.search)  # a limit that leaves no room for a source fails now
        self._splitter: SentenceSplitter | None = None  # made when a line first needs it
        self._said_dynamic = False  # the log said that constraints take the dynamic search
        if vocabulary_map is None and cfg.vocabulary_map is not None:
            vocabulary_map = VocabularyMap.load(cfg.vocabulary_map, tokenizer)
        self.vocabulary_map = vocabulary_map

    def max_source_tokens(self, search: SearchConfig) -> int:
        """The longest source (pieces + EOS) that still leaves room for max_len_a * |X| + max_len_b
        outputs in the model's positions."""
        positions = self.max_positions
        if search.max_len_a == 0:
            room = positions if search.max_len_b <= positions else 0
        else:  # a tiny max_len_a gives room beyond the positions, or beyond a float: capped first
            room = int(max(0.0, min((positions - search.max_len_b) / search.max_len_a, positions)))
        if min(positions, room) < 2:
            raise ConfigError(
                f"max_len_a={search.max_len_a} and max_len_b={search.max_len_b} leave no room for a source "
                f"in this model's {positions} positions; lower them"
            )
        return min(positions, room)

    @classmethod
    def from_checkpoint(cls, checkpoint: DecodeConfig | str | Path | list[str], **options: Any) -> Translator:
        """Everything comes from the checkpoint file (or files: an ensemble); options are `DecodeConfig`'s
        settings (beam_size=5, nbest=2, device="cpu", ...). Problems raise CheckpointError or ConfigError."""
        if isinstance(checkpoint, DecodeConfig):
            cfg = dataclasses.replace(checkpoint, **options)
        else:
            paths = [str(p) for p in checkpoint] if isinstance(checkpoint, list) else str(checkpoint)
            cfg = DecodeConfig(checkpoint=paths, **options)
        device = resolve_device(cfg.device)
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        if cfg.cuda_graphs and device.type != "cuda":
            raise ConfigError(f"cuda_graphs=true needs a CUDA device; device={cfg.device} gives the CPU")
        if cfg.cuda_graphs is None:
            cfg = dataclasses.replace(cfg, cuda_graphs=device.type == "cuda")
        dtype = decoding_dtype(cfg.precision, device)  # scores still add up in float32 (decoding/search.py)
        entries = None if cfg.vocabulary_map is None else VocabularyMap.read(cfg.vocabulary_map)
        checkpoints = [cfg.checkpoint] if isinstance(cfg.checkpoint, str) else cfg.checkpoint
        loaded = [_load(path) for path in checkpoints]
        for path, (_, _, ckpt) in zip(checkpoints[1:], loaded[1:]):
            if ckpt["spm_model"] != loaded[0][2]["spm_model"]:
                raise ConfigError(
                    f"{checkpoints[0]} and {path} have different tokenizers: an ensemble needs one vocabulary"
                )
        int8 = cfg.precision == "int8"
        kernels = decoding_kernels(loaded[0][0].cfg, device, cfg.cpu_kernels, int8, *rows(cfg))
        # .to() out of _load: a device's error (out of memory) is not the file's
        models = [kernels.apply(model.to(device, dtype)) for model, _, _ in loaded]
        ckpt = loaded[0][2]
        info = {k: ckpt.get(k) for k in ("step", "data_meta", "config")}
        vocabulary_map = None if entries is None else VocabularyMap.of(entries, loaded[0][1])
        return cls(models, loaded[0][1], cfg, info, kernels, vocabulary_map)

    def encode(
        self,
        lines: list[str],
        search: SearchConfig | None = None,
        whole: list[bool] | None = None,
        first: int | list[int] = 0,
    ) -> list[list[list[int]]]:
        """Per line its sources (pieces + [EOS]), none for an empty line: one, or for a line longer than
        the search's output limit leaves room for, its parts (`long_inputs=split`) or its first pieces
        (`truncate`, and for the lines `whole` marks: those with constraints, whose phrases are the whole
        line's), with a warning naming the line (by its number in the whole input: `first`, as
        `translate_nbest` takes it)."""
        search = search or self.cfg.search
        sources, split, cut, room = [], [], [], self.max_source_tokens(search) - 1
        for i, (number, line) in enumerate(zip(line_numbers(first, len(lines), start=1), lines)):
            ids = self.tokenizer.encode(line) if line.strip() else []
            parts = [ids] if ids else []
            if len(ids) > room:
                problem = f"{len(ids)} pieces exceed the {room} this model can take"
                if search.long_inputs == "split" and not (whole and whole[i]):
                    parts = self._parts(line, room)
                    split.append((number, f"{problem}: {len(parts)} parts"))
                else:
                    parts = [ids[:room]]
                    cut.append((number, problem))
            sources.append([part + [EOS_ID] for part in parts])
        warn_lines(split, "translating its sentences alone (a sentence too long in parts), joined")
        warn_lines(cut, f"translating the first {room} pieces")
        return sources

    def _parts(self, line: str, room: int) -> list[list[int]]:
        """The pieces of each sentence of an overlong line; a sentence longer than room cut into near
        equal parts, each ending before a piece that starts a word where one is in its second half."""
        parts = []
        for sentence in self.splitter.split(line):
            ids = self.tokenizer.encode(sentence)
            starts = [piece.startswith("▁") for piece in self.tokenizer.pieces(ids)]
            while len(ids) > room:
                size = -(-len(ids) // -(-len(ids) // room))  # the parts' size, at most room
                end = next((j for j in range(size, size // 2, -1) if starts[j]), size)
                parts.append(ids[:end])
                ids, starts = ids[end:], starts[end:]
            parts += [ids] if ids else []
        return parts

    @property
    def splitter(self) -> SentenceSplitter:
        """Moses' sentence splitter for the source language (English's rules where it has none)."""
        if self._splitter is None:
            lang = (self.info.get("data_meta") or {}).get("src_lang") or "en"
            try:
                self._splitter = SentenceSplitter(language=lang)
            except SentenceSplitterException:
                log.warning("no sentence-splitting rules for %r; splitting long lines by English's", lang)
                self._splitter = SentenceSplitter(language="en")
        return self._splitter

    def packed(self) -> AbstractContextManager[None]:
        """The weights packed once for every batch (`Products.prepacked`), in 8 bits for precision=int8."""
        int8, stack = self.cfg.precision == "int8", ExitStack()
        for model in self.models:
            stack.enter_context(self.kernels.products.prepacked(search_weights(model, int8), int8))
        return stack

    def search(
        self,
        src: torch.Tensor,
        search: SearchConfig | None = None,
        sentence_ids: torch.Tensor | None = None,
        guides: list[Guide] | None = None,
    ) -> SearchResult:
        """The search on a padded batch (B, S) (default: the settings'): beam search as in §6.1
        (beam_size=1: greedy, without length penalty) with its `nbest` best, or `nbest` samples; with
        cuda_graphs, in static shapes and CUDA graphs (in dynamic ones under constraints); with a
        vocabulary map, over the batch's candidates only. sentence_ids (B,): the lines' numbers
        (sampling's draws); guides: each line's prefix and phrases."""
        cfg = self.cfg
        model = (
            self.model
            if len(self.models) == 1
            else Ensemble(self.models, cfg.weights or [1.0] * len(self.models))
        )
        linear, search = self.kernels.products, search or cfg.search
        prefix = padded([g.prefix for g in guides]).to(src.device) if guides else None  # (B, P)
        constraints = [g.phrases for g in guides] if guides and any(g.phrases for g in guides) else None
        if constraints is not None and cfg.cuda_graphs and not self._said_dynamic:
            log.info("constraints: the search runs in dynamic shapes, without CUDA graphs")
            self._said_dynamic = True
        static = cfg.cuda_graphs and constraints is None
        shortlist, packed = None, ExitStack()
        if self.vocabulary_map is not None:  # the batch's candidates, the forced pieces among them
            forced = [t for g in guides or [] for t in g.prefix]
            forced += [t for g in guides or [] for phrase in g.phrases for t in phrase]
            shortlist = Shortlist.of(model, self.vocabulary_map.candidates(src.tolist(), forced))
            packed.enter_context(self.kernels.products.prepacked(shortlist.chunks(), cfg.precision == "int8"))
        with packed:
            return beam_search(
                model,
                src,
                search,
                static=static,
                linear=linear,
                sentence_ids=sentence_ids,
                prefix=prefix,
                constraints=constraints,
                shortlist=shortlist,
            )

    def search_all(
        self,
        sources: list[list[int]],
        progress: bool = False,
        first: int | list[int] = 0,
        search: SearchConfig | None = None,
        guides: list[Guide] | None = None,
    ) -> list[list[Hypothesis]]:
        """The hypotheses of each source; sources are batched by length and results put back in order.
        first: the number of the first source in the whole input, or each source's number (sampling
        draws by line number); guides: each source's prefix and phrases."""
        numbers = torch.tensor(line_numbers(first, len(sources)), dtype=torch.long)
        outputs: list[list[Hypothesis]] = [[] for _ in sources]
        todo = sorted((i for i, ids in enumerate(sources) if ids), key=lambda i: -len(sources[i]))
        bar = tqdm(total=len(todo), unit=" sent", disable=not progress, desc="translating")
        with bar, self.packed():
            lengths, cfg = [len(ids) for ids in sources], self.cfg
            for batch in _batches(todo, lengths, cfg.max_tokens, cfg.max_sentences):
                src = padded([sources[i] for i in batch])  # (B, S)
                guided = [guides[i] for i in batch] if guides else None
                result = self.search(src.to(self.device), search, numbers[batch], guided)
                for i, hypotheses in zip(batch, result.hypotheses):
                    outputs[i] = hypotheses
                bar.update(len(batch))
        return outputs

    def translate_ids(
        self, sources: list[list[int]], progress: bool = False, search: SearchConfig | None = None
    ) -> list[list[int]]:
        """The best output's piece ids per source."""
        return [h[0].tokens if h else [] for h in self.search_all(sources, progress, search=search)]

    def translate(
        self,
        lines: list[str] | str,
        progress: bool = False,
        search: SearchConfig | None = None,
        target_prefix: list[str] | str | None = None,
        constraints: list[list[str]] | list[str] | None = None,
    ) -> list[str] | str:
        """One output line per input line, the best (line breaks inside a translation become spaces);
        for one line given as a string, its translation. target_prefix, constraints: as
        `translate_nbest` takes them."""
        one, lines = _lines(lines)
        search = dataclasses.replace(search or self.cfg.search, alignment=False)  # text alone: none needed
        constraints = _per_line(one, constraints)
        nbest = self.translate_nbest(lines, progress, 0, search, target_prefix, constraints)
        translations = [hypotheses[0].text if hypotheses else "" for hypotheses in nbest]
        return translations[0] if one else translations

    def translate_nbest(
        self,
        lines: list[str] | str,
        progress: bool = False,
        first: int | list[int] = 0,
        search: SearchConfig | None = None,
        target_prefix: list[str] | str | None = None,
        constraints: list[list[str]] | list[str] | None = None,
        strict: bool = True,
    ) -> list[list[Translation]] | list[Translation]:
        """Per input line its `nbest` hypotheses (or samples), best first; none for an empty line (for
        one line given as a string, its hypotheses). first: the number of the first line in the whole
        input, or each line's number (sampling draws by line number); target_prefix: per line (or for
        the one line) the text every hypothesis starts with, "" for none; constraints: per line (or for
        the one line) the phrases every hypothesis contains, a string for one phrase; strict: as
        `guides` takes it."""
        one, lines = _lines(lines)
        constraints = _per_line(one, constraints)
        guides = self.guides(lines, target_prefix, constraints, search, strict, first)
        search = search or self.cfg.search
        sources = self.encode(lines, search, kept_whole(guides), first)
        nbest = self.nbest_of(sources, progress, first, search, guides)
        return nbest[0] if one else nbest

    def guides(
        self,
        lines: list[str],
        target_prefix: list[str] | str | None = None,
        constraints: list[list[str]] | None = None,
        search: SearchConfig | None = None,
        strict: bool = True,
        first: int | list[int] = 0,
    ) -> list[Guide] | None:
        """Each line's `Guide`: the pieces of its target prefix ("": none) and of its phrases; None
        without either. Counts other than the lines' and phrases with sampling (of `search`, default the
        settings') are refused; so is a line whose prefix and phrases leave no room in the model's
        positions, or, not `strict`, translated without them, with a warning naming it (numbered from
        `first`, as `translate_nbest` takes it)."""
        if target_prefix is None and constraints is None:
            return None
        prefixes = [target_prefix] if isinstance(target_prefix, str) else target_prefix or [""] * len(lines)
        phrases = constraints if constraints is not None else [[]] * len(lines)
        for given, what in ((prefixes, "target prefixes"), (phrases, "lines of constraints")):
            if len(given) != len(lines):
                raise ConfigError(f"{len(lines)} input lines but {len(given)} {what}: one per line")
        if constraints is not None and (search or self.cfg.search).sampling:
            raise ConfigError("constraints shape a search: not with sampling=true")
        encode = self.tokenizer.encode
        guides = [
            Guide(encode(p) if p.strip() else [], [encode(c) for c in cs if c.strip()])
            for p, cs in zip(prefixes, phrases)
        ]
        too_long = []
        for i, (number, guide) in enumerate(zip(line_numbers(first, len(lines), start=1), guides)):
            pieces = len(guide.prefix) + sum(map(len, guide.phrases))
            if pieces >= self.max_positions:
                problem = (
                    f"its target prefix and constraints take {pieces} pieces; an output of this model "
                    f"holds at most {self.max_positions - 1}"
                )
                if strict:
                    raise ConfigError(f"line {number}: {problem}")
                too_long.append((number, problem))
                guides[i] = Guide([], [])
        warn_lines(too_long, "translating it without them")
        return guides

    def nbest_of(
        self,
        sources: list[list[list[int]]],
        progress: bool = False,
        first: int | list[int] = 0,
        search: SearchConfig | None = None,
        guides: list[Guide] | None = None,
    ) -> list[list[Translation]]:
        """`translate_nbest` of lines encoded already (`encode`'s sources; `guides`' guides, whose prefix a
        line in parts forces on its first). A line in parts: its i-th hypothesis joins its parts' i-th,
        their scores, log-probabilities and pieces (each "</s>" too) added up, and their alignments
        (`joined`)."""
        search = search or self.cfg.search
        numbers = line_numbers(first, len(sources))
        # each part draws its own samples: the first the line's number, the others apart from every line's
        keys = [
            n if j == 0 else -((n << 20) + j) for n, parts in zip(numbers, sources) for j in range(len(parts))
        ]
        flat = [part for parts in sources for part in parts]
        forced = None if guides is None else part_guides(guides, sources)
        found = [
            [h for h in hypotheses if h.token_log_probs]
            for hypotheses in self.search_all(flat, progress, keys, search, forced)
        ]
        pairs = [(src, h.tokens) for src, hypotheses in zip(flat, found) for h in hypotheses]
        aligned = iter(self.align(pairs) if search.alignment else [None] * len(pairs))
        translated = iter([[self._translation(h, next(aligned)) for h in hypotheses] for hypotheses in found])
        nbest = []
        for parts in sources:
            each = [next(translated) for _ in parts]
            nbest.append(each[0] if len(each) == 1 else [_joined(h) for h in zip(*each)])
        return nbest

    def align(self, pairs: list[tuple[list[int], list[int]]]) -> list[Alignment]:
        """The hard alignment (inference/alignment.py) of each (source pieces + [EOS], output pieces) pair,
        by a teacher-forced pass over batches of them: the model is deterministic, so the attention is the
        search's own."""
        links: list[list[int]] = [[] for _ in pairs]  # per pair, the source piece of each output piece
        todo = [i for i, (_, tokens) in enumerate(pairs) if tokens]
        lengths = [max(len(src), len(tokens)) for src, tokens in pairs]
        weights = self.cfg.weights or [1.0] * len(self.models)
        with torch.inference_mode(), self.packed():
            for batch in _batches(sorted(todo, key=lambda i: -lengths[i]), lengths, self.cfg.max_tokens, 256):
                src = padded([pairs[i][0] for i in batch]).to(self.device)  # (B, S)
                # the queries of target pieces y_1..y_n: [BOS] + y_<n
                tgt_in = padded([[BOS_ID] + pairs[i][1][:-1] for i in batch]).to(self.device)  # (B, T)
                found = hard_links(cross_attention(self.models, weights, src, tgt_in), src).tolist()  # (B, T)
                for row, i in enumerate(batch):
                    links[i] = found[row][: len(pairs[i][1])]
        pieces = self.tokenizer.pieces
        return [from_links(chosen, pieces(src[:-1]), pieces(out)) for chosen, (src, out) in zip(links, pairs)]

    def score(
        self, lines: list[str] | str, translations: list[str] | str, search: SearchConfig | None = None
    ) -> list[Translation | None] | Translation | None:
        """Given translations scored by teacher forcing (fairseq's --score-reference): per line the
        log-probability of each of its pieces and EOS, under the model (an ensemble's mixture), and the
        score the search (its length penalty) would rank it by, and with `alignment=true` its alignment
        (a forced alignment); None for an empty line."""
        one, lines = _lines(lines)
        translations = [translations] if isinstance(translations, str) else translations
        if len(lines) != len(translations):
            raise ConfigError(f"{len(lines)} input lines but {len(translations)} translations to score")
        search = search or self.cfg.search
        # the given translation is the whole line's: its source is not split
        encoded = self.encode(lines, dataclasses.replace(search, long_inputs="truncate"))
        sources, room = [parts[0] if parts else [] for parts in encoded], self.max_positions - 1
        targets = [self.tokenizer.encode(t)[:room] + [EOS_ID] for t in translations]
        scored: list[Translation | None] = [None] * len(lines)
        todo = [i for i, ids in enumerate(sources) if ids]
        weights = self.cfg.weights or [1.0] * len(self.models)
        lengths = [max(len(sources[i]), len(targets[i])) for i in range(len(lines))]
        with torch.inference_mode(), self.packed():
            for batch in _batches(sorted(todo, key=lambda i: -lengths[i]), lengths, self.cfg.max_tokens, 256):
                src, tgt = padded([sources[i] for i in batch]), padded([targets[i] for i in batch])
                src, tgt = src.to(self.device), tgt.to(self.device)
                log_probs = teacher_forced(self.models, weights, src, tgt, self.kernels.products)
                for row, i in enumerate(batch):
                    token_log_probs = log_probs[row, : len(targets[i])].tolist()
                    score = sum(token_log_probs) / length_penalty(len(targets[i]), search.ranking_alpha)
                    scored[i] = self._translation(Hypothesis(targets[i][:-1], score, token_log_probs))
        if search.alignment:
            for i, found in zip(todo, self.align([(sources[i], targets[i][:-1]) for i in todo])):
                scored[i].alignment = found
        return scored[0] if one else scored

    def text(self, ids: list[int]) -> str:
        """Piece ids as one line of text."""
        return " ".join(self.tokenizer.decode(ids).splitlines()) if ids else ""

    def _translation(self, h: Hypothesis, alignment: Alignment | None = None) -> Translation:
        pieces = self.tokenizer.pieces(h.tokens) + ["</s>"] * (len(h.token_log_probs) - len(h.tokens))
        return Translation(self.text(h.tokens), h.score, h.log_prob, pieces, h.token_log_probs, alignment)


@dataclass
class Guide:
    """What a line's translations must hold: its first pieces (target_prefix) and phrases, each in the
    output whole (constraints)."""

    prefix: list[int]
    phrases: list[list[int]]


def _joined(parts: tuple[Translation, ...]) -> Translation:
    """The translations of a line's parts as the line's: texts joined by a space, the rest added up."""
    return Translation(
        " ".join(filter(None, (t.text for t in parts))),
        sum(t.score for t in parts),
        sum(t.log_prob for t in parts),
        [piece for t in parts for piece in t.pieces],
        [p for t in parts for p in t.token_log_probs],
        None if parts[0].alignment is None else joined([t.alignment for t in parts]),
    )


def rows(cfg: DecodeConfig) -> tuple[int, int]:
    """The rows a decoding step of these settings typically multiplies (hypotheses), and its encoder
    (source tokens), each rounded up to a power of two: the CPU kernels are timed at these shapes."""
    sentences = min(cfg.max_sentences, 32)
    hypotheses, sources = cfg.width * sentences, min(cfg.max_tokens, sentences * KEYS)
    return 1 << (hypotheses - 1).bit_length(), 1 << (sources - 1).bit_length()


def _load(path: str) -> tuple[Transformer, Tokenizer, dict[str, Any]]:
    """A checkpoint's model (on the CPU) and tokenizer, and the checkpoint."""
    ckpt = load_checkpoint(path)
    if not ckpt.get("spm_model"):
        raise CheckpointError(f"{path} carries no tokenizer (spm_model)")
    try:
        return model_from_checkpoint(ckpt), Tokenizer.from_bytes(ckpt["spm_model"]), ckpt
    except (RuntimeError, ValueError, KeyError, TypeError) as error:  # mismatched weights or config
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path} cannot be loaded: {first}") from None


def _lines(lines: list[str] | str) -> tuple[bool, list[str]]:
    """(whether one line came as a string, the lines): a string is one line, never its characters."""
    if isinstance(lines, str):
        return True, [lines]
    if not isinstance(lines, (list, tuple)) or not all(isinstance(line, str) for line in lines):
        raise TypeError(f"lines must be a list of strings (or one string), not {type(lines).__name__}")
    return False, list(lines)


def kept_whole(guides: list[Guide] | None) -> list[bool] | None:
    """The lines `encode` keeps whole, cut to fit rather than split: those with phrases, which are the
    whole line's."""
    return None if guides is None else [bool(g.phrases) for g in guides]


def part_guides(guides: list[Guide], sources: list[list[list[int]]]) -> list[Guide]:
    """Each source part's guide (of `encode`'s sources): a line's is its first part's, the others none."""
    return [g if j == 0 else Guide([], []) for g, parts in zip(guides, sources) for j in range(len(parts))]


def _per_line(one: bool, constraints: list[list[str]] | list[str] | None) -> list[list[str]] | None:
    """Constraints per line, as the server reads them: for one line given as a string, its phrases may
    come as one list; a line's phrases given as a string are that one phrase."""
    if constraints is None:
        return None
    if one and all(isinstance(c, str) for c in constraints):
        return [list(constraints)]
    return [[c] if isinstance(c, str) else c for c in constraints]


def padded(rows: list[list[int]]) -> torch.Tensor:
    """(B, longest) token ids, padded with PAD_ID."""
    batch = torch.full((len(rows), max(len(r) for r in rows)), PAD_ID, dtype=torch.long)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = torch.tensor(row)
    return batch


def teacher_forced(
    models: list[Transformer], weights: list[float], src: torch.Tensor, tgt: torch.Tensor, linear: Linear
) -> torch.Tensor:
    """(B, T) float32 log P(y_t | y_<t, X) of each target token of tgt (B, T) (pieces + [EOS], padded),
    by one full decode of [BOS] + y per model, its output projection made by `linear` as the search's
    is; an ensemble's log sum_m w_m P_m."""
    tgt_in = torch.cat([torch.full_like(tgt[:, :1], BOS_ID), tgt[:, :-1]], dim=1)  # (B, T)
    total, each = sum(weights), []
    for m, w in zip(models, weights):
        if w > 0:
            src_mask = m.src_mask(src)  # (B, S)
            states = m.decode(tgt_in, m.encode(src, src_mask), src_mask).flatten(0, 1)  # (B * T, d_model)
            logits = project(states, m.embed.weight, linear).view(*tgt.shape, -1)  # (B, T, V)
            log_probs = logits.log_softmax(-1, dtype=torch.float32).gather(-1, tgt[:, :, None]).squeeze(-1)
            each.append(log_probs + math.log(w / total))
    return each[0] if len(each) == 1 else torch.stack(each).logsumexp(dim=0)


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


def read_guides(cfg: GuideFiles, count: int | None, what: str) -> dict[str, list]:
    """The target prefixes and constraints of `target_prefix=FILE` and `constraints=FILE` (phrases
    separated by tabs), by `translate_nbest`'s keywords; each file must have a line for each of `count`
    input lines (None, interactive input: no file can), which `what` names in the error otherwise."""
    guides: dict[str, list] = {}
    if cfg.target_prefix is not None:
        guides["target_prefix"] = split_input(Path(cfg.target_prefix).read_bytes())
    if cfg.constraints is not None:
        guides["constraints"] = [line.split("\t") for line in split_input(Path(cfg.constraints).read_bytes())]
    for key, given in guides.items():
        if len(given) != count:
            raise ConfigError(f"{key}={getattr(cfg, key)} has {len(given)} lines for {what}")
    return guides


def line_numbers(first: int | list[int], count: int, start: int = 0) -> list[int]:
    """The numbers in the whole input (from 0; from `start` for warnings) of `count` lines whose first is
    line `first`, or whose own numbers are the list `first` (`translate_nbest`'s argument)."""
    numbers = first if isinstance(first, list) else range(first, first + count)
    return [n + start for n in numbers]


def split_input(data: bytes, first: int = 0) -> list[str]:
    """Lines of raw input, split on b"\\n" only (so a stray U+2028 or form feed cannot add a line);
    invalid UTF-8 is replaced by U+FFFD with a warning naming the line (the first being line `first`
    from 0 of the whole input)."""
    lines = data.split(b"\n")
    if lines[-1] == b"":  # the input ended with a newline (or was empty)
        lines.pop()
    text, invalid = [], []
    for number, raw in enumerate(lines, start=first + 1):
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
