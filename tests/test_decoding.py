"""Greedy and beam search (§6.1) against independent references: the length-penalty formula written
out, a decoder that recomputes the whole prefix every step (no KV cache), and brute-force enumeration
of every output sequence. The static-shape beam search (CUDA graphs) passes the same specification
tests and is compared with the dynamic one."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import sources, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from transformer.config import ModelConfig, SearchConfig
from transformer.decoding import (
    BeamSearch,
    DecoderCache,
    beam_search,
    best_next_tokens,
    length_penalty,
    scoring,
    search_weights,
    vocab_chunks,
)
from transformer.kernels import Kernels
from transformer.model import Transformer
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID

static_beam_search = functools.partial(beam_search, static=True)
# the two ways of running the same beam search: dynamic shapes, and static shapes (CUDA graphs)
BEAM_SEARCHES = pytest.mark.parametrize(
    "beam_search_fn", [beam_search, static_beam_search], ids=["dynamic", "static"]
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def plain_model(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0, init="xavier")
    return Transformer(ModelConfig(**{**cfg, **overrides})).double().eval()


@pytest.mark.parametrize(
    "overrides", [{}, {"n_kv_heads": 1}, {"norm_first": True}, {"positional": "learned"}]
)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.inference_mode()
def test_incremental_decoding_equals_the_full_decoder(overrides, static):
    model = plain_model(**overrides)
    src, tgt = (
        sources([6, 3, 4], 40),
        torch.randint(4, 40, (3, 6), generator=torch.Generator().manual_seed(1)),
    )
    mask = model.src_mask(src)
    memory = model.encode(src, mask)
    full = model.decode(tgt, memory, mask)  # (3, 6, d_model)
    cache = DecoderCache(model, memory, mask, rows=3, limit=6, static=static)
    buffers = {cache.layers[0].keys.data_ptr()}
    for t in range(tgt.size(1)):
        step = model.decode(tgt[:, t : t + 1], cache=cache)
        torch.testing.assert_close(step[:, 0], full[:, t], rtol=1e-10, atol=1e-10)
        buffers.add(cache.layers[0].keys.data_ptr())
    assert buffers == {cache.layers[0].keys.data_ptr()}  # room for every position from the start: never moved
    if not static:  # a prefix of several tokens at once, then the rest, also matches
        cache = DecoderCache(model, memory, mask, rows=3, limit=6, static=False)
        prefix = model.decode(tgt[:, :4], cache=cache)
        rest = model.decode(tgt[:, 4:], cache=cache)
        torch.testing.assert_close(torch.cat([prefix, rest], 1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.inference_mode()
def test_a_reorder_moves_every_layers_keys_and_values_with_their_rows(static):
    model = plain_model()
    src, tgt = (
        sources([6, 3, 4], 40),
        torch.randint(4, 40, (3, 4), generator=torch.Generator().manual_seed(2)),
    )
    mask = model.src_mask(src)
    memory = model.encode(src, mask)
    cache = DecoderCache(model, memory, mask, rows=3, limit=4, static=static)
    model.decode(tgt[:, :1], cache=cache)
    model.decode(tgt[:, 1:2], cache=cache)
    index, again = torch.tensor([2, 0, 0]), torch.tensor([1, 2, 0])
    cache.reorder(index, index)  # two in a row: the second picks from the first's rows
    cache.reorder(again, again)
    rows = index[again]
    step = model.decode(tgt[rows, 2:3], cache=cache)
    expected = model.decode(tgt[rows, :3], memory[rows], mask[rows])[:, 2]
    torch.testing.assert_close(step[:, 0], expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@torch.inference_mode()
def test_the_beams_of_a_sentence_keep_their_histories_through_reorders(static):
    """Beams that extend their own rows, another's, or several of one, read as a full decode of their
    histories."""
    model = plain_model()
    src = sources([5], 40)
    mask = model.src_mask(src)
    memory = model.encode(src, mask)
    tgt = torch.randint(4, 40, (3, 4), generator=torch.Generator().manual_seed(5))
    cache = DecoderCache(model, memory, mask, rows=3, limit=4, static=static)
    model.decode(tgt[:, :1], cache=cache)
    buffers = [cache.layers[0].keys.data_ptr()]
    cache.reorder(torch.tensor([0, 0, 2]))  # row 1 takes row 0's history, rows 0 and 2 keep theirs
    model.decode(tgt[:, 1:2], cache=cache)
    buffers.append(cache.layers[0].keys.data_ptr())
    cache.reorder(torch.tensor([2, 1, 1]))
    step = model.decode(tgt[:, 2:3], cache=cache)
    assert (buffers[0] == buffers[1]) != static  # dynamic: rows copied in place; static: two buffers swap
    history = [[2, 2, 0], [0, 1, 1], [0, 1, 2]]  # the row whose token each position holds
    tokens = torch.stack([tgt[history[i], torch.arange(3)] for i in range(3)])  # (3, 3)
    expected = model.decode(tokens, memory.expand(3, -1, -1), mask.expand(3, -1))[:, 2]
    torch.testing.assert_close(step[:, 0], expected, rtol=1e-10, atol=1e-10)


@torch.no_grad()
def teacher_forced_score(
    model: Transformer, src_row: torch.Tensor, tokens: list[int], max_len: int, alpha: float
) -> float:
    """log P(Y|X) / lp(Y) by one full `decode`; Y ends in EOS unless it was cut at the limit max_len."""
    src = src_row[None, : int((src_row != PAD_ID).sum())]
    y = tokens if len(tokens) == max_len else tokens + [EOS_ID]
    memory = model.encode(src, model.src_mask(src))
    tgt_in = torch.tensor([[BOS_ID] + y[:-1]])
    log_probs = model.project(model.decode(tgt_in, memory, model.src_mask(src))).log_softmax(-1)[
        0
    ]  # (|Y|, V)
    return sum(float(log_probs[i, t]) for i, t in enumerate(y)) / ((5 + len(y)) / 6) ** alpha


def test_length_penalty_is_the_gnmt_formula():
    for length, alpha in [(1, 0.6), (7, 0.6), (30, 0.6), (12, 1.0), (9, 0.0)]:
        expected = math.pow((5 + length) / 6, alpha)
        assert length_penalty(length, alpha) == pytest.approx(expected, rel=1e-12)
        assert float(length_penalty(torch.tensor([length]), alpha)[0]) == pytest.approx(expected, rel=1e-6)
    assert length_penalty(1, 0.6) == 1.0  # a lone EOS is not penalised


def greedy_reference(model: Transformer, src: torch.Tensor, max_len: int) -> tuple[list[int], float]:
    """Greedy search written out for one source (1, S): the full decoder run on the whole prefix at every
    step, its most probable next token (never PAD or BOS) appended until EOS or `max_len` tokens; the
    tokens (EOS not included) and their summed log-probability."""
    tokens, total = [], 0.0
    with torch.no_grad():
        memory = model.encode(src, model.src_mask(src))
        while len(tokens) < max_len:
            prefix = torch.tensor([[BOS_ID, *tokens]])
            log_probs = model.project(model.decode(prefix, memory, model.src_mask(src))[:, -1]).double()
            log_probs = log_probs.log_softmax(-1)[0]
            log_probs[[PAD_ID, BOS_ID]] = -math.inf
            token = int(log_probs.argmax())
            total += float(log_probs[token])
            if token == EOS_ID:
                break
            tokens.append(token)
    return tokens, total


@BEAM_SEARCHES
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_a_beam_of_one_is_greedy_search_without_length_penalty(beam_search_fn, alpha):
    """beam_size=1 is the most probable next token at every step, scored by log P(Y|X) whatever alpha."""
    model = tiny_model()
    src = sources([3, 7, 5, 1, 9], 24)
    beam = beam_search_fn(model, src, SearchConfig(beam_size=1, alpha=alpha, max_len_a=1.0, max_len_b=6))
    for row in range(src.size(0)):
        one = src[row : row + 1, : int((src[row] != PAD_ID).sum())]
        tokens, log_prob = greedy_reference(model, one, one.size(1) + 6)
        assert beam.tokens[row] == tokens
        assert float(beam.scores[row]) == pytest.approx(log_prob, abs=1e-5)
    assert any(len(t) > 0 for t in beam.tokens)


@BEAM_SEARCHES
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_each_score_is_that_of_its_tokens_by_teacher_forcing(beam_search_fn, alpha):
    """The cached decoder's scores against one full decode of each output (tests/test_beam_reference.py
    checks the tokens against a search that recomputes every prefix)."""
    model = tiny_model()
    src = sources([4, 8, 2, 6], 24)
    searches = (
        (
            alpha,
            lambda: beam_search_fn(
                model, src, SearchConfig(beam_size=4, alpha=alpha, max_len_a=1.0, max_len_b=5)
            ),
        ),
        (
            0.0,
            lambda: beam_search_fn(
                model, src, SearchConfig(beam_size=1, alpha=0.0, max_len_a=1.0, max_len_b=5)
            ),
        ),
    )
    for penalty, run in searches:
        result = run()
        assert len({len(t) for t in result.tokens}) > 1
        # src lengths + EOS + 5 = the maximum output lengths
        for row, (tokens, limit) in enumerate(zip(result.tokens, [10, 14, 8, 12])):
            expected = teacher_forced_score(model, src[row], tokens, limit, penalty)
            assert float(result.scores[row]) == pytest.approx(expected, abs=1e-5)


@torch.no_grad()
def brute_force(model: Transformer, src: torch.Tensor, max_len: int, alpha: float):
    """Best (tokens, score) per sentence over every output: y_1..y_j EOS with j + 1 <= max_len, or
    y_1..y_L cut at the limit; scored by teacher forcing with the full `decode`."""
    content = [t for t in range(model.cfg.vocab_size) if t not in (PAD_ID, BOS_ID, EOS_ID)]
    outputs = [list(y) + [EOS_ID] for j in range(max_len) for y in itertools.product(content, repeat=j)]
    outputs += [list(y) for y in itertools.product(content, repeat=max_len)]
    best = []
    for row in range(src.size(0)):
        one = src[row : row + 1, : int((src[row] != PAD_ID).sum())]
        memory = model.encode(one, model.src_mask(one))
        scored = []
        for y in outputs:
            tgt_in = torch.tensor([[BOS_ID] + y[:-1]])
            states = model.decode(tgt_in, memory, model.src_mask(one))
            log_probs = model.project(states).log_softmax(-1)[0]  # (|Y|, V)
            log_p = sum(float(log_probs[i, t]) for i, t in enumerate(y))
            scored.append((log_p / ((5 + len(y)) / 6) ** alpha, [t for t in y if t != EOS_ID]))
        best.append(max(scored))
    return best


@BEAM_SEARCHES
@pytest.mark.parametrize("max_len", [3, 4])
@pytest.mark.parametrize("alpha", [0.0, 0.6])
def test_wide_beam_finds_the_exhaustive_optimum(max_len, alpha, beam_search_fn):
    """Vocabulary 6: 3 content pieces (UNK and two more) plus EOS can follow each prefix. A beam as
    wide as all candidates of the last step (3^(L-1) live prefixes x 4) never prunes, so beam search
    with its early stop must return exactly the exhaustive optimum."""
    vocab = 6
    model = tiny_model(vocab=vocab, seed=7)
    src = sources([2, 5, 3, 4], vocab, seed=4)
    width = 3 ** (max_len - 1) * 4
    result = beam_search_fn(
        model, src, SearchConfig(beam_size=width, alpha=alpha, max_len_a=0.0, max_len_b=max_len)
    )
    optimum = brute_force(model, src, max_len, alpha)
    assert len({tuple(tokens) for _, tokens in optimum}) > 1  # the sentences' optima differ
    for row, (score, tokens) in enumerate(optimum):
        assert result.tokens[row] == tokens
        assert float(result.scores[row]) == pytest.approx(score, abs=1e-5)  # scores add up in float32


@BEAM_SEARCHES
def test_a_batch_decodes_like_its_sentences_one_by_one(beam_search_fn):
    """Padding, and sentences leaving the batch (or staying, their results frozen) when done, change
    nothing."""
    model = tiny_model(seed=5)
    src = sources([9, 2, 5, 1, 7, 3], 24, seed=6)
    batch = beam_search_fn(model, src, SearchConfig(beam_size=3, alpha=0.6, max_len_a=1.0, max_len_b=4))
    lengths = set()
    for row in range(src.size(0)):
        one = src[row : row + 1, : int((src[row] != PAD_ID).sum())]
        alone = beam_search_fn(model, one, SearchConfig(beam_size=3, alpha=0.6, max_len_a=1.0, max_len_b=4))
        assert alone.tokens[0] == batch.tokens[row]
        assert float(alone.scores[0]) == pytest.approx(float(batch.scores[row]), abs=1e-5)
        lengths.add(len(alone.tokens[0]))
    assert len(lengths) > 1  # sentences finished at different steps


@pytest.mark.parametrize("search", [beam_search, static_beam_search])
@pytest.mark.parametrize("beam", [1, 4])
def test_a_source_row_of_padding_only_is_refused_before_encoding(search, beam, monkeypatch):
    """Such a row has no key to attend to: its states would be NaN and its output garbage."""
    model = tiny_model(seed=2)
    src = sources([3, 2], 24)
    src[1] = PAD_ID
    monkeypatch.setattr(model, "encode", lambda *args: pytest.fail("encoded a batch it should refuse"))
    with pytest.raises(ValueError, match="all padding"):
        search(model, src, SearchConfig(beam_size=beam))


def test_maximum_length_is_source_plus_b_and_min_len_forces_it():
    model = tiny_model(seed=7)
    src = sources([2, 6], 24)  # 3 and 7 source tokens with EOS
    for search in (
        lambda: beam_search(model, src, SearchConfig(beam_size=4, alpha=0.6, max_len_b=3), min_len=50),
        lambda: static_beam_search(model, src, SearchConfig(beam_size=4, alpha=0.6, max_len_b=3), min_len=50),
        lambda: beam_search(model, src, SearchConfig(beam_size=1, max_len_b=3), min_len=50),
    ):
        result = search()
        assert [len(t) for t in result.tokens] == [3 + 3, 7 + 3]
        assert all(EOS_ID not in t and PAD_ID not in t and BOS_ID not in t for t in result.tokens)


def test_the_first_step_of_a_search_decodes_one_row_per_sentence():
    """Before step 1 a sentence has one hypothesis, [BOS]: the search in dynamic shapes projects one row
    per sentence then, and k from step 2 on (the static one keeps k rows throughout, and chooses the
    same)."""
    model, src = tiny_model(seed=3), sources([2, 6, 4], 24)
    search = SearchConfig(beam_size=4, alpha=0.6, max_len_a=0.0, max_len_b=3)
    seen = []

    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.size(0) == model.cfg.vocab_size:  # the output projection (the vocabulary at once)
            seen.append(x.size(0))
        return F.linear(x, weight)

    result = beam_search(model, src, search, min_len=50, linear=linear)
    assert seen == [3, 12, 12]
    assert result.tokens == static_beam_search(model, src, search, min_len=50).tokens


@pytest.mark.parametrize(
    "chunk, step, min_len, n", [(7, 1, 0, 8), (13, 2, 5, 8), (9, 3, 0, 1), (40, 1, 0, 8), (4, 1, 5, 8)]
)
def test_vocabulary_chunks_choose_like_the_whole_vocabulary(monkeypatch, chunk, step, min_len, n):
    """The n best of a projection made chunk by chunk (each chunk's own log-softmax and log-sum-exp)
    are torch.topk of the log-softmax over the whole vocabulary, PAD, BOS (and EOS before min_len) out."""
    monkeypatch.setattr(scoring, "VOCAB_CHUNK", chunk)
    chunks = vocab_chunks(40, torch.device("cpu"))
    assert chunks[0][0] == 0 and chunks[-1][1] == 40 and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert len(chunks) == math.ceil(40 / chunk) and len({end - start for start, end in chunks[:-1]}) <= 1
    model = tiny_model(vocab=40, seed=3)
    states = torch.randn(5, 32, dtype=torch.float64) * 3
    expected = model.project(states).log_softmax(dim=-1)  # (5, 40)
    expected[:, [PAD_ID, BOS_ID, EOS_ID] if step <= min_len else [PAD_ID, BOS_ID]] = float("-inf")
    values, index = expected.topk(n, dim=-1)
    got_values, got_index = best_next_tokens(states, model.embed.weight, torch.tensor(step), min_len, n)
    assert torch.equal(got_index, index)
    torch.testing.assert_close(got_values, values.float(), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(scoring, "VOCAB_CHUNK", 8192)
    src = sources([3, 7, 5], 40)
    whole = beam_search(model, src, SearchConfig(beam_size=3, max_len_b=6))
    monkeypatch.setattr(scoring, "VOCAB_CHUNK", chunk)
    chunked = beam_search(model, src, SearchConfig(beam_size=3, max_len_b=6))
    assert chunked.tokens == whole.tokens
    torch.testing.assert_close(chunked.scores, whole.scores, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows, width, n", [(64, 7400, 2), (128, 7403, 8), (16, 5000, 50), (3, 43, 2)])
def test_top_n_finds_what_topk_finds(monkeypatch, rows, width, n):
    """The n largest of each row and their indices, best first, as Tensor.topk: with masked (-inf)
    entries, the best past the last whole segment (7,403 and 43 entries), and all n best in one column
    of the segments; small inputs too (where top_n would hand them to topk)."""
    monkeypatch.setattr(scoring, "TOP_N_MIN", 0)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, width, generator=generator) * 4
    x[:, :3] = float("-inf")
    x[0, -3:] += 30  # the best: past the last whole segment where width is not a multiple of 8
    segment = width // scoring.TOP_N_SEGMENTS
    x[1, 1 + segment * torch.arange(scoring.TOP_N_SEGMENTS)] = 50 + torch.arange(8.0)  # one column
    values, index = scoring.top_n(x, n)
    expected_values, expected_index = x.topk(n, dim=-1)
    assert torch.equal(values, expected_values) and torch.equal(index, expected_index)


def test_top_n_gives_a_row_the_same_indices_alone_and_in_a_batch():
    """Among exactly equal entries a row's indices do not depend on the rows beside it (a line's output
    never depends on its batch)."""
    x = torch.randn(16, 7400, generator=torch.Generator().manual_seed(0))
    x[:, [100, 7, 2875]] = 20.0  # a three-way tie for the best
    batched = scoring.top_n(x, 2)[1]
    for i in range(x.size(0)):
        assert torch.equal(scoring.top_n(x[i : i + 1], 2)[1][0], batched[i]), i


def test_a_search_ranking_by_top_n_decodes_as_by_topk(monkeypatch):
    model = tiny_model(vocab=40, seed=4)
    src = sources([3, 7, 5], 40)
    monkeypatch.setattr(scoring, "TOP_N_MIN", 1 << 62)  # Tensor.topk itself
    expected = beam_search(model, src, SearchConfig(beam_size=2, max_len_b=6, nbest=2))
    monkeypatch.setattr(scoring, "TOP_N_MIN", 0)  # top_n's segments even on so few entries
    got = beam_search(model, src, SearchConfig(beam_size=2, max_len_b=6, nbest=2))
    assert got.hypotheses == expected.hypotheses


def test_float32_search_with_the_cpu_kernels_and_packed_weights_equals_the_plain_model():
    """The float32 CPU path as translate.py runs it (the CPU kernels, the weights packed for oneDNN)
    decodes exactly as the plain modules do."""
    model = tiny_model(seed=5, dtype=torch.float32)
    src = sources([9, 2, 5, 1], 24, seed=6)
    plain = beam_search(model, src, SearchConfig(beam_size=3, alpha=0.6, max_len_b=6))
    kernels = Kernels.choose(torch.device("cpu"), "on")
    fast_model = kernels.apply(model)
    with kernels.products.prepacked(search_weights(fast_model)):
        fast = beam_search(
            fast_model, src, SearchConfig(beam_size=3, alpha=0.6, max_len_b=6), linear=kernels.products
        )
    assert fast.tokens == plain.tokens and len({len(t) for t in fast.tokens}) > 1
    torch.testing.assert_close(fast.scores, plain.scores, rtol=1e-5, atol=1e-5)


def test_bfloat16_model_gives_float32_scores():
    model = tiny_model(dtype=torch.bfloat16)
    result = beam_search(model, sources([3, 5], 24), SearchConfig(beam_size=4, alpha=0.6, max_len_b=4))
    assert result.scores.dtype == torch.float32
    assert torch.isfinite(result.scores).all()


@pytest.mark.gpu
def test_cuda_bfloat16_decoding_runs_and_mostly_agrees_with_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model(dtype=torch.float32)
    src = sources([3, 8, 5, 6], 24)
    cpu = beam_search(model, src, SearchConfig(beam_size=4, alpha=0.6, max_len_b=5))
    gpu = beam_search(
        model.cuda().to(torch.bfloat16), src.cuda(), SearchConfig(beam_size=4, alpha=0.6, max_len_b=5)
    )
    assert gpu.scores.dtype == torch.float32 and len(gpu.tokens) == len(cpu.tokens)
    # bf16 activations move a score by a few percent (on a CPU, bf16 against float32: up to 2.6% here),
    # and may flip a close choice: compare the scores of the outputs that agree
    same = [i for i, (a, b) in enumerate(zip(gpu.tokens, cpu.tokens)) if a == b]
    assert len(same) >= len(cpu.tokens) // 2
    torch.testing.assert_close(gpu.scores.cpu()[same], cpu.scores[same], rtol=0.06, atol=0.0)


@pytest.mark.parametrize("seed", range(4))
def test_static_search_chooses_as_the_dynamic_one(seed):
    """Random batches and settings: the static-shape search (all beams from step 1, finished sentences
    kept and frozen, masked L-long caches) returns the tokens and scores of `beam_search`."""
    model = tiny_model(seed=seed)
    g = torch.Generator().manual_seed(seed)
    lengths = set()
    for beam, alpha, a, b, min_len in [
        (4, 0.6, 1.0, 3, 0),
        (2, 0.0, 0.5, 5, 0),
        (5, 1.0, 0.0, 7, 2),
        (3, 0.6, 1.0, 9, 0),
    ]:
        src = sources(torch.randint(1, 9, (7,), generator=g).tolist(), 24, seed=seed + beam)
        search = SearchConfig(beam_size=beam, alpha=alpha, max_len_a=a, max_len_b=b)
        dynamic, static = (
            beam_search(model, src, search, min_len),
            static_beam_search(model, src, search, min_len),
        )
        assert static.tokens == dynamic.tokens
        torch.testing.assert_close(static.scores, dynamic.scores, rtol=1e-6, atol=1e-6)
        lengths |= {len(t) for t in static.tokens}
    assert len(lengths) > 3  # outputs of many lengths: sentences finished at many steps


def test_static_search_under_autocast_chooses_as_the_dynamic_one():
    """A float32 model under bfloat16 autocast: bf16 keys and values go into the float32 static cache.
    The two searches round differently in bf16 (CPUs with and without native bf16 differ too), so
    near-ties may break apart: scores agree to bf16 precision, and most sentences come out the same."""
    model = tiny_model(dtype=torch.float32, seed=1)
    src = sources([3, 5, 7, 2], 24, seed=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        dynamic = beam_search(model, src, SearchConfig(beam_size=4, max_len_b=6))
        static = static_beam_search(model, src, SearchConfig(beam_size=4, max_len_b=6))
    same = sum(s == d for s, d in zip(static.tokens, dynamic.tokens))
    assert same >= 3 and len({tuple(t) for t in static.tokens}) > 1
    torch.testing.assert_close(static.scores, dynamic.scores, rtol=1e-2, atol=2e-2)


@pytest.mark.parametrize("variant", [{"n_kv_heads": 2}, {"norm_first": True}, {"positional": "learned"}])
def test_static_search_chooses_as_the_dynamic_one_in_every_model_variant(variant):
    """Grouped key/value heads, pre-LN (a final LayerNorm), learned positions (read at a device offset)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0, **variant)
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)  # contexts matter (see tiny_model)
    src = sources([8, 3, 6, 5], 50, seed=3)
    search = SearchConfig(beam_size=4, alpha=0.6, max_len_a=1.0, max_len_b=6)
    dynamic, static = beam_search(model, src, search), static_beam_search(model, src, search)
    assert static.tokens == dynamic.tokens and len({tuple(t) for t in static.tokens}) > 1
    torch.testing.assert_close(static.scores, dynamic.scores, rtol=1e-5, atol=1e-5)


