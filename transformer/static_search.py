"""Beam search in static shapes, each step replayed as one CUDA graph (`cuda_graphs=true`).

On a GPU a decoding step of the base model is ~180 small kernels of a few microseconds of math each:
the step is bound by the host launching them, not by the device. Here every tensor a step reads or
writes is allocated before the first step and keeps its shape, and the step itself (the decoder, the
output projection, the ranking of candidates, the bookkeeping) never reads a value on the host. So a
step is recorded once per batch as a CUDA graph and replayed: one launch per step. (Two graphs, replayed
in turn: a beam reorder moves the self-attention cache into a second pair of buffers, so even and odd
steps use different memory.)

The rules are those of `decoding.beam_search`; the work takes another shape:
- all N x k beams decode from step 1 (there, k - 1 of each sentence's beams start at log P = -inf);
- a finished sentence stays in the batch, its result frozen, instead of leaving it;
- the self-attention keys and values have room for the limit L from the start, and attention reads
  all L positions, those not yet written masked out (`attention.StaticKV`);
- the host reads one flag per step (is every sentence done?) to stop early.
On a CPU the same step runs eagerly, without a graph: that is how the tests compare it with
`beam_search`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from transformer.attention import KV, StaticKV
from transformer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID
from transformer.decoding import (
    NEG_INF,
    SearchResult,
    length_penalty,
    max_output_lengths,
    rank_extensions,
    source_mask,
)
from transformer.model import Transformer


@dataclass
class _State:
    """Everything a step reads or writes: N sentences x k beams (rows sentence-major), limit L."""

    position: Tensor  # () long: the position of the tokens this step feeds (step - 1)
    key_positions: Tensor  # (1, L) long: 0 .. L - 1
    key_mask: Tensor  # (1, L) bool: the self-attention keys written so far (position included)
    src_mask: Tensor  # (N, S)
    self_kv: list[StaticKV]  # per layer, (N * k, H_kv, L, d)
    cross_kv: list[KV]  # per layer, (N, H_kv, S, d): the beams of a sentence share them
    first_row: Tensor  # (N,) long: the row of each sentence's first beam
    last: Tensor  # (N * k, 1) the last token of each live hypothesis
    tokens: Tensor  # (N * k, L) the live hypotheses' tokens (the first `position` are valid)
    scores: Tensor  # (N, k) float32 log P of each live hypothesis
    max_len: Tensor  # (N,) maximum output length L_n
    lp_max: Tensor  # (N,) float32 lp(L_n): the early-stop bound's divisor
    best: Tensor  # (N,) float32 normalized score of the best finished hypothesis
    best_tokens: Tensor  # (N, L) its tokens (the first best_len are valid)
    best_len: Tensor  # (N,) its length, EOS excluded
    done: Tensor  # (N,) bool: the sentence's result is final


def _start(model: Transformer, src: Tensor, k: int, alpha: float, max_len_a: float, max_len_b: int) -> _State:
    """Encode src (N, S) and lay out every buffer of the search."""
    src_mask = source_mask(model, src)  # (N, S)
    memory = model.encode(src, src_mask)  # (N, S, d_model)
    max_len = max_output_lengths(src_mask, max_len_a, max_len_b, model.cfg.max_positions)
    n, limit, device = src.size(0), int(max_len.max()), src.device
    position = torch.zeros((), dtype=torch.long, device=device)
    key_mask = torch.zeros(1, limit, dtype=torch.bool, device=device)
    self_kv, cross_kv = [], []
    for layer in model.decoder:
        cross = layer.cross_attn.project_kv(memory)
        cross_kv.append(KV(cross.k.contiguous(), cross.v.contiguous()))
        # in the dtype the projections give (under autocast, its dtype; memory may be float32)
        attn, dtype = layer.self_attn, cross.k.dtype
        k_buf = memory.new_zeros(n * k, attn.n_kv_heads, limit, attn.d_k, dtype=dtype)
        v_buf = memory.new_zeros(n * k, attn.n_kv_heads, limit, attn.d_v, dtype=dtype)
        self_kv.append(StaticKV(k_buf, v_buf, position, key_mask))
    scores = torch.full((n, k), NEG_INF, device=device)
    scores[:, 0] = 0.0  # one live hypothesis per sentence at first: [BOS]
    return _State(
        position=position,
        key_positions=torch.arange(limit, device=device)[None],
        key_mask=key_mask,
        src_mask=src_mask,
        self_kv=self_kv,
        cross_kv=cross_kv,
        first_row=torch.arange(n, device=device) * k,
        last=src.new_full((n * k, 1), BOS_ID),
        tokens=src.new_zeros(n * k, limit),
        scores=scores,
        max_len=max_len,
        lp_max=length_penalty(max_len, alpha),
        best=torch.full((n,), NEG_INF, device=device),
        best_tokens=src.new_zeros(n, limit),
        best_len=src.new_zeros(n),
        done=torch.zeros(n, dtype=torch.bool, device=device),
    )


def _step(model: Transformer, s: _State, k: int, alpha: float, min_len: int) -> None:
    """One step of `decoding.beam_search` (`_advance` and the done test), in place on s."""
    step = s.position + 1  # () long: the output position chosen now, 1-based
    torch.le(s.key_positions, s.position, out=s.key_mask)
    y = model.embed(s.last, offset=s.position)  # (N * k, 1, d_model)
    for layer, self_kv, cross_kv in zip(model.decoder, s.self_kv, s.cross_kv):
        y = layer(y, None, s.src_mask, self_past=self_kv, cross_kv=cross_kv)[0]
    states = model.decoder_norm(y)[:, -1]  # (N * k, d_model)
    log_probs = model.project(states).log_softmax(dim=-1, dtype=torch.float32)  # (N * k, V)
    log_probs[:, PAD_ID].fill_(NEG_INF)  # never generated (fills: no tensor made from host data)
    log_probs[:, BOS_ID].fill_(NEG_INF)
    log_probs[:, EOS_ID].masked_fill_(step <= min_len, NEG_INF)  # held back through min_len
    # only a row's 2k best tokens can be among its sentence's 2k best candidates
    top, token = log_probs.topk(min(2 * k, log_probs.size(-1)), dim=-1)  # (N * k, m)
    penalty = length_penalty(step.double(), alpha).float()  # () as decoding's Python float, rounded
    live_scores, reorder, new_token, eos_best, eos_row = rank_extensions(s.scores, top, token, k, penalty)
    _finish(s, eos_best, s.tokens[eos_row], step - 1)  # EOS itself is not output
    tokens = s.tokens.index_select(0, reorder)  # (N * k, L)
    tokens.index_copy_(1, s.position.view(1), new_token)
    s.tokens.copy_(tokens)
    # every live hypothesis at its limit L_n finishes
    cut = torch.where(s.max_len[:, None] == step, live_scores / penalty, NEG_INF)  # (N, k)
    cut_best, cut_pick = cut.max(dim=1)  # (N,)
    _finish(s, cut_best, s.tokens[s.first_row + cut_pick], step)
    # Done: at the length limit, or no live hypothesis can still beat the best finished one.
    s.done |= (s.best >= live_scores.max(dim=1).values / s.lp_max) | (s.max_len == step)
    s.scores.copy_(live_scores)
    s.last.copy_(new_token)
    for kv in s.self_kv:
        kv.reorder_(reorder)
    s.position += 1


def _finish(s: _State, scores: Tensor, tokens: Tensor, length: Tensor) -> None:
    """Make (scores (N,), tokens (N, L) of `length` ()) the best finished hypotheses where they beat the
    old ones, except in sentences already done."""
    better = (scores > s.best) & ~s.done  # (N,)
    s.best_tokens.copy_(torch.where(better[:, None], tokens, s.best_tokens))
    s.best_len.copy_(torch.where(better, length, s.best_len))
    s.best.copy_(torch.where(better, scores, s.best))


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


@torch.inference_mode()
def static_beam_search(
    model: Transformer,
    src: Tensor,
    beam_size: int = 4,
    alpha: float = 0.6,
    max_len_a: float = 1.0,
    max_len_b: int = 50,
    min_len: int = 0,
    graph: bool | None = None,
) -> SearchResult:
    """`decoding.beam_search` in static shapes on src (N, S); with graph (default: on CUDA) the first
    step runs eagerly and every later one is a CUDA graph replay."""
    graph = src.is_cuda if graph is None else graph
    if graph and not src.is_cuda:
        raise ValueError("a CUDA graph needs the model and src on a CUDA device")
    s = _start(model, src, beam_size, alpha, max_len_a, max_len_b)
    run = functools.partial(_step, model, s, beam_size, alpha, min_len)
    # graphs record and replay on the streams of the current device: make it src's (cuda:1 too)
    with torch.cuda.device(src.device) if graph else contextlib.nullcontext():
        if graph:
            run = _graphed(run)  # step 1 ran in the warm-up
        for _ in range(1 if graph else 0, s.tokens.size(1)):
            if bool(s.done.all()):
                break
            run()
    lengths = s.best_len.tolist()
    tokens = [row[:length] for row, length in zip(s.best_tokens.tolist(), lengths)]
    return SearchResult(tokens, s.best.cpu())
