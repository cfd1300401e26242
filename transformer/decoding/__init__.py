"""Decoding (§6.1): beam search, greedy search as its beam of 1, and the incremental decoder they
run (`cache.decode_step`)."""

from transformer.decoding.search import (
    SearchResult,
    beam_search,
    greedy_search,
    length_penalty,
    max_output_lengths,
    search_weights,
)

__all__ = [
    "SearchResult",
    "beam_search",
    "greedy_search",
    "length_penalty",
    "max_output_lengths",
    "search_weights",
]
