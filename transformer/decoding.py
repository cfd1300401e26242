"""Greedy and beam search over a trained Transformer (§6.1).

The paper decodes with "beam search with a beam size of 4 and length penalty alpha = 0.6" and sets
"the maximum output length during inference to input length + 50, but terminate[s] early when
possible". The details it leaves open follow tensor2tensor, the paper's own code, except where marked
(two rules are fairseq's and Hugging Face's):

- Length penalty (GNMT, Wu et al. 2016, Eq. 14): hypotheses are ranked by log P(Y|X) / lp(Y) with
  lp(Y) = ((5 + |Y|) / 6)^alpha. |Y| counts every generated token *including* the final EOS, as
  tensor2tensor does (its penalty at step i uses i + 1): "a b EOS" has |Y| = 3.
- Maximum output length: L = max_len_a * |X| + max_len_b, |X| the source tokens including its EOS
  (the paper: a = 1, b = 50), capped at the model's positions. A hypothesis still open after L steps
  is finished as it stands, without EOS, with |Y| = L, and competes with the others (as Hugging Face's
  beam search does; tensor2tensor returns a live one only when nothing finished).
- Candidates: each step ranks the k x V extensions of the k live hypotheses (in practice only each
  hypothesis' 2k best tokens, the only ones that can reach the sentence's 2k best). One ending in EOS
  is finished when it ranks among the k best (as fairseq; tensor2tensor takes any of the 2k), so a beam
  of 1 with alpha = 0 is greedy search; the k best extensions not ending in EOS stay live.
- Early stop: a sentence is done once its best finished score beats every score a live hypothesis
  could still reach. Log-probabilities only fall as a hypothesis grows, and lp grows with length, so
  a live raw score s <= 0 can reach at most s / lp(L) (tensor2tensor's bound); with alpha = 0 that is s.
  Done sentences leave the batch, so the remaining ones decode faster.

Each step feeds one token per hypothesis through `Transformer.decode_step` with the explicit
`DecoderCache`; beams are reordered with `cache.select(rows, None)`: the encoder-decoder keys and
values keep one row per sentence, shared by its beams, and are only cut when sentences finish.
On a CPU the output projection is made a vocabulary chunk at a time (`_best_next`) and the
decoder's weights are packed for oneDNN once per search (`linear.prepacked`).
Scores are accumulated in float32, so the model may run in bfloat16.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.linear import prepacked
from transformer.model import Transformer

NEG_INF = float("-inf")
VOCAB_CHUNK = 8192  # vocabulary entries projected at once on a CPU while choosing the next tokens


@dataclass
class SearchResult:
    """One hypothesis per source sentence, in the order of the batch."""

    tokens: list[list[int]]  # piece ids, without BOS and EOS
    scores: Tensor  # (B,) float32: log P(Y|X) / lp(Y) for beam search, log P(Y|X) for greedy


def length_penalty(length: Tensor | int, alpha: float) -> Tensor | float:
    """GNMT length penalty lp(Y) = ((5 + |Y|) / 6)^alpha (§6.1; Wu et al. 2016, Eq. 14)."""
    return ((5.0 + length) / 6.0) ** alpha


def source_mask(model: Transformer, src: Tensor) -> Tensor:
    """(B, S) bool, True = a real source token; refuses a row of padding only, which would have nothing
    to attend to (its states would be NaN)."""
    src_mask = model.src_mask(src)
    if not bool(src_mask.any(dim=1).all()):
        raise ValueError("a source row is all padding: every source sentence ends in EOS (pieces + [EOS])")
    return src_mask


def max_output_lengths(src_mask: Tensor, max_len_a: float, max_len_b: int, max_positions: int) -> Tensor:
    """(B,) L = a * |X| + b output tokens (§6.1: input length + 50), at most the model's positions."""
    lengths = (max_len_a * src_mask.sum(dim=1).float() + max_len_b).long()
    return lengths.clamp(min=1, max=max_positions)


