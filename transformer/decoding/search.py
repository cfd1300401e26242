"""Beam search over a trained Transformer (§6.1); greedy search is its beam of 1.

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

One loop, two ways to run it (`static`): by default done sentences leave the batch, so the others
decode faster; with `static=True` every step has the same shapes and memory and reads nothing on the
host (done sentences stay, their results frozen), so that on CUDA its steps are recorded as two CUDA
graphs and replayed in turn (`translate.py cuda_graphs=true`), the host reading one "all done?" flag
per step. Scores are accumulated in float32, so the model may run in bfloat16. The decoder is the
model's own `decode`, run on the newest tokens with a `DecoderCache` (decoding/cache.py).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.decoding.cache import DecoderCache
from transformer.model import Transformer
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

NEG_INF = float("-inf")
Linear = Callable[[Tensor, Tensor], Tensor]  # x (R, d), W (V', d) -> x W^T: F.linear, or kernels.Products
VOCAB_CHUNK = 8192  # vocabulary entries projected at once on a CPU while choosing the next tokens


@dataclass
class SearchResult:
    """One hypothesis per source sentence, in the order of the batch."""

    tokens: list[list[int]]  # piece ids, without BOS and EOS
    scores: Tensor  # (B,) float32: log P(Y|X) / lp(Y) (a beam of 1 without penalty: log P(Y|X))


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


def vocab_chunks(vocab: int, device: torch.device) -> list[tuple[int, int]]:
    """[start, end) of about VOCAB_CHUNK entries each on a CPU (each chunk's logits used while they are
    still in cache), the whole vocabulary elsewhere."""
    if device.type != "cpu":
        return [(0, vocab)]
    size = -(-vocab // -(-vocab // VOCAB_CHUNK))
    return [(start, min(start + size, vocab)) for start in range(0, vocab, size)]


def search_weights(model: Transformer, int8: bool = False) -> list[Tensor | tuple[Tensor, Tensor | None]]:
    """The weights `kernels.prepacked` packs once for a search: the decoder's linear maps (multiplied
    by at every step) and the output projection's chunks; with `int8`, every linear map's (the
    encoder's too) as (weight, bias), for the 8-bit products."""
    vocab = model.embed.weight
    chunks = [vocab[start:end] for start, end in vocab_chunks(vocab.size(0), vocab.device)]
    if int8:
        return [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)] + chunks
    return [m.weight for m in model.decoder.modules() if isinstance(m, torch.nn.Linear)] + chunks


