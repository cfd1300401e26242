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
  With an n-best list (`nbest` <= k) the n-th best finished score must beat it.

Policies of the same loop: `nbest` keeps the n best finished hypotheses with every token's
log-probability; an `Ensemble` decodes with the weighted average of its models' probabilities, each
model with its own cache; `sampling` draws `nbest` independent samples per sentence instead of
searching (each row extends itself, ending at EOS or the limit); repetition control (`Repeats`) ranks
and draws by a penalised distribution, recording the model's own log-probabilities.

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

import torch
import torch.nn.functional as F
from torch import Tensor

from transformer.config import SearchConfig
from transformer.decoding.cache import DecoderCache
from transformer.decoding.constraints import Constraints, advanced, allocate, offered
from transformer.decoding.scoring import (
    NEG_INF,
    Ensemble,
    Linear,
    Repeats,
    Shortlist,
    best_next_tokens,
    force_prefix,
    members,
    next_log_probs,
    projection_chunks,
    sample_keys,
    sample_tokens,
    top_n,
    uniform_draws,
)
from transformer.model import Transformer
from transformer.vocab import BOS_ID, EOS_ID, PAD_ID


@dataclass
class Hypothesis:
    """One output: its pieces (no BOS, no EOS), its score log P(Y|X) / lp(Y) (a beam of 1 without
    penalty, and sampling with alpha 0: log P(Y|X)), and the natural-log probability of each generated
    token, the final EOS included when it ended in one."""

    tokens: list[int]
    score: float
    token_log_probs: list[float]

    @property
    def log_prob(self) -> float:
        """log P(Y|X): the sum of `token_log_probs`."""
        return sum(self.token_log_probs)


@dataclass
class SearchResult:
    """Per source sentence, in the order of the batch, its best hypotheses (best first)."""

    hypotheses: list[list[Hypothesis]]

    @property
    def tokens(self) -> list[list[int]]:
        """The best hypothesis of each sentence."""
        return [h[0].tokens for h in self.hypotheses]

    @property
    def scores(self) -> Tensor:
        """(B,) float32 scores of the best hypotheses."""
        return torch.tensor([h[0].score for h in self.hypotheses], dtype=torch.float32)


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


def search_weights(model: Transformer, int8: bool = False) -> list[Tensor | tuple[Tensor, Tensor | None]]:
    """The weights `Products.prepacked` packs once for a search: the decoder's linear maps (multiplied
    by at every step) and the output projection's chunks; with `int8`, every linear map's (the
    encoder's too) as (weight, bias), for the 8-bit products."""
    chunks = projection_chunks(model.embed.weight)
    if int8:
        return [(m.weight, m.bias) for m in model.modules() if isinstance(m, torch.nn.Linear)] + chunks
    return [m.weight for m in model.decoder.modules() if isinstance(m, torch.nn.Linear)] + chunks


