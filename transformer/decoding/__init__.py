"""Decoding (§6.1): beam search, greedy search as its beam of 1, both running the model's own
`decode` with a cache of keys and values (`DecoderCache`)."""

from transformer.decoding.cache import DecoderCache
from transformer.decoding.search import (
    BeamSearch,
    SearchResult,
    beam_search,
    best_next_tokens,
    greedy_search,
    length_penalty,
    max_output_lengths,
    search_weights,
    vocab_chunks,
)

__all__ = [
    "BeamSearch",
    "DecoderCache",
    "SearchResult",
    "beam_search",
    "best_next_tokens",
    "greedy_search",
    "length_penalty",
    "max_output_lengths",
    "search_weights",
    "vocab_chunks",
]