@dataclass
class _Beams:
    """N sentences x k beams; rows of N x k are sentence-major, L is the longest output limit."""

    ids: Tensor  # (N,) each sentence's position in the batch
    max_len: Tensor  # (N,) its output limit L_n
    lp_max: Tensor  # (N,) float32 lp(L_n): the early-stop bound's divisor
    last: Tensor  # (N * k, 1) the last token of each live hypothesis
    tokens: Tensor  # (N * k, L) the live hypotheses' tokens (the first step - 1 are valid)
    scores: Tensor  # (N, k) float32 log P of each live hypothesis
    best: Tensor  # (N,) float32 normalized score of the best finished hypothesis
    best_tokens: Tensor  # (N, L) its tokens, the first best_len valid
    best_len: Tensor  # (N,) its length, EOS excluded
    done: Tensor  # (N,) bool: the sentence's result is final
    reorder: Tensor  # (N * k,) the row each row of the last step extends (the cache's reorder)

    @classmethod
    def start(cls, src: Tensor, max_len: Tensor, k: int, alpha: float, limit: int) -> _Beams:
        """One live hypothesis per sentence, [BOS]; the other k - 1 beams impossible until step 1."""
        b, device = src.size(0), src.device
        scores = torch.full((b, k), NEG_INF, device=device)
        scores[:, 0] = 0.0
        return cls(
            ids=torch.arange(b, device=device),
            max_len=max_len,
            lp_max=length_penalty(max_len, alpha),
            last=src.new_full((b * k, 1), BOS_ID),
            tokens=src.new_zeros(b * k, limit),
            scores=scores,
            best=torch.full((b,), NEG_INF, device=device),
            best_tokens=src.new_zeros(b, limit),
            best_len=src.new_zeros(b),
            done=torch.zeros(b, dtype=torch.bool, device=device),
            reorder=torch.arange(b * k, device=device),
        )

    def extend(self, reorder: Tensor, new_token: Tensor, step: Tensor) -> None:
        """Row i becomes row reorder[i] (N * k,) extended by new_token[i] (N * k, 1) at `step`, in place."""
        tokens = self.tokens.index_select(0, reorder)  # (N * k, L)
        tokens.index_copy_(1, (step - 1).view(1), new_token)
        self.tokens.copy_(tokens)
        self.last.copy_(new_token)
        self.reorder.copy_(reorder)

    def finish(self, scores: Tensor, tokens: Tensor, length: Tensor) -> None:
        """Make (scores (N,), tokens (N, L) of `length` ()) the best finished hypotheses where they beat
        the old ones, except in sentences already done."""
        better = (scores > self.best) & ~self.done  # (N,)
        self.best_tokens.copy_(torch.where(better[:, None], tokens, self.best_tokens))
        self.best_len.copy_(torch.where(better, length, self.best_len))
        self.best.copy_(torch.where(better, scores, self.best))

    def keep(self, sentences: Tensor, k: int) -> _Beams:
        """Only `sentences` (n,) stay, with their rows (n * k,)."""
        rows = (sentences[:, None] * k + torch.arange(k, device=sentences.device)).view(-1)  # (n * k,)
        per_row = ("last", "tokens", "reorder")
        kept = {f.name: getattr(self, f.name)[rows if f.name in per_row else sentences] for f in fields(self)}
        return _Beams(**kept)


class BeamSearch:
    """The search of one batch, step by step: `step()` extends every live hypothesis by one token; in
    the dynamic layout `leave()` then lets done sentences leave the batch. `beam_search` runs it."""

    def __init__(
        self,
        model: Transformer,
        src: Tensor,
        beam_size: int,
        alpha: float,
        max_len: tuple[float, int],
        min_len: int,
        static: bool,
        linear: Linear,
    ) -> None:
        """src (B, S): rows of pieces + [EOS], padded with PAD_ID; max_len (a, b): L = a |X| + b."""
        self.model, self.k, self.alpha, self.min_len, self.static = model, beam_size, alpha, min_len, static
        self.linear = linear
        b = src.size(0)
        src_mask = source_mask(model, src)  # (B, S)
        memory = model.encode(src, src_mask)  # (B, S, d_model)
        limits = max_output_lengths(src_mask, *max_len, model.cfg.max_positions)  # (B,)
        limit = int(limits.max())
        self.cache = DecoderCache(model, memory, src_mask, b * beam_size, limit, static)
        self.beams = _Beams.start(src, limits, beam_size, alpha, limit)
        self.results = _Results(b)

    def step(self) -> None:
        """Extend every live hypothesis by one token, in place; finish those ending in EOS and those at
        their limit; mark the sentences that are done. Reads nothing on the host."""
        beams, cache, k = self.beams, self.cache, self.k
        step = cache.position + 1  # () long: the output position chosen now, 1-based
        states = self.model.decode(beams.last, cache=cache)[:, -1]  # (N * k, d_model)
        log_probs, next_tokens = best_next_tokens(  # (N * k, 2k) twice
            states, self.model.embed.weight, step, self.min_len, 2 * k, self.linear
        )
        penalty = length_penalty(step.double(), self.alpha).float()  # () float32
        live_scores, reorder, new_token, eos_best, eos_row = rank_extensions(
            beams.scores, log_probs, next_tokens, k, penalty
        )
        beams.finish(eos_best, beams.tokens[eos_row], step - 1)  # EOS itself is not output
        beams.extend(reorder, new_token, step)
        n = beams.scores.size(0)
        cut = torch.where(beams.max_len[:, None] == step, live_scores / penalty, NEG_INF)  # (N, k): at L_n
        cut_best, cut_pick = cut.max(dim=1)  # (N,)
        beams.finish(cut_best, beams.tokens[torch.arange(n, device=cut.device) * k + cut_pick], step)
        # Done: at the length limit, or no live hypothesis can still beat the best finished one.
        beams.done |= (beams.best >= live_scores.max(dim=1).values / beams.lp_max) | (beams.max_len == step)
        beams.scores.copy_(live_scores)
        if self.static and k > 1:  # a beam of 1 extends its own row
            cache.reorder(reorder)

    def done(self) -> bool:
        """Whether every sentence is done (a read from the device)."""
        return bool(self.beams.done.all())

    def leave(self) -> bool:
        """The dynamic layout after a step: done sentences leave the batch (their results stored) and
        the cache follows the hypotheses; False once every sentence is done."""
        beams, k = self.beams, self.k
        if bool(beams.done.any()):
            done = beams.done
            self.results.store(
                beams.ids[done], beams.best_tokens[done], beams.best_len[done], beams.best[done]
            )
            if bool(beams.done.all()):
                self.beams = None
                return False
            sentences = (~done).nonzero().squeeze(1)
            self.beams = beams.keep(sentences, k)
            self.cache.reorder(self.beams.reorder, sentences)
        elif k > 1:
            self.cache.reorder(beams.reorder)
        return True

    def result(self) -> SearchResult:
        beams = self.beams
        if beams is not None:
            self.results.store(beams.ids, beams.best_tokens, beams.best_len, beams.best)
        return self.results.result()


