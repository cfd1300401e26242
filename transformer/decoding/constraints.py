"""Hard lexical constraints (`constraints`; not in the paper): every output contains every given phrase,
by dynamic beam allocation (Post & Vilar 2018) with phrases generated whole (Hu et al. 2019).

Each step, besides its best next tokens, every hypothesis is offered the tokens that advance a
constraint: the next token of the phrase it is inside, or else the first token of each phrase it has not
met. The candidates are grouped in banks by the constraint tokens they have met, and the k live
hypotheses are allocated across the banks, k // banks each (the rest to the fullest banks that have
candidates, so that even a beam of 1 meets every phrase), the unused slots going to the best of the
others; so hypotheses that meet constraints survive beside the most probable ones. A phrase left before
its end is undone. EOS is allowed only once every phrase is met; a sentence whose search meets them
nowhere within its output limit keeps the best it found.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from transformer.vocab import PAD_ID


@dataclass
class Constraints:
    """The phrases of N sentences, their tokens in a row each: tokens (N, M) padded with PAD_ID; first
    (N, M) bool: a phrase's first token; phrase (N, M): each token's phrase's first position."""

    tokens: Tensor
    first: Tensor
    phrase: Tensor

    @classmethod
    def of(cls, sentences: list[list[list[int]]], device: torch.device) -> Constraints:
        """From each sentence's phrases (lists of token ids)."""
        width = max([sum(map(len, phrases)) for phrases in sentences] + [1])
        tokens = torch.full((len(sentences), width), PAD_ID, dtype=torch.long)
        first = torch.zeros(len(sentences), width, dtype=torch.bool)
        phrase = torch.zeros(len(sentences), width, dtype=torch.long)
        for n, phrases in enumerate(sentences):
            at = 0
            for words in phrases:
                tokens[n, at : at + len(words)] = torch.tensor(words)
                first[n, at] = True
                phrase[n, at : at + len(words)] = at
                at += len(words)
        return cls(tokens.to(device), first.to(device), phrase.to(device))

    def __getitem__(self, sentences: Tensor) -> Constraints:
        """Those of `sentences` (n,) only."""
        return Constraints(self.tokens[sentences], self.first[sentences], self.phrase[sentences])

    def complete(self, met: Tensor, inside: Tensor, k: int) -> Tensor:
        """(N * k,) bool: each row (met (N * k, M), inside (N * k,)) has met every phrase whole."""
        return (met | (rows(self.tokens, k) == PAD_ID)).all(dim=1) & (inside < 0)

    @property
    def count(self) -> Tensor:
        """(N,) the constraint tokens of each sentence."""
        return (self.tokens != PAD_ID).sum(dim=1)


def rows(x: Tensor, k: int) -> Tensor:
    """A sentence's (N, ...) tensor for each of its k rows (N * k, ...)."""
    return x.repeat_interleave(k, dim=0)


def offered(cons: Constraints, met: Tensor, inside: Tensor, k: int) -> Tensor:
    """(N * k, M) the tokens that advance each row's constraints, PAD_ID elsewhere: inside a phrase
    (inside (N * k,) its next position, else -1) its next token; else the first tokens of the phrases
    not met (met (N * k, M))."""
    tokens, first = rows(cons.tokens, k), rows(cons.first, k)
    positions = torch.arange(tokens.size(1), device=tokens.device)
    starts = first & ~met & (inside[:, None] < 0)
    continues = positions == inside[:, None]
    return torch.where(starts | continues, tokens, PAD_ID)


def advanced(cons: Constraints, met: Tensor, inside: Tensor, token: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The state (met (R, m, M), inside (R, m)) after each row of (met (R, M), inside (R,)) takes each of
    its candidate tokens token (R, m)."""
    tokens, first, phrase = rows(cons.tokens, k), rows(cons.first, k), rows(cons.phrase, k)
    m, width = token.size(1), tokens.size(1)
    positions = torch.arange(width, device=token.device)
    met, inside = met[:, None].expand(-1, m, -1), inside[:, None].expand(-1, m)  # (R, m, M), (R, m)
    expected = tokens.gather(1, inside.clamp(min=0)) if width else token  # (R, m) the phrase's next token
    going_on = (inside >= 0) & (token == expected)
    # left before its end: the phrase's tokens met so far are undone
    left = (inside >= 0) & ~going_on
    undone = left[:, :, None] & (phrase[:, None, :] == phrase.gather(1, inside.clamp(min=0))[:, :, None])
    met = met & ~undone
    # a phrase started: the first unmet phrase whose first token this is
    starting = first[:, None, :] & ~met & (tokens[:, None, :] == token[:, :, None]) & ~going_on[:, :, None]
    starting &= torch.cumsum(starting.long(), dim=2) == 1
    hit = starting | (going_on[:, :, None] & (positions == inside[:, :, None]))  # (R, m, M)
    met = met | hit
    after = (hit.long() * (positions + 1)).sum(dim=2)  # the position after the token met (0: none)
    continues = (after > 0) & (after < width)
    continues &= ~first.gather(1, after.clamp(max=width - 1)) & (
        tokens.gather(1, after.clamp(max=width - 1)) != PAD_ID
    )
    return met, torch.where(continues, after, -1)


def allocate(scores: Tensor, banks: Tensor, k: int, levels: Tensor) -> Tensor:
    """(N, k) the candidates (of scores (N, c), -inf: none) that become the live hypotheses: by dynamic
    beam allocation over banks (N, c) (the constraint tokens met, of levels + 1 (N,) banks per
    sentence): k // banks slots each, the rest to the fullest banks with candidates (a beam of 1 takes
    the fullest), unused slots to the best others."""
    n, c = scores.shape
    order = scores.argsort(dim=1, descending=True, stable=True)  # (N, c) best first
    sorted_scores, sorted_banks = scores.gather(1, order), banks.gather(1, order)
    width = int(levels.max()) + 1
    one_hot = torch.nn.functional.one_hot(sorted_banks, width) * sorted_scores.isfinite()[:, :, None]
    rank = (one_hot.cumsum(dim=1) * one_hot).sum(dim=2) - 1  # (N, c) its rank in its bank
    count = levels + 1  # (N,) banks
    share = k // count  # (N,)
    extra = k - share * count  # the fullest banks that have candidates take one more each
    has = one_hot.sum(dim=1) > 0  # (N, banks): a bank with candidates
    from_top = has.flip(1).cumsum(dim=1).flip(1)  # (N, banks): the banks with candidates at or above
    slots = share[:, None] + (has & (from_top <= extra[:, None])).long()
    reserved = (rank < slots.gather(1, sorted_banks)) & sorted_scores.isfinite()  # (N, c)
    # the reserved first (best first within them), then the best of the others
    priority = reserved.float() * 2 + sorted_scores.isfinite().float()
    pick = priority.argsort(dim=1, descending=True, stable=True)[:, :k]  # (N, k)
    return order.gather(1, pick)