@dataclass
class _Beams:
    """N sentences x k rows (beams, or samples); rows of N x k are sentence-major, L is the longest
    output limit, n the hypotheses kept per sentence."""

    ids: Tensor  # (N,) each sentence's position in the batch
    keys: Tensor  # (N * k,) int64 the rows' keys of sampling's draws
    max_len: Tensor  # (N,) its output limit L_n
    lp_max: Tensor  # (N,) float32 lp(L_n): the early-stop bound's divisor
    last: Tensor  # (N * k, 1) the last token of each live hypothesis
    tokens: Tensor  # (N * k, L) the live hypotheses' tokens (the first step - 1 are valid)
    token_scores: Tensor  # (N * k, L) float32 their tokens' log-probabilities
    scores: Tensor  # (N, k) float32 log P of each live hypothesis
    best: Tensor  # (N, n) float32 normalized scores of the n best finished hypotheses, best first
    best_tokens: Tensor  # (N, n, L) their tokens, the first best_len valid
    best_token_scores: Tensor  # (N, n, L) float32 their tokens' log-probabilities (EOS's too)
    best_len: Tensor  # (N, n) their lengths, EOS excluded
    best_eos: Tensor  # (N, n) bool: ended in EOS (else cut at the limit)
    done: Tensor  # (N,) bool: the sentence's result is final
    prefix: Tensor  # (N, P) each sentence's forced first tokens (target_prefix), padded with PAD_ID
    constraints: Constraints | None  # each sentence's phrases (decoding/constraints.py)
    met: Tensor  # (N * k, M) bool: the constraint tokens each live hypothesis has met
    inside: Tensor  # (N * k,) the position of the next token of the phrase it is inside, else -1
    reorder: Tensor  # (N * k,) the row each row of the last step extends (the cache's reorder)

    @classmethod
    def start(
        cls,
        src: Tensor,
        max_len: Tensor,
        k: int,
        n: int,
        alpha: float,
        limit: int,
        keys: Tensor,
        prefix: Tensor,
        constraints: Constraints | None,
    ) -> _Beams:
        """One live hypothesis per sentence, [BOS], in a row of its own (k = 1 until step 1 widens it: a
        search in dynamic shapes), or in the first of k rows, the others impossible until step 1 (static
        shapes); or all k rows live (`keys` given: sampling). prefix (B, P): forced first tokens."""
        b, device = src.size(0), src.device
        scores = torch.full((b, k), NEG_INF, device=device)
        scores[:, 0] = 0.0
        if keys.numel():
            scores.fill_(0.0)
        return cls(
            ids=torch.arange(b, device=device),
            keys=keys if keys.numel() else torch.zeros(b * k, dtype=torch.long, device=device),
            max_len=max_len,
            lp_max=length_penalty(max_len, alpha),
            last=src.new_full((b * k, 1), BOS_ID),
            tokens=src.new_zeros(b * k, limit),
            token_scores=torch.zeros(b * k, limit, device=device),
            scores=scores,
            best=torch.full((b, n), NEG_INF, device=device),
            best_tokens=src.new_zeros(b, n, limit),
            best_token_scores=torch.zeros(b, n, limit, device=device),
            best_len=src.new_zeros(b, n),
            best_eos=torch.zeros(b, n, dtype=torch.bool, device=device),
            done=torch.zeros(b, dtype=torch.bool, device=device),
            prefix=prefix,
            constraints=constraints,
            met=torch.zeros(
                b * k,
                0 if constraints is None else constraints.tokens.size(1),
                dtype=torch.bool,
                device=device,
            ),
            inside=torch.full((b * k,), -1, dtype=torch.long, device=device),
            reorder=torch.arange(b * k, device=device),
        )

    def extend(self, reorder: Tensor, new_token: Tensor, token_score: Tensor, step: Tensor) -> None:
        """Row i becomes row reorder[i] (N * k,) extended by new_token[i] (N * k, 1), whose log-probability
        is token_score[i] (N * k,), at `step`: in place, or from one row per sentence to k (the first
        step of a search in dynamic shapes)."""
        at = (step - 1).view(1)
        tokens = self.tokens.index_select(0, reorder)  # (N * k, L)
        tokens.index_copy_(1, at, new_token)
        token_scores = self.token_scores.index_select(0, reorder)  # (N * k, L)
        token_scores.index_copy_(1, at, token_score[:, None])
        if reorder.size(0) != self.last.size(0):
            self.tokens, self.token_scores, self.last, self.reorder = tokens, token_scores, new_token, reorder
            self.keys, self.met, self.inside = self.keys[reorder], self.met[reorder], self.inside[reorder]
            return
        self.tokens.copy_(tokens)
        self.token_scores.copy_(token_scores)
        self.last.copy_(new_token)
        self.reorder.copy_(reorder)

    def finish(self, scores: Tensor, rows: Tensor, length: Tensor, eos_score: Tensor | None = None) -> None:
        """Make the live hypotheses `rows` (N,), scored scores (N,) and `length` () long, ending in EOS
        with log-probability eos_score (N,) unless None, finished ones of their sentences where they
        are among the n best, except in sentences already done."""
        n, at = self.best.size(1), length.view(1)
        tokens, token_scores = self.tokens[rows], self.token_scores[rows]  # (N, L) twice
        if eos_score is not None:
            token_scores = token_scores.index_copy(1, at, eos_score[:, None])
        candidates = torch.cat([self.best, torch.where(self.done, NEG_INF, scores)[:, None]], dim=1)
        keep = candidates.argsort(dim=1, descending=True, stable=True)[:, :n]  # (N, n): older first on ties
        self.best.copy_(candidates.gather(1, keep))
        lengths = torch.cat([self.best_len, length.expand(rows.size(0))[:, None]], 1)  # (N, n + 1)
        self.best_len.copy_(lengths.gather(1, keep))
        ended = torch.full_like(self.best_eos[:, :1], eos_score is not None)  # (N, 1)
        self.best_eos.copy_(torch.cat([self.best_eos, ended], 1).gather(1, keep))
        width = keep[:, :, None].expand(-1, -1, tokens.size(1))  # (N, n, L)
        self.best_tokens.copy_(torch.cat([self.best_tokens, tokens[:, None]], 1).gather(1, width))
        all_scores = torch.cat([self.best_token_scores, token_scores[:, None]], 1)  # (N, n + 1, L)
        self.best_token_scores.copy_(all_scores.gather(1, width))

    def finish_rows(self, which: Tensor, scores: Tensor, length: Tensor, eos_score: Tensor | None) -> None:
        """Sampling's finish: each row has its own slot (n = k); the rows `which` (N, k), scored scores
        (N, k), `length` () long, ending in EOS with log-probability eos_score (N * k,) unless None,
        become their slots' hypotheses, except in sentences already done."""
        n, k = which.shape
        which = which & ~self.done[:, None]
        tokens, token_scores = self.tokens.view(n, k, -1), self.token_scores.view(n, k, -1)
        if eos_score is not None:
            token_scores = token_scores.index_copy(2, length.view(1), eos_score.view(n, k, 1))
        self.best.copy_(torch.where(which, scores, self.best))
        self.best_len.copy_(torch.where(which, length, self.best_len))
        self.best_eos.copy_(torch.where(which, eos_score is not None, self.best_eos))
        self.best_tokens.copy_(torch.where(which[:, :, None], tokens, self.best_tokens))
        self.best_token_scores.copy_(torch.where(which[:, :, None], token_scores, self.best_token_scores))

    def keep(self, sentences: Tensor, k: int) -> _Beams:
        """Only `sentences` (n,) stay, with their rows (n * k,)."""
        rows = (sentences[:, None] * k + torch.arange(k, device=sentences.device)).view(-1)  # (n * k,)
        per_row = ("keys", "last", "tokens", "token_scores", "reorder", "met", "inside")
        kept = {
            f.name: None
            if getattr(self, f.name) is None
            else getattr(self, f.name)[rows if f.name in per_row else sentences]
            for f in fields(self)
        }
        return _Beams(**kept)


