"""BLEU as the paper reports it, and as it is reported today (§6.1, Table 2, Table 3); chrF and chrF++
beside it.

- `sacre_bleu`: sacreBLEU on detokenized, cased text (13a tokenization), with its signature: the
  number to compare across papers today.
- `tokenized_bleu`: the number the paper's Table 2 is comparable to. tensor2tensor's
  `get_ende_bleu.sh` tokenizes hypothesis and reference with Moses' `tokenizer.perl -l de` (default
  options: XML escaping on, no aggressive hyphen splitting), splits compounds, "rich-text" ->
  "rich ##AT##-##AT## text" (replacing `(\\S)-(\\S)` once, left to right), and scores with
  `multi-bleu.perl`. Here sacremoses does the tokenizing and sacreBLEU with `tokenize="none"` the
  scoring: on the same whitespace tokens it computes multi-bleu's corpus BLEU (one reference).
  The reference is tokenized here as well; t2t used the pre-tokenized newstest files.
- `lowercase_bleu`: how Multi30k results are reported (Wu et al. 2021 with fairseq, on the tokenized
  release `*.lc.norm.tok.*`): the text lowercased first, every letter (Moses' lowercase.perl;
  multi-bleu.perl -lc alone would lower A-Z only), Moses-tokenized, no compound splitting. Its
  reference for test_2016_flickr has 12,103 tokens, the reference length in their BLEU log.
- `chrf`: sacreBLEU's character n-gram F-score (chrF, Popović 2015; chrF++ adds word 1- and 2-grams,
  Popović 2017) on detokenized, cased text, with its signature. No published figure to compare.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from sacrebleu.metrics import BLEU, CHRF
from sacremoses import MosesTokenizer

from transformer.config import EvaluateConfig, to_dict
from transformer.data.sources import read_split
from transformer.inference.alignment import links_text
from transformer.inference.translation import Translator, read_guides
from transformer.utils import atomic

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    """A published BLEU score to compare against."""

    model: str
    bleu: float
    test_set: str
    metric: str  # "tokenized" | "tokenized_lowercase" (the keys of `score_all`)
    source: str
    comparable: bool = True  # False: another corpus, shown for context only


PAPER_TEST = [
    Published("Transformer (base)", 27.3, "newstest2014", "tokenized", "Vaswani et al. 2017, Table 2"),
    Published("Transformer (big)", 28.4, "newstest2014", "tokenized", "Vaswani et al. 2017, Table 2"),
]

PUBLISHED: dict[tuple[str, str], list[Published]] = {
    ("wmt14_en_de", "test"): PAPER_TEST,
    # The synthetic corpus has no published figures; the paper's WMT results are shown for context.
    ("toy", "test"): [replace(figure, comparable=False) for figure in PAPER_TEST],
    ("wmt14_en_de", "valid"): [
        Published("Transformer (base)", 25.8, "newstest2013", "tokenized", "Vaswani et al. 2017, Table 3"),
        Published("Transformer (big)", 26.4, "newstest2013", "tokenized", "Vaswani et al. 2017, Table 3"),
    ],
    ("multi30k", "test"): [
        Published(
            "Transformer-tiny (4+4 layers, d=128, beam 5)",
            41.02,
            "test_2016_flickr",
            "tokenized_lowercase",
            "Wu et al. 2021 (ACL), 'Good for Misconceived Reasons'",
        ),
    ],
}

_COMPOUND = re.compile(rb"(\S)-(\S)")


def split_compounds(line: str) -> str:
    """t2t's `perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'`: "a-b" -> "a ##AT##-##AT## b". On UTF-8
    bytes, as perl runs it: in "vis-à-vis" the last byte of "à" starts a second match, which a
    character-wise match (taking the whole "à" in the first) would miss."""
    return _COMPOUND.sub(rb"\1 ##AT##-##AT## \2", line.encode("utf-8")).decode("utf-8")


def moses_tokenize(lines: list[str], lang: str) -> list[str]:
    """tokenizer.perl -l lang with its default options (XML escaping on)."""
    tokenizer = MosesTokenizer(lang=lang)
    return [tokenizer.tokenize(line, escape=True, return_str=True) for line in lines]


@dataclass
class Bleu:
    score: float
    precisions: list[float]  # 1- to 4-gram precisions, percent
    brevity_penalty: float
    hyp_len: int
    ref_len: int
    signature: str


@dataclass
class Chrf:
    score: float
    char_order: int
    word_order: int  # 0: chrF; 2: chrF++
    beta: int  # recall weighs beta times as much as precision
    signature: str


def _same_length(hypotheses: list[str], references: list[str]) -> None:
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} references")


def _bleu(hypotheses: list[str], references: list[str], **options: object) -> Bleu:
    _same_length(hypotheses, references)
    metric = BLEU(force=True, **options)  # force: pre-tokenized input is intended here
    result = metric.corpus_score(hypotheses, [references])
    return Bleu(
        result.score,
        list(result.precisions),
        result.bp,
        result.sys_len,
        result.ref_len,
        str(metric.get_signature()),
    )


def sacre_bleu(hypotheses: list[str], references: list[str]) -> Bleu:
    """sacreBLEU, detokenized and cased (tok:13a)."""
    return _bleu(hypotheses, references)


def tokenized_bleu(hypotheses: list[str], references: list[str], lang: str = "de") -> Bleu:
    """The paper-comparable BLEU of tensor2tensor's get_ende_bleu.sh (see the module docstring)."""
    split = [
        [split_compounds(line) for line in moses_tokenize(side, lang)] for side in (hypotheses, references)
    ]
    return _multi_bleu(*split)


def lowercase_bleu(hypotheses: list[str], references: list[str], lang: str = "de") -> Bleu:
    """Multi30k's lowercased tokenized BLEU, as Wu et al. report it (see the module docstring)."""
    lowered = [moses_tokenize([line.lower() for line in side], lang) for side in (hypotheses, references)]
    return _multi_bleu(*lowered, lowercase=True)  # lowered already; the signature says case:lc


def _multi_bleu(hypotheses: list[str], references: list[str], **options: object) -> Bleu:
    """multi-bleu.perl's corpus BLEU on whitespace tokens: 0 when an n-gram order has no match."""
    return _bleu(hypotheses, references, tokenize="none", smooth_method="none", **options)


def chrf(hypotheses: list[str], references: list[str], word_order: int = 0) -> Chrf:
    """sacreBLEU's chrF (word_order 0) or chrF++ (word_order 2), detokenized and cased."""
    _same_length(hypotheses, references)
    metric = CHRF(word_order=word_order)
    result = metric.corpus_score(hypotheses, [references])
    return Chrf(result.score, result.char_order, result.word_order, result.beta, str(metric.get_signature()))


def score_all(
    hypotheses: list[str], references: list[str], lang: str, lowercase: bool
) -> dict[str, Bleu | Chrf]:
    """Every BLEU variant: sacrebleu, tokenized, and (when asked) tokenized_lowercase; then chrf and
    chrf++."""
    scores: dict[str, Bleu | Chrf] = {
        "sacrebleu": sacre_bleu(hypotheses, references),
        "tokenized": tokenized_bleu(hypotheses, references, lang),
    }
    if lowercase:
        scores["tokenized_lowercase"] = lowercase_bleu(hypotheses, references, lang)
    scores["chrf"] = chrf(hypotheses, references)
    scores["chrf++"] = chrf(hypotheses, references, word_order=2)
    return scores


def published(data_name: str, role: str) -> list[Published]:
    return PUBLISHED.get((data_name, role), [])


def paper_table(
    scores: dict[str, Bleu | Chrf], data_name: str, role: str, label: str = "this checkpoint"
) -> str:
    """A text table: this checkpoint's BLEU variants, each published figure beside ours, then its chrF
    and chrF++ (published figures are BLEU only)."""
    bleus = {name: score for name, score in scores.items() if isinstance(score, Bleu)}
    rows = [(f"{label}: {name}", bleu.score, bleu.signature) for name, bleu in bleus.items()]
    for figure in published(data_name, role):
        ours = bleus.get(figure.metric)
        if not figure.comparable:
            delta = "another corpus: for context only"
        else:
            delta = f"{ours.score - figure.bleu:+.2f} for this checkpoint" if ours else "not scored here"
        note = f"{figure.source}; {figure.metric}; {delta}"
        rows.append((f"{figure.model}, {figure.test_set}", figure.bleu, note))
    chrfs = [(f"{label}: {name}", s.score, s.signature) for name, s in scores.items() if isinstance(s, Chrf)]
    width = max(len(name) for name, _, _ in rows + chrfs)
    lines = [f"{'':{width}}   BLEU  metric", *_table_rows(rows, width)]
    if chrfs:
        lines += [f"{'':{width}}   chrF  metric", *_table_rows(chrfs, width)]
    return "\n".join(lines)


def _table_rows(rows: list[tuple[str, float, str]], width: int) -> list[str]:
    return [f"{name:{width}}  {score:5.2f}  {note}" for name, score, note in rows]


def report(scores: dict[str, Bleu | Chrf], data_name: str, role: str) -> dict[str, object]:
    """The JSON-ready form of the scores and the published figures."""
    return {
        "scores": {name: asdict(score) for name, score in scores.items()},
        "published": [asdict(figure) for figure in published(data_name, role)],
    }


def wants_lowercase(data_name: str, role: str) -> bool:
    """Score lowercased too where the published figures for this corpus are lowercased."""
    return any(figure.metric == "tokenized_lowercase" for figure in published(data_name, role))


def _search_name(cfg: EvaluateConfig, models: int, bf16: bool) -> str:
    """The search's own name (`SearchConfig.describe`: `beam4.alpha0.6`, `greedy`, `sample.seed<s>`,
    ...), then `.bf16` (the weights in bf16, as auto on CUDA) or `.int8`; `.prefix-`, `.constraints-`
    and `.vmap-<file stem>-<the first 8 hex digits of its SHA-1>` with target prefixes, constraints and a
    vocabulary map; `.ensemble<n>` for n checkpoints
    (`.w<w1>-<w2>...` with weights): another search never overwrites a result."""
    search = cfg.search.describe()
    if cfg.precision == "int8" or bf16:
        search += ".int8" if cfg.precision == "int8" else ".bf16"
    for key, given in (
        ("prefix", cfg.target_prefix),
        ("constraints", cfg.constraints),
        ("vmap", cfg.vocabulary_map),
    ):
        if given is not None:
            path = Path(given)
            search += f".{key}-{path.stem}-{hashlib.sha1(path.read_bytes()).hexdigest()[:8]}"
    if models > 1:
        search += f".ensemble{models}" + (
            ".w" + "-".join(f"{w:g}" for w in cfg.weights) if cfg.weights else ""
        )
    return search


def evaluate_checkpoint(cfg: EvaluateConfig, translator: Translator | None = None) -> dict[str, Any]:
    """Translate the raw source side of split `cfg.split`, score it, and write beside the (first)
    checkpoint `<checkpoint>.<data>.<split>.<search>.bleu.json` and the hypotheses (`_search_name`);
    returns that JSON plus its "path" and "table".
    `translator`: the checkpoint already loaded with cfg's decoding settings (else it is loaded here)."""
    if translator is None:  # a bad checkpoint fails before any reading or decoding
        translator = Translator.from_checkpoint(cfg)
    checkpoints = [cfg.checkpoint] if isinstance(cfg.checkpoint, str) else cfg.checkpoint
    data = cfg.data
    split = read_split(data, cfg.split)
    meta = translator.info.get("data_meta") or {}
    trained = (meta.get("src_lang"), meta.get("tgt_lang"))
    if trained not in ((None, None), (data.src_lang, data.tgt_lang)):
        log.warning(
            "the checkpoint translates %s->%s but data %s is %s->%s",
            *trained,
            data.name,
            data.src_lang,
            data.tgt_lang,
        )
    guides = read_guides(cfg, len(split.src), f"{len(split.src)} of the split")
    best = [h[0] if h else None for h in translator.translate_nbest(split.src, progress=True, **guides)]
    hypotheses = [h.text if h else "" for h in best]
    lowercase = cfg.lowercase if cfg.lowercase is not None else wants_lowercase(data.name, cfg.split)
    scores = score_all(hypotheses, split.tgt, data.tgt_lang, lowercase)
    bf16 = next(translator.model.parameters()).dtype == torch.bfloat16
    stem = f"{checkpoints[0]}.{data.name}.{cfg.split}.{_search_name(cfg, len(checkpoints), bf16)}"
    result: dict[str, Any] = {
        "checkpoint": cfg.checkpoint,
        "step": translator.info.get("step"),
        "data": data.name,
        "split": cfg.split,
        "split_name": split.name,
        "sentences": len(hypotheses),
        **report(scores, data.name, cfg.split),
        "hypotheses": f"{stem}.hyp.{data.tgt_lang}",
        "settings": {k: v for k, v in to_dict(cfg).items() if k != "data"},
    }
    atomic.write_bytes(Path(result["hypotheses"]), "".join(h + "\n" for h in hypotheses).encode("utf-8"))
    if cfg.alignment:  # the word alignment of each line's translation, "source-target" pairs from 0
        result["alignments"] = f"{stem}.align"
        links = [links_text(h.alignment.words) if h and h.alignment else "" for h in best]
        atomic.write_bytes(Path(result["alignments"]), "".join(line + "\n" for line in links).encode("utf-8"))
    path = f"{stem}.bleu.json"
    atomic.write_bytes(Path(path), (json.dumps(result, indent=2) + "\n").encode("utf-8"))
    of = " + ".join(checkpoints)
    title = f"BLEU and chrF of {of} on {data.name} {cfg.split} ({split.name}, {len(hypotheses)} sentences)"
    written = " and ".join([path, result["hypotheses"], *([result["alignments"]] if cfg.alignment else [])])
    table = f"{title}\n{paper_table(scores, data.name, cfg.split)}\nwrote {written}"
    return {**result, "path": path, "table": table}