@torch.inference_mode()
def beam_search(
    model: Transformer,
    src: Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    min_len: int = 0,
    static: bool = False,
    graphs: bool | None = None,
    linear: Linear = F.linear,
) -> SearchResult:
    """Beam search with the GNMT length penalty (§6.1), batched over the sentences of src (B, S): rows
    of pieces + [EOS], padded with PAD_ID. EOS is held back through step `min_len` (benchmarks that
    force an output length). `static`: in static shapes; `graphs` (default: on CUDA) with every step
    after the first a CUDA graph replay. `linear` makes the output projection (`kernels.Products`)."""
    search = BeamSearch(model, src, beam_size, alpha, (max_len_a, max_len_b), min_len, static, linear)
    graphs = (static and src.is_cuda) if graphs is None else graphs
    if graphs and not (static and src.is_cuda):
        raise ValueError("CUDA graphs need static=True and the model and src on a CUDA device")
    limit = search.beams.tokens.size(1)
    # graphs record and replay on the streams of the current device: make it src's (cuda:1 too)
    with torch.cuda.device(src.device) if graphs else contextlib.nullcontext():
        step = _graphed(search.step) if graphs else search.step  # with graphs, step 1 ran in the warm-up
        for _ in range(1 if graphs else 0, limit):
            if static:
                if search.done():
                    break
                step()
            else:
                search.step()
                if not search.leave():
                    break
    return search.result()


def greedy_search(model: Transformer, src: Tensor, **options: Any) -> SearchResult:
    """The most probable next token at every step: `beam_search` with a beam of 1 and no length penalty
    (its scores are log P(Y|X)); `options`: max_len_a, max_len_b, min_len, static, linear."""
    return beam_search(model, src, beam_size=1, alpha=0.0, **options)