def test_a_finished_sentence_stays_finished_while_the_batch_decodes_on():
    """With alpha = 2 the length penalty outgrows the falling log-probabilities: hypotheses far past a
    short sentence's limit would outscore its result. The static search keeps finished sentences in
    the batch; their results must stay final (as in `beam_search`, where they leave it)."""
    model = tiny_model(seed=2)
    src = sources([2, 25, 1], 24, seed=2)  # limits |X| + 1: 4, 27, 3
    search = SearchConfig(beam_size=3, alpha=2.0, max_len_a=1.0, max_len_b=1)
    dynamic, static = beam_search(model, src, search), static_beam_search(model, src, search)
    assert static.tokens == dynamic.tokens
    torch.testing.assert_close(static.scores, dynamic.scores, rtol=1e-6, atol=1e-6)
    assert all(len(tokens) <= limit for tokens, limit in zip(static.tokens, [4, 27, 3]))


class _NoHostValues(TorchDispatchMode):
    """Fails on every op that would make a CUDA graph's capture fail or its replays wrong: reading a
    value to the host, an output shape that depends on values, a tensor made from host data."""

    FORBIDDEN = {
        "_local_scalar_dense",
        "is_nonzero",
        "item",
        "nonzero",
        "masked_select",
        "lift_fresh",
        "equal",
    }

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        assert func.overloadpacket.__name__ not in self.FORBIDDEN, f"{func} in a static step"
        return func(*args, **(kwargs or {}))