def _vocab_chunks(vocab: int) -> list[tuple[int, int]]:
    """[start, end) of about VOCAB_CHUNK entries each, equal in size."""
    size = -(-vocab // -(-vocab // VOCAB_CHUNK))
    return [(start, min(start + size, vocab)) for start in range(0, vocab, size)]


def search_weights(model: Transformer) -> list[Tensor]:
    """The weights a search multiplies by at every step: the decoder's linear maps and the output
    projection's chunks (the encoder runs once per batch)."""
    vocab = model.embed.weight
    linears = [m.weight for m in model.decoder.modules() if isinstance(m, nn.Linear)]
    return linears + [vocab[start:end] for start, end in _vocab_chunks(vocab.size(0))]


def _with_packed_weights(search: Callable[..., SearchResult]) -> Callable[..., SearchResult]:
    """Run the search with its weights packed once for oneDNN (`linear.prepacked`)."""

    @functools.wraps(search)
    def run(model: Transformer, *args: Any, **kwargs: Any) -> SearchResult:
        with prepacked(search_weights(model)):
            return search(model, *args, **kwargs)

    return run


def _best_next(model: Transformer, states: Tensor, step: int, min_len: int, n: int) -> tuple[Tensor, Tensor]:
    """The n most probable next tokens after each final decoder state of states (N, d_model), and their
    float32 log P(y_step | y_<step, X). PAD and BOS are never generated; EOS is held back while
    step <= min_len (only benchmarks that force an output length set min_len).

    On a CPU the vocabulary is projected a chunk at a time, each chunk's logits used while still in
    cache (its n best and its log-sum-exp): no (N, V) tensor is made at each step.
    """
    vocab = model.embed.weight.size(0)
    # On a GPU the whole vocabulary at once: memory is plenty, and every chunk costs kernel launches.
    chunks = _vocab_chunks(vocab) if states.device.type == "cpu" else [(0, vocab)]
    lses, values, indices = [], [], []
    for start, end in chunks:
        logits = model.project(states, start, end)  # (N, c)
        log_probs = logits.log_softmax(dim=-1, dtype=torch.float32)  # (N, c), normalized within the chunk
        if start == 0:
            log_probs[:, [PAD_ID, BOS_ID, EOS_ID] if step <= min_len else [PAD_ID, BOS_ID]] = NEG_INF
        top, index = log_probs.topk(min(n, end - start), dim=-1)  # (N, n), best first
        if len(chunks) == 1:
            return top, index
        # the chunk's log-sum-exp, from its best entry (finite even where PAD and BOS are among the n)
        lse = logits.gather(1, index[:, :1]).float() - top[:, :1]  # (N, 1)
        lses.append(lse)
        values.append(top + lse)  # (N, n) their logits, in float32
        indices.append(index + start)
    lse = torch.cat(lses, dim=1).logsumexp(dim=1, keepdim=True)  # (N, 1) over the whole vocabulary
    candidates = torch.cat(values, dim=1)  # (N, chunks * n)
    best, pick = candidates.topk(min(n, candidates.size(1)), dim=-1)  # (N, n), best first
    return best - lse, torch.cat(indices, dim=1).gather(1, pick)


class _Results:
    """The finished hypothesis of every sentence of the original batch, filled as sentences finish."""

    def __init__(self, batch_size: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch_size)]
        self.scores = torch.full((batch_size,), NEG_INF)

    def store(self, ids: Tensor, tokens: Tensor, lengths: Tensor, scores: Tensor) -> None:
        """ids (n,) positions in the original batch; tokens (n, T) with the first `lengths` valid."""
        for i, row, n, score in zip(ids.tolist(), tokens.tolist(), lengths.tolist(), scores.tolist()):
            self.tokens[i] = row[:n]
            self.scores[i] = score

    def result(self) -> SearchResult:
        return SearchResult(self.tokens, self.scores)


@torch.inference_mode()
@_with_packed_weights
def greedy_search(
    model: Transformer, src: Tensor, max_len_a: float = 1.0, max_len_b: int = 50, min_len: int = 0
) -> SearchResult:
    """The most probable next token at every step; src (B, S) = pieces + [EOS], padded with PAD_ID.

    Scores are raw log-probabilities. Finished sentences leave the batch.
    """
    src_mask = source_mask(model, src)  # (B, S)
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    max_len = max_output_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_positions)
    n = src.size(0)
    ids = torch.arange(n, device=src.device)  # original batch position of each row
    tokens = src.new_full((n, 1), BOS_ID)  # (N, t + 1): BOS and the tokens so far
    scores = torch.zeros(n, device=src.device)
    results, cache = _Results(n), None
    limit = int(max_len.max())  # the longest output: the caches' room, read once
    for step in range(1, limit + 1):
        # after the first step the cache holds every layer's cross-attention keys and values
        states, cache = model.decode_step(
            tokens[:, -1:], memory if cache is None else None, src_mask, cache, max_length=limit
        )
        best, token = _best_next(model, states[:, -1], step, min_len, 1)  # (N, 1)
        token = token[:, 0]
        scores = scores + best[:, 0]
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        ended = token == EOS_ID
        done = ended | (max_len == step)
        if done.any():
            lengths = torch.full_like(ids, step) - ended.long()  # EOS is not part of the output
            results.store(ids[done], tokens[done, 1:], lengths[done], scores[done])
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            ids, tokens, scores, max_len = ids[keep], tokens[keep], scores[keep], max_len[keep]
            src_mask, cache = src_mask[keep], cache.select(keep, keep)
    return results.result()


