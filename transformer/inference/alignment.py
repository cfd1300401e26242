"""Hard word alignments from the encoder-decoder attention (`alignment=true`), as fairseq's
`--print-alignment` gives them: each target piece links the source piece the decoder's last layer
attends to most, its heads averaged (docs/translating.md says why), by one teacher-forced pass over the
finished translation; then merged into words. And the alignment error rate that scores them against
gold links (Och & Ney, 2003)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from transformer.inference.recording import recording
from transformer.model import Transformer
from transformer.vocab import EOS_ID, PAD_ID

Link = tuple[int, int]  # (source index, target index)
ALIGNMENT_LAYER = -1  # the decoder's last layer, as fairseq's default (docs/translating.md measures it)


@dataclass
class Alignment:
    """A translation's hard alignment, EOS excluded on both sides: (source, target) pairs of pieces, in
    target order, and of words; and how many pieces and words each side has."""

    pieces: list[Link]
    words: list[Link]
    piece_counts: tuple[int, int]  # (source, target)
    word_counts: tuple[int, int]


def cross_attention(models: list[Transformer], weights: list[float], src: Tensor, tgt_in: Tensor) -> Tensor:
    """(B, T, S) float32: the encoder-decoder attention of each model's `ALIGNMENT_LAYER`, its heads
    averaged, for sources src (B, S) and decoder inputs tgt_in (B, T) ([BOS] + y_<t); an ensemble's
    weighted by its weights."""
    total = sum(weights)
    each = [
        layer_attention(m, src, tgt_in).mean(dim=1) * (w / total) for m, w in zip(models, weights) if w > 0
    ]
    return torch.stack(each).sum(dim=0)


def layer_attention(model: Transformer, src: Tensor, tgt_in: Tensor) -> Tensor:
    """(B, H, T, S) float32: the weights of every head of the model's `ALIGNMENT_LAYER` encoder-decoder
    attention, by one decode of tgt_in (B, T) over the encoded src (B, S)."""
    layer = ALIGNMENT_LAYER % model.cfg.n_layers
    recorder, records = recording(model, lambda kind, i: kind == "cross" and i == layer)
    src_mask = model.src_mask(src)  # (B, S)
    recorder.decode(tgt_in, recorder.encode(src, src_mask), src_mask)
    return records[0].weights.float()


def hard_links(attention: Tensor, src: Tensor) -> Tensor:
    """(B, T) for attention (B, T, S) over sources src (B, S): the source position each target position
    attends to most, of the source's pieces (neither EOS nor padding)."""
    pieces = (src != EOS_ID) & (src != PAD_ID)  # (B, S)
    return attention.masked_fill(~pieces[:, None, :], float("-inf")).argmax(dim=-1)


def word_starts(pieces: list[str]) -> list[int]:
    """The word of each SentencePiece piece: a piece starting with "▁" begins one."""
    return [max(n - 1, 0) for n in accumulate(piece.startswith("▁") for piece in pieces)]


def from_links(links: list[int], source: list[str], target: list[str]) -> Alignment:
    """The alignment whose target piece j links source piece links[j], over these pieces (EOS excluded)."""
    pieces = [(i, j) for j, i in enumerate(links)]
    source_words, target_words = word_starts(source), word_starts(target)
    words = sorted({(source_words[i], target_words[j]) for i, j in pieces}, key=lambda link: link[::-1])
    counts = (len(source), len(target))
    word_counts = (source_words[-1] + 1 if source else 0, target_words[-1] + 1 if target else 0)
    return Alignment(pieces, words, counts, word_counts)


def joined(parts: list[Alignment]) -> Alignment:
    """The alignments of a line's parts as the line's: each part's indices after those of the parts
    before it, on both sides."""
    pieces: list[Link] = []
    words: list[Link] = []
    offsets = [0, 0, 0, 0]
    for part in parts:
        pieces += [(i + offsets[0], j + offsets[1]) for i, j in part.pieces]
        words += [(i + offsets[2], j + offsets[3]) for i, j in part.words]
        offsets = [a + b for a, b in zip(offsets, (*part.piece_counts, *part.word_counts))]
    return Alignment(pieces, words, (offsets[0], offsets[1]), (offsets[2], offsets[3]))


def links_text(links: list[Link]) -> str:
    """Pairs as alignment files write them: "0-0 1-2 ..."."""
    return " ".join(f"{i}-{j}" for i, j in links)


def parse_gold(line: str) -> tuple[set[Link], set[Link]]:
    """(sure, possible) links of a gold line: "i-j" sure, "ipj" possible; possible includes sure."""
    sure, possible = set(), set()
    for link in line.split():
        i, mark, j = link.partition("-") if "-" in link else link.partition("p")
        if not mark or not i.isdigit() or not j.isdigit():
            raise ValueError(f"{link!r} is not a link: 'i-j' (sure) or 'ipj' (possible)")
        (sure if mark == "-" else possible).add((int(i), int(j)))
    return sure, possible | sure


def alignment_error_rate(
    predicted: list[set[Link]],
    sure: list[set[Link]],
    possible: list[set[Link]],
) -> float:
    """AER = 1 - (|A ∩ S| + |A ∩ P|) / (|A| + |S|) over a corpus (Och & Ney, 2003): counts summed over
    its sentences, P including S."""
    hits = sum(len(a & s) + len(a & p) for a, s, p in zip(predicted, sure, possible, strict=True))
    return 1 - hits / (sum(map(len, predicted)) + sum(map(len, sure)))