def state_tensors(obj: object, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor a search holds (its beams, its cache), found through attributes, lists, tuples and
    dicts; not the model's."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (torch.nn.Module, str, int, float, bool, type(None))):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else None
    if items is None:
        items = vars(obj).values() if hasattr(obj, "__dict__") else []
    return [t for item in items for t in state_tensors(item, seen)]


@torch.inference_mode()  # as beam_search runs its steps
def test_a_static_step_reads_nothing_on_the_host_and_keeps_its_memory():
    """What a CUDA graph replays must be the same kernels on the same memory: a static step (checked op
    by op) reads no device value, and every tensor of the search's state stays where it was, except the
    self-attention cache, which swaps between two pairs of buffers (two graphs, replayed in turn)."""
    model = tiny_model(seed=2)
    settings = SearchConfig(beam_size=3, alpha=0.6, max_len_a=1.0, max_len_b=5)
    search = BeamSearch(model, sources([4, 7, 2], 24), settings, True, F.linear, min_len=5)

    def layout() -> list[tuple]:
        return [(t.data_ptr(), tuple(t.shape), t.stride()) for t in state_tensors(search)]

    layouts = [layout()]
    for _ in range(5):
        with _NoHostValues():
            search.step()
        layouts.append(layout())
    assert int(search.position) == 5 and not search.done()  # min_len 5: nobody finished
    assert layouts[1] == layouts[3] == layouts[5] and layouts[2] == layouts[4]  # two layouts in turn
    assert layouts[1] != layouts[2] and sorted(layouts[1]) == sorted(layouts[2])  # buffers trade places
    while not search.done():  # the rest of the search: the result of beam_search
        search.step()
    static = beam_search(model, sources([4, 7, 2], 24), settings, min_len=5, static=True)
    assert search.result().tokens == static.tokens and len(static.tokens[1]) > 5
    # the mode does catch a host read
    with pytest.raises(AssertionError, match="_local_scalar_dense"), _NoHostValues():
        bool(torch.ones(2).sum() > 0)


@pytest.mark.gpu
def test_cuda_graph_replays_decode_like_the_eager_static_and_dynamic_searches():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny_model(dtype=torch.float32).cuda()
    src = sources([3, 8, 5, 6, 1, 7], 24).cuda()
    search = SearchConfig(beam_size=4, alpha=0.6, max_len_b=5)
    graphed = static_beam_search(model, src, search, graphs=True)
    eager = static_beam_search(model, src, search, graphs=False)
    assert graphed.tokens == eager.tokens
    torch.testing.assert_close(graphed.scores, eager.scores)
    dynamic = beam_search(model, src, search)
    assert graphed.tokens == dynamic.tokens
    torch.testing.assert_close(graphed.scores, dynamic.scores.cpu(), rtol=1e-4, atol=1e-4)
    half = static_beam_search(model.to(torch.bfloat16), src, search)  # as translate.py runs on CUDA
    assert half.scores.dtype == torch.float32 and torch.isfinite(half.scores).all()