@dataclass
class _Beams:
    """The live state of N sentences x k beams; rows of N * k are sentence-major."""

    ids: Tensor  # (N,) original batch position of each sentence
    max_len: Tensor  # (N,) maximum output length L
    lp_max: Tensor  # (N,) float32 lp(L): the early-stop bound's divisor
    src_mask: Tensor  # (N, S)
    tokens: Tensor  # (N * k, t) tokens generated so far
    scores: Tensor  # (N, k) float32 log P of each live hypothesis
    best: Tensor  # (N,) float32 normalized score of the best finished hypothesis
    best_tokens: Tensor  # (N, max L) its tokens
    best_len: Tensor  # (N,) its length, EOS excluded

    def keep(self, sentences: Tensor, k: int) -> tuple[_Beams, Tensor]:
        """Only `sentences` (n,) stay; also returns their rows (n * k,) for the decoder cache."""
        rows = (sentences[:, None] * k + torch.arange(k, device=sentences.device)).view(-1)  # (n * k,)
        per_row = ("tokens",)
        kept = {f.name: getattr(self, f.name)[rows if f.name in per_row else sentences] for f in fields(self)}
        return _Beams(**kept), rows


@torch.inference_mode()
@_with_packed_weights
def beam_search(
    model: Transformer,
    src: Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    min_len: int = 0,
) -> SearchResult:
    """Beam search with the GNMT length penalty (§6.1), batched over the sentences of src (B, S).

    src rows are pieces + [EOS], padded with PAD_ID. See the module docstring for the exact rules.
    """
    k, b = beam_size, src.size(0)
    src_mask = source_mask(model, src)  # (B, S)
    memory = model.encode(src, src_mask)  # (B, S, d_model)
    max_len = max_output_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_positions)
    # Step 1 sees the same prefix [BOS] in every beam: run it once per sentence; its reorder then
    # copies each sentence's self-attention cache row into its k beams.
    limit = int(max_len.max())  # the longest output: the caches' room, read once
    soonest = int(max_len.min())  # the first step at which a sentence reaches its L (read again on exits)
    bos = src.new_full((b, 1), BOS_ID)
    states, cache = model.decode_step(bos, memory, src_mask, max_length=limit)
    beams = _Beams(
        ids=torch.arange(b, device=src.device),
        max_len=max_len,
        lp_max=length_penalty(max_len, alpha),
        src_mask=src_mask,  # (B, S): the beams of a sentence share its cross-attention K/V
        tokens=src.new_zeros(b, 0),
        scores=torch.zeros(b, 1, device=src.device),  # one live hypothesis per sentence: [BOS]
        best=torch.full((b,), NEG_INF, device=src.device),
        best_tokens=src.new_zeros(b, limit),
        best_len=src.new_zeros(b),
    )
    results = _Results(b)
    # Only a row's 2k best tokens can be among the 2k best candidates of its sentence.
    top = _best_next(model, states[:, -1], 1, min_len, 2 * k)  # (B, 2k) twice
    for step in range(1, limit + 1):
        at_limit = step >= soonest  # only then may a sentence be at its L (fewer calls before)
        beams, reorder = _advance(beams, *top, step, k, alpha, at_limit)
        # Done: at the length limit, or no live hypothesis can still beat the best finished one.
        done = beams.best >= beams.scores.max(dim=1).values / beams.lp_max  # (N,)
        if at_limit:
            done |= beams.max_len == step
        shrink = bool(done.any())
        if shrink:
            results.store(beams.ids[done], beams.best_tokens[done], beams.best_len[done], beams.best[done])
            if bool(done.all()):
                break
            sentences = (~done).nonzero().squeeze(1)
            beams, kept = beams.keep(sentences, k)
            reorder = reorder[kept]  # (n * k,) the cache rows the kept hypotheses extend
            soonest = int(beams.max_len.min())
        cache = cache.select(reorder, sentences if shrink else None)
        # memory=None: every layer's cross-attention keys and values are already in the cache
        states, cache = model.decode_step(beams.tokens[:, -1:], None, beams.src_mask, cache)
        top = _best_next(model, states[:, -1], step + 1, min_len, 2 * k)  # (N * k, 2k) twice
    return results.result()