class BeamSearch:
    """The search of one batch, step by step: `step()` extends every live hypothesis by one token; in
    the dynamic layout `leave()` then lets done sentences leave the batch. `beam_search` runs it."""

    def __init__(
        self,
        model: Transformer | Ensemble,
        src: Tensor,
        search: SearchConfig,
        static: bool,
        linear: Linear,
        min_len: int = 0,
        sentence_ids: Tensor | None = None,
        prefix: Tensor | None = None,
        constraints: list[list[list[int]]] | None = None,
        shortlist: Shortlist | None = None,
    ) -> None:
        """src (B, S): rows of pieces + [EOS], padded with PAD_ID; search: the beam (or samples), the
        length penalty, the output limit L = a |X| + b; sentence_ids (B,): the sentences' numbers in the
        whole input, which fix their samples' draws (default: their rows); prefix (B, P): the first
        tokens of every output (target_prefix), padded with PAD_ID; constraints: per sentence the
        phrases (token ids) every output contains (dynamic shapes only, no sampling); the limit grows to
        hold both; shortlist: the only pieces the outputs may take (a vocabulary map's)."""
        if constraints is not None and (static or search.sampling):
            raise ValueError("constraints take the search in dynamic shapes: not static=True nor sampling")
        if shortlist is not None:
            _check_shortlist(shortlist, len(members(model)), prefix, constraints)
        k, alpha = search.width, search.ranking_alpha
        nbest = k if search.sampling else search.nbest  # every sample is kept
        self.model, self.k, self.alpha, self.min_len, self.static = model, k, alpha, min_len, static
        self.linear, self.sampling, self.search = linear, search if search.sampling else None, search
        self.models, self.shortlist = members(model), shortlist
        b = src.size(0)
        src_mask = source_mask(self.models[0], src)  # (B, S)
        positions = min(m.cfg.max_positions for m in self.models)  # an ensemble: its shortest member's
        limits = max_output_lengths(src_mask, search.max_len_a, search.max_len_b, positions)  # (B,)
        prefix = src.new_zeros(b, 0) if prefix is None else prefix.to(src.device)
        limits = torch.maximum(limits, (prefix != PAD_ID).sum(dim=1) + 1).clamp(max=positions)  # + EOS
        cons = None if constraints is None else Constraints.of(constraints, src.device)
        if cons is not None:
            limits = (limits + cons.count).clamp(max=positions)  # room for the phrases' tokens
        limit = int(limits.max())
        # a search in dynamic shapes decodes step 1 on one row per sentence, then on k (as CTranslate2)
        width = 1 if not static and self.sampling is None else k
        self.caches = [
            DecoderCache(m, m.encode(src, src_mask), src_mask, b * k, limit, static, b * width)
            for m in self.models
        ]
        keys = torch.zeros(0, dtype=torch.long, device=src.device)
        if search.sampling:
            ids = torch.arange(b, device=src.device) if sentence_ids is None else sentence_ids.to(src.device)
            keys = sample_keys(search.seed, ids, k)
        self.beams = _Beams.start(src, limits, width, nbest, alpha, limit, keys, prefix, cons)
        self.results = _Results(b)

    @property
    def position(self) -> Tensor:
        """() long: the output positions decoded so far."""
        return self.caches[0].position

    def step(self) -> None:
        """Extend every live hypothesis by one token, in place; finish those ending in EOS and those at
        their limit; mark the sentences that are done. Reads nothing on the host."""
        beams, k = self.beams, self.k
        step = self.position + 1  # () long: the output position chosen now, 1-based
        # each model's final decoder states (N * k, d_model)
        states = [m.decode(beams.last, cache=c)[:, -1] for m, c in zip(self.models, self.caches)]
        penalty = length_penalty(step.double(), self.alpha).float()  # () float32
        if self.sampling is None:
            live_scores, reorder = self._search(states, step, penalty)
        else:
            live_scores, reorder = self._sample(states, step, penalty)
        n = beams.scores.size(0)
        at_limit = beams.max_len[:, None] == step  # (N, 1)
        cut = torch.where(at_limit, live_scores / penalty, NEG_INF)  # (N, k): finished as they stand
        if beams.constraints is not None:  # the complete only; where none is, the best found
            complete = beams.constraints.complete(beams.met, beams.inside, k).view(n, k)
            none = (beams.best[:, :1] == NEG_INF) & ~(complete & (cut > NEG_INF)).any(dim=1, keepdim=True)
            cut = torch.where(complete | none, cut, NEG_INF)
        if self.sampling is None:
            cut_scores, cut_pick = cut.topk(beams.best.size(1), dim=1)  # (N, n), best first
            for j in range(cut_pick.size(1)):
                beams.finish(cut_scores[:, j], torch.arange(n, device=cut.device) * k + cut_pick[:, j], step)
            # Done: at the length limit, or no live hypothesis can still beat the n-th best finished one.
            finished = beams.best[:, -1] >= live_scores.max(dim=1).values / beams.lp_max
        else:
            beams.finish_rows(cut > NEG_INF, cut, step, None)
            finished = live_scores.isneginf().all(dim=1)  # every sample ended
        beams.done |= finished | at_limit[:, 0]
        if beams.scores.shape == live_scores.shape:
            beams.scores.copy_(live_scores)
        else:  # the first step of a search in dynamic shapes: from one row per sentence to k
            beams.scores = live_scores
        if self.static and k > 1 and self.sampling is None:  # a beam of 1 and samples extend their own rows
            for cache in self.caches:
                cache.reorder(reorder)

    def _search(self, states: list[Tensor], step: Tensor, penalty: Tensor) -> tuple[Tensor, Tensor]:
        """Beam search's step: rank the extensions, finish the EOS endings among the k best, extend the
        k best others (under constraints, allocated across the banks of constraint tokens met). Returns
        the new live scores (N, k) and the row each row extends (N * k,)."""
        beams, k, width = self.beams, self.k, self.beams.scores.size(1)  # width: rows per sentence now
        repeats, own, banks = self._repeats(step), None, None  # own: the tokens' own log-probabilities
        if beams.constraints is not None:
            (log_probs, tokens, own), (met, inside) = self._constrained_candidates(states, step)
            chosen, banks = (log_probs, tokens), met.sum(dim=2)
        elif len(self.models) == 1 and repeats is None and not beams.prefix.numel():
            shortlist = self.shortlist
            weight = self.models[0].embed.weight if shortlist is None else shortlist.weights[0]
            chosen = best_next_tokens(states[0], weight, step, self.min_len, 2 * k, self.linear)
            if shortlist is not None:  # the shortlist's columns -> its pieces
                chosen = (chosen[0], shortlist.ids[chosen[1]])
        else:
            args = (states, self.model, step, self.min_len, self.linear, repeats, self.shortlist)
            log_probs, own_log_probs = next_log_probs(*args)  # (N * k, V) twice
            log_probs = force_prefix(log_probs, own_log_probs, beams.prefix, step, width)
            chosen = top_n(log_probs, min(2 * k, log_probs.size(-1)))
            own = own_log_probs.gather(1, chosen[1]) if repeats is not None else None
        levels = None if banks is None else beams.constraints.count
        ranked = rank_extensions(beams.scores, *chosen, k, penalty, own, banks, levels)
        live_scores, reorder, new_token, new_score, eos_scores, eos_rows, eos_token_scores, picked = ranked
        for j in range(beams.best.size(1)):  # the n best EOS endings, best first (EOS itself is not output)
            beams.finish(eos_scores[:, j], eos_rows[:, j], step - 1, eos_token_scores[:, j])
        beams.extend(reorder, new_token, new_score, step)
        if banks is not None:  # the constraint state of the extensions taken
            beams.met, beams.inside = met.flatten(0, 1)[picked], inside.flatten()[picked]
        return live_scores, reorder

    def _constrained_candidates(
        self, states: list[Tensor], step: Tensor
    ) -> tuple[tuple[Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]:
        """Under hard constraints (decoding/constraints.py), each row's candidates: its 2k best next
        tokens and those that advance its constraints, EOS only where every phrase is met. Returns
        their (ranking log-probabilities, tokens, own log-probabilities), each (R, m), R = N * k, and
        the constraint state after each (met (R, m, M), inside (R, m))."""
        beams, k, cons = self.beams, self.k, self.beams.constraints
        width = beams.scores.size(1)  # rows per sentence now
        args = (states, self.model, step, self.min_len, self.linear, self._repeats(step), self.shortlist)
        log_probs, own = next_log_probs(*args)  # (R, V) twice
        log_probs = force_prefix(log_probs, own, beams.prefix, step, width)
        complete = cons.complete(beams.met, beams.inside, width)  # (R,)
        eos = torch.arange(log_probs.size(1), device=log_probs.device) == EOS_ID
        log_probs = log_probs.masked_fill(eos & ~complete[:, None], NEG_INF)
        best, tokens = top_n(log_probs, min(2 * k, log_probs.size(1)))  # (R, 2k)
        extra = offered(cons, beams.met, beams.inside, width)  # (R, M)
        repeated = (extra[:, :, None] == tokens[:, None, :]).any(dim=2) | (extra == PAD_ID)
        tokens = torch.cat([tokens, extra], dim=1)  # (R, m)
        # a phrase's pieces are the user's: their own log-probabilities (no repetition control bans them),
        # but none takes the place of a prefix's piece
        offer = force_prefix(own, own, beams.prefix, step, width).gather(1, extra)  # (R, M)
        scores = torch.cat([best, offer.masked_fill(repeated, NEG_INF)], dim=1)  # (R, m)
        state = advanced(cons, beams.met, beams.inside, tokens, width)
        return (scores, tokens, own.gather(1, tokens)), state

    def _sample(self, states: list[Tensor], step: Tensor, penalty: Tensor) -> tuple[Tensor, Tensor]:
        """Sampling's step: each live row draws its next token; one drawing EOS is finished, the others
        extend. Returns the new live scores (N, k) (-inf for rows finished) and the identity reorder."""
        beams = self.beams
        args = (states, self.model, step, self.min_len, self.linear, self._repeats(step), self.shortlist)
        log_probs, own_log_probs = next_log_probs(*args)  # (N * k, V) twice
        log_probs = force_prefix(log_probs, own_log_probs, beams.prefix, step, self.k)
        token = sample_tokens(log_probs, self.sampling, uniform_draws(beams.keys, step))  # (N * k, 1)
        token_score = own_log_probs.gather(1, token).squeeze(1)  # (N * k,)
        live = beams.scores.view(-1) + log_probs.gather(1, token).squeeze(1)  # (N * k,) -inf stays -inf
        ended = (token.squeeze(1) == EOS_ID).view(beams.scores.shape)  # (N, k)
        n = beams.scores.size(0)
        ending = ended & (beams.scores > NEG_INF)  # (N, k): live rows that drew EOS now
        beams.finish_rows(ending, live.view(n, -1) / penalty, step - 1, token_score)
        identity = torch.arange(live.size(0), device=live.device)
        beams.extend(identity, token, token_score, step)
        return live.view(n, -1).masked_fill(ended, NEG_INF), identity

    def _repeats(self, step: Tensor) -> Repeats | None:
        """This step's repetition control over the live hypotheses, None when off."""
        vocab = self.models[0].embed.weight.size(0)
        return Repeats.of(self.beams.tokens, step, vocab, self.search)

    def done(self) -> bool:
        """Whether every sentence is done (a read from the device)."""
        return bool(self.beams.done.all())

    def leave(self) -> bool:
        """The dynamic layout after a step: done sentences leave the batch (their results stored) and
        the caches follow the hypotheses; False once every sentence is done."""
        beams, k = self.beams, self.k
        done = beams.done
        if bool(done.any()):
            self.results.store(beams, done)
            if bool(done.all()):
                self.beams = None
                return False
            sentences = (~done).nonzero().squeeze(1)
            self.beams = beams.keep(sentences, k)
            for cache in self.caches:
                cache.reorder(self.beams.reorder, sentences)
        elif k > 1 and self.sampling is None:
            for cache in self.caches:
                cache.reorder(beams.reorder)
        return True

    def result(self) -> SearchResult:
        if self.beams is not None:
            self.results.store(self.beams, torch.ones_like(self.beams.done))
        return self.results.result()


@torch.inference_mode()
def beam_search(
    model: Transformer | Ensemble,
    src: Tensor,
    search: SearchConfig | None = None,
    min_len: int = 0,
    static: bool = False,
    graphs: bool | None = None,
    linear: Linear = F.linear,
    sentence_ids: Tensor | None = None,
    prefix: Tensor | None = None,
    constraints: list[list[list[int]]] | None = None,
    shortlist: Shortlist | None = None,
) -> SearchResult:
    """The search of `search` (default: §6.1's, beam 4 with the GNMT length penalty; a beam of 1 is
    greedy search), batched over the sentences of src (B, S): rows of pieces + [EOS], padded with
    PAD_ID; the `nbest` best hypotheses per sentence, or `nbest` samples. EOS is held back through step
    `min_len` (benchmarks that force an output length). `static`: in static shapes; `graphs` (default:
    on CUDA) with every step after the first a CUDA graph replay. `linear` makes the output projection
    (`kernels.Products`). sentence_ids, prefix, constraints, shortlist: as `BeamSearch` takes them."""
    search = search or SearchConfig()
    args = (min_len, sentence_ids, prefix, constraints, shortlist)
    run = BeamSearch(model, src, search, static, linear, *args)
    graphs = (static and src.is_cuda) if graphs is None else graphs
    if graphs and not (static and src.is_cuda):
        raise ValueError("CUDA graphs need static=True and the model and src on a CUDA device")
    limit = run.beams.tokens.size(1)
    # graphs record and replay on the streams of the current device: make it src's (cuda:1 too)
    with torch.cuda.device(src.device) if graphs else contextlib.nullcontext():
        step = _graphed(run.step) if graphs else run.step  # with graphs, step 1 ran in the warm-up
        for _ in range(1 if graphs else 0, limit):
            if static:
                if run.done():
                    break
                step()
            else:
                run.step()
                if not run.leave():
                    break
    return run.result()


def rank_extensions(
    scores: Tensor,
    log_probs: Tensor,
    next_tokens: Tensor,
    k: int,
    penalty: float | Tensor,
    own: Tensor | None = None,
    banks: Tensor | None = None,
    levels: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """One step's choice among the extensions of N sentences' k live hypotheses.

    scores (N, k) float32 log P of the live hypotheses; log_probs, next_tokens (N * k, m): the m best
    next tokens of each, ranked by log_probs, their log-probabilities recorded from own (N * k, m) where
    given (repetition control: the model's own); penalty: lp(step). Of each sentence's 2k best
    extensions, the k best not ending in EOS live on, and an EOS among the k best finishes its
    hypothesis; with banks (N * k, m) (hard constraints: the constraint tokens each extension has met,
    of levels (N,) per sentence), the live ones are allocated across the banks from all the extensions
    (`constraints.allocate`). Returns the new live scores (N, k), the old row each new row extends
    (N * k,), its new token (N * k, 1), that token's log-probability (N * k,), and per sentence the EOS
    endings among the k best, best first: their normalized scores (N, k) (-inf where fewer), the rows
    they end (N, k) and EOS's log-probability (N, k); and the extension each new row took (N * k,), an
    index into the N * k * m.
    """
    n, k_in = scores.shape
    m = log_probs.size(-1)
    token_scores = (log_probs if own is None else own).view(n, k_in * m)
    candidates = (scores[:, :, None] + log_probs.view(n, k_in, m)).view(n, k_in * m)
    # the 2k best can hold the k best not ending in EOS (at most k of 2k do); banks choose among all
    pool = 2 * k if banks is None else max(k_in * m, k)
    if candidates.size(1) < pool:  # fewer candidates than asked for: pad with impossible ones
        candidates = F.pad(candidates, (0, pool - candidates.size(1)), value=NEG_INF)
    top_scores, top_index = candidates.topk(pool, dim=1)  # (N, pool), best first
    top_index = top_index.clamp(max=k_in * m - 1)  # padding -> any real candidate (its score stays -inf)
    top_row = torch.arange(n, device=top_index.device)[:, None] * k_in + top_index // m  # (N, pool) old row
    top_token = next_tokens.view(n, k_in * m).gather(1, top_index)  # (N, pool)
    top_token_score = token_scores.gather(1, top_index)  # (N, pool)
    is_eos = top_token == EOS_ID
    # k new live hypotheses: the best candidates that do not end in EOS, or those the banks take
    live = top_scores.masked_fill(is_eos, NEG_INF)
    if banks is None:
        live_scores, pick = live.topk(k, dim=1)  # (N, k)
    else:
        pick = allocate(live, banks.view(n, k_in * m).gather(1, top_index), k, levels)  # (N, k)
        live_scores = live.gather(1, pick)
    picked = (torch.arange(n, device=pick.device)[:, None] * (k_in * m) + top_index.gather(1, pick)).view(-1)
    reorder = top_row.gather(1, pick).view(-1)  # (N * k,)
    new_token = top_token.gather(1, pick).view(-1, 1)  # (N * k, 1)
    new_score = top_token_score.gather(1, pick).view(-1)  # (N * k,)
    eos_scores, eos_pick = (torch.where(is_eos[:, :k], top_scores[:, :k], NEG_INF) / penalty).sort(
        dim=1, descending=True, stable=True
    )  # (N, k)
    eos_rows = top_row[:, :k].gather(1, eos_pick)  # (N, k)
    eos_token_scores = top_token_score[:, :k].gather(1, eos_pick)  # (N, k)
    return live_scores, reorder, new_token, new_score, eos_scores, eos_rows, eos_token_scores, picked


class _Results:
    """The finished hypotheses of every sentence of the batch, filled as sentences finish."""

    def __init__(self, batch_size: int) -> None:
        self.hypotheses: list[list[Hypothesis]] = [[] for _ in range(batch_size)]

    def store(self, beams: _Beams, which: Tensor) -> None:
        """The n best of the sentences `which` (N,) bool of `beams`, those that were found at all."""
        rows = zip(
            beams.ids[which].tolist(),
            beams.best[which].tolist(),
            beams.best_len[which].tolist(),
            beams.best_eos[which].tolist(),
            beams.best_tokens[which].tolist(),
            beams.best_token_scores[which].tolist(),
        )
        for i, scores, lengths, ended, tokens, token_scores in rows:
            found = [
                Hypothesis(t[:length], score, s[: length + eos])  # with EOS's log-probability
                for score, length, eos, t, s in zip(scores, lengths, ended, tokens, token_scores)
                if score > NEG_INF
            ]
            found.sort(key=lambda h: -h.score)  # samples come in their rows' order
            self.hypotheses[i] = found or [Hypothesis([], NEG_INF, [])]

    def result(self) -> SearchResult:
        return SearchResult(self.hypotheses)


def _check_shortlist(
    shortlist: Shortlist, models: int, prefix: Tensor | None, constraints: list[list[list[int]]] | None
) -> None:
    """A shortlist made for these models that holds every piece a prefix or a constraint forces."""
    if len(shortlist.weights) != models:
        raise ValueError(f"a shortlist made for {len(shortlist.weights)} models, used with {models}")
    forced = [] if prefix is None else prefix[prefix != PAD_ID].tolist()
    forced += [t for phrases in constraints or [] for phrase in phrases for t in phrase]
    missing = set(forced) - set(shortlist.ids.tolist())
    if missing:
        raise ValueError(f"pieces {sorted(missing)} are forced but not in the shortlist")


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
