"""Label-smoothed cross-entropy (§5.4, "Label Smoothing": eps_ls = 0.1).

The smoothed target is the fairseq / tensor2tensor one: 1 - eps on the gold token and eps spread
evenly over the other V - 1 tokens of the vocabulary (the pad column included, as in both of them),
so it sums to one and eps = 0 is the plain negative log-likelihood. The loss of one token is the
cross-entropy H(q, p) = -sum_j q_j log p_j (the KL divergence plus the constant entropy of q).

Pad positions of the target contribute nothing. The sum over tokens is returned, not the mean: the
training loop divides by the non-pad target tokens of the whole optimizer step (all accumulated
batches on all ranks), so the result does not depend on how a step is split into batches.

Memory: the (N, V) logits stay in the autocast dtype (bf16 on GPU); each chunk of rows is cast to
float32 for the log-sum-exp and the gradient only while it is being worked on.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from transformer.model import Transformer

CHUNK_ROWS = 4096  # rows of logits cast to float32 at a time; bounds the transient float32 memory


class _SmoothedCrossEntropy(torch.autograd.Function):
    """Sums of the smoothed loss and of the NLL over the rows of (N, V) logits whose target != ignore."""

    @staticmethod
    def forward(
        ctx, logits: Tensor, target: Tensor, epsilon: float, ignore_index: int
    ) -> tuple[Tensor, Tensor]:
        n, vocab = logits.shape
        off = epsilon / (vocab - 1)  # the mass of each non-gold token
        dtype = torch.promote_types(logits.dtype, torch.float32)  # bf16 -> float32; float64 stays
        lse = torch.empty(n, dtype=dtype, device=logits.device)
        loss = logits.new_zeros((), dtype=dtype)
        nll_sum = logits.new_zeros((), dtype=dtype)
        valid = target != ignore_index  # (N,)
        for start in range(0, n, CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            z = logits[rows].to(dtype)  # (n_chunk, V)
            lse[rows] = torch.logsumexp(z, dim=-1)
            nll = lse[rows] - z.gather(-1, target[rows, None]).squeeze(-1)  # -log p_gold
            smooth = vocab * lse[rows] - z.sum(-1)  # -sum_j log p_j
            per_token = (1.0 - epsilon - off) * nll + off * smooth  # -sum_j q_j log p_j
            loss = loss + torch.where(valid[rows], per_token, 0.0).sum()
            nll_sum = nll_sum + torch.where(valid[rows], nll, 0.0).sum()
        ctx.save_for_backward(logits, target, lse, valid)
        ctx.epsilon = epsilon
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor, None, None, None]:
        logits, target, lse, valid = ctx.saved_tensors
        vocab = logits.size(1)
        off = ctx.epsilon / (vocab - 1)
        grad = torch.empty_like(logits)
        for start in range(0, logits.size(0), CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            p = torch.exp(logits[rows].to(lse.dtype) - lse[rows, None])  # softmax, (n_chunk, V)
            g = p - off  # d H(q, p) / d z = p - q, with q = off everywhere but the gold column ...
            g.scatter_add_(-1, target[rows, None], g.new_full((g.size(0), 1), -(1.0 - ctx.epsilon - off)))
            g = g * (grad_loss * valid[rows, None])  # ... and pad rows get no gradient
            grad[rows] = g.to(logits.dtype)
        return grad, None, None, None


def smoothed_cross_entropy(
    logits: Tensor, target: Tensor, epsilon: float, ignore_index: int
) -> tuple[Tensor, Tensor]:
    """logits (N, V), target (N,) -> (sum of the label-smoothed loss, sum of the NLL), float32 scalars
    (float64 for float64 logits).

    Rows whose target is `ignore_index` are left out; the NLL sum is for logging (perplexity) only.
    """
    return _SmoothedCrossEntropy.apply(logits, target, epsilon, ignore_index)


class Seq2SeqLoss(nn.Module):
    """The training objective around a `Transformer`; the module that compile and DDP wrap.

    forward(src (B, S), tgt_in (B, T), tgt_out (B, T)) -> (loss sum, NLL sum) over non-pad targets.
    """

    def __init__(self, model: Transformer, label_smoothing: float) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing

    def forward(self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor) -> tuple[Tensor, Tensor]:
        model = self.model
        src_mask = model.src_mask(src)
        states = model.decoder_states(tgt_in, model.encode(src, src_mask), src_mask)  # (B, T, d_model)
        logits = model.project(states.reshape(-1, states.size(-1)))  # (B * T, V)
        return smoothed_cross_entropy(logits, tgt_out.reshape(-1), self.label_smoothing, model.cfg.pad_id)