def rank_extensions(
    scores: Tensor, log_probs: Tensor, next_tokens: Tensor, k: int, penalty: float | Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One step's choice among the extensions of N sentences' live hypotheses, k_in per sentence.

    scores (N, k_in) float32 log P of the live hypotheses; log_probs, next_tokens (N * k_in, m): the m
    best next tokens of each; penalty: lp(step). Of each sentence's 2k best extensions, the k best not
    ending in EOS live on, and an EOS among the k best finishes its hypothesis. Returns the new live
    scores (N, k), the old row each new row extends (N * k,), its new token (N * k, 1), and per
    sentence the best EOS ending's normalized score (N,) (-inf if none) and the row it ends (N,).
    No value is read on the host (the static-shape search records this in a CUDA graph).
    """
    n, k_in = scores.shape
    m = log_probs.size(-1)
    candidates = (scores[:, :, None] + log_probs.view(n, k_in, m)).view(n, k_in * m)
    if candidates.size(1) < 2 * k:  # fewer candidates than asked for: pad with impossible ones
        candidates = F.pad(candidates, (0, 2 * k - candidates.size(1)), value=NEG_INF)
    top_scores, top_index = candidates.topk(2 * k, dim=1)  # (N, 2k), best first
    top_index = top_index.clamp(max=k_in * m - 1)  # padding -> any real candidate (its score stays -inf)
    top_row = torch.arange(n, device=top_index.device)[:, None] * k_in + top_index // m  # (N, 2k) old row
    top_token = next_tokens.view(n, k_in * m).gather(1, top_index)  # (N, 2k)
    is_eos = top_token == EOS_ID
    # k new live hypotheses: the best candidates that do not end in EOS (at most k_in <= k of 2k do).
    live_scores, pick = top_scores.masked_fill(is_eos, NEG_INF).topk(k, dim=1)  # (N, k)
    reorder = top_row.gather(1, pick).view(-1)  # (N * k,)
    new_token = top_token.gather(1, pick).view(-1, 1)  # (N * k, 1)
    eos_best, eos_pick = (torch.where(is_eos[:, :k], top_scores[:, :k], NEG_INF) / penalty).max(dim=1)  # (N,)
    eos_row = top_row[:, :k].gather(1, eos_pick[:, None]).squeeze(1)  # (N,)
    return live_scores, reorder, new_token, eos_best, eos_row


def _advance(
    beams: _Beams, log_probs: Tensor, next_tokens: Tensor, step: int, k: int, alpha: float, at_limit: bool
) -> tuple[_Beams, Tensor]:
    """Extend every live hypothesis by one token (step `step`), finish those ending in EOS (or at L;
    only looked for when `at_limit`: some sentence may have L = step).

    log_probs, next_tokens: (N * k_in, m), the m best next tokens of each live hypothesis, k_in of
    them per sentence (1 at step 1, k after). Returns the new beams and, for each new row, the old
    row it extends (to reorder the decoder cache).
    """
    n = beams.scores.size(0)
    penalty = length_penalty(step, alpha)
    live_scores, reorder, new_token, eos_best, eos_row = rank_extensions(
        beams.scores, log_probs, next_tokens, k, penalty
    )
    tokens = torch.cat([beams.tokens[reorder], new_token], dim=1)  # (N * k, step)
    beams = _finish(beams, eos_best, beams.tokens[eos_row], step - 1)  # EOS itself is not output
    if at_limit:  # every live hypothesis at the limit L finishes
        cut = torch.where(beams.max_len[:, None] == step, live_scores / penalty, NEG_INF)  # (N, k)
        cut_best, cut_pick = cut.max(dim=1)  # (N,)
        beams = _finish(beams, cut_best, tokens.view(n, k, step)[torch.arange(n), cut_pick], step)
    return replace(beams, tokens=tokens, scores=live_scores), reorder


def _finish(beams: _Beams, scores: Tensor, tokens: Tensor, length: int) -> _Beams:
    """Make (scores (N,), tokens (N, >= length)) the best finished hypotheses where they beat the old.
    The beams are consumed: their best_tokens are written in place."""
    better = scores > beams.best  # (N,)
    prefix = beams.best_tokens[:, :length]  # (N, length)
    prefix.copy_(torch.where(better[:, None], tokens[:, :length], prefix))
    return replace(
        beams,
        best=torch.where(better, scores, beams.best),
        best_len=torch.where(better, length, beams.best_len),
    )
