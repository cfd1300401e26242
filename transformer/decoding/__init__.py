"""Decoding (§6.1): beam search, greedy search as its beam of 1, n-best lists, sampling and ensembles
as policies of the same loop, all running the model's own `decode` with a cache of keys and values
(`DecoderCache`)."""

from transformer.decoding.cache import DecoderCache
from transformer.decoding.scoring import (
    Ensemble,
    Shortlist,
    best_next_tokens,
    projection_chunks,
    vocab_chunks,
)
from transformer.decoding.search import (
    BeamSearch,
    Hypothesis,
    SearchResult,
    beam_search,
    length_penalty,
    max_output_lengths,
    search_weights,
)

__all__ = [
    "BeamSearch",
    "DecoderCache",
    "Ensemble",
    "Hypothesis",
    "SearchResult",
    "Shortlist",
    "beam_search",
    "best_next_tokens",
    "length_penalty",
    "max_output_lengths",
    "projection_chunks",
    "search_weights",
    "vocab_chunks",
]