def best_next_tokens(
    states: Tensor, weight: Tensor, step: Tensor, min_len: int, n: int, linear: Linear = F.linear
) -> tuple[Tensor, Tensor]:
    """The n most probable next tokens after each final decoder state of states (R, d_model), projected
    by the output matrix weight (V, d_model), and their float32 log P(y_step | y_<step, X). PAD and BOS
    are never generated; EOS is held back while step <= min_len. The vocabulary is projected a chunk at
    a time on a CPU (`vocab_chunks`): no (R, V) tensor is made at each step there."""
    chunks = vocab_chunks(weight.size(0), weight.device)
    lses, values, indices = [], [], []
    for start, end in chunks:
        logits = linear(states, weight[start:end])  # (R, c)
        log_probs = logits.log_softmax(dim=-1, dtype=torch.float32)  # (R, c), normalized within the chunk
        if start == 0:
            log_probs[:, PAD_ID].fill_(NEG_INF)  # fills: no tensor made from host data (CUDA graphs)
            log_probs[:, BOS_ID].fill_(NEG_INF)
            log_probs[:, EOS_ID].masked_fill_(step <= min_len, NEG_INF)
        top, index = log_probs.topk(min(n, end - start), dim=-1)  # (R, n), best first
        if len(chunks) == 1:
            return top, index
        # the chunk's log-sum-exp, from its best entry (finite even where PAD and BOS are among the n)
        lse = logits.gather(1, index[:, :1]).float() - top[:, :1]  # (R, 1)
        lses.append(lse)
        values.append(top + lse)  # (R, n) their logits, in float32
        indices.append(index + start)
    lse = torch.cat(lses, dim=1).logsumexp(dim=1, keepdim=True)  # (R, 1) over the whole vocabulary
    candidates = torch.cat(values, dim=1)  # (R, chunks * n)
    best, pick = candidates.topk(min(n, candidates.size(1)), dim=-1)  # (R, n), best first
    return best - lse, torch.cat(indices, dim=1).gather(1, pick)


def rank_extensions(
    scores: Tensor, log_probs: Tensor, next_tokens: Tensor, k: int, penalty: float | Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """One step's choice among the extensions of N sentences' k live hypotheses.

    scores (N, k) float32 log P of the live hypotheses; log_probs, next_tokens (N * k, m): the m best
    next tokens of each; penalty: lp(step). Of each sentence's 2k best extensions, the k best not
    ending in EOS live on, and an EOS among the k best finishes its hypothesis. Returns the new live
    scores (N, k), the old row each new row extends (N * k,), its new token (N * k, 1), and per
    sentence the best EOS ending's normalized score (N,) (-inf if none) and the row it ends (N,).
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
    # k new live hypotheses: the best candidates that do not end in EOS (at most k of 2k do).
    live_scores, pick = top_scores.masked_fill(is_eos, NEG_INF).topk(k, dim=1)  # (N, k)
    reorder = top_row.gather(1, pick).view(-1)  # (N * k,)
    new_token = top_token.gather(1, pick).view(-1, 1)  # (N * k, 1)
    eos_best, eos_pick = (torch.where(is_eos[:, :k], top_scores[:, :k], NEG_INF) / penalty).max(dim=1)  # (N,)
    eos_row = top_row[:, :k].gather(1, eos_pick[:, None]).squeeze(1)  # (N,)
    return live_scores, reorder, new_token, eos_best, eos_row


class _Results:
    """The finished hypothesis of every sentence of the batch, filled as sentences finish."""

    def __init__(self, batch_size: int) -> None:
        self.tokens: list[list[int]] = [[] for _ in range(batch_size)]
        self.scores = torch.full((batch_size,), NEG_INF)

    def store(self, ids: Tensor, tokens: Tensor, lengths: Tensor, scores: Tensor) -> None:
        """ids (n,) positions in the batch; tokens (n, L) with the first `lengths` valid."""
        for i, row, n, score in zip(ids.tolist(), tokens.tolist(), lengths.tolist(), scores.tolist()):
            self.tokens[i] = row[:n]
            self.scores[i] = score

    def result(self) -> SearchResult:
        return SearchResult(self.tokens, self.scores)


def _graphed(step: Callable[[], None]) -> Callable[[], None]:
    """Run step once eagerly (on a side stream: the warm-up CUDA graph capture asks for), then record
    the next two steps as CUDA graphs (recording runs nothing): a beam reorder swaps the buffers of the
    self-attention cache, so every other step reads and writes the same memory. Returns a replay of the
    two graphs in turn."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = [torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()]
    # captured on the warm-up's stream, of src's device (torch's default capture stream is made once
    # per process, on whichever device was current at the first capture)
    for graph in graphs:
        with torch.cuda.graph(graph, stream=stream):
            step()
    turns = itertools.cycle(graphs)
    return lambda: next(turns).replay()
