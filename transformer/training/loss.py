"""Label-smoothed cross-entropy (§5.4, "Label Smoothing": eps_ls = 0.1).

The smoothed target is the fairseq / tensor2tensor one: 1 - eps on the gold token and eps spread
evenly over the other V - 1 tokens of the vocabulary (the pad column included, as in both of them),
so it sums to one and eps = 0 is the plain negative log-likelihood. The loss of one token is the
cross-entropy H(q, p) = -sum_j q_j log p_j (the KL divergence plus the constant entropy of q).

Pad positions of the target contribute nothing. The sum over tokens is returned, not the mean: the
training loop divides by the non-pad target tokens of the whole optimizer step (all accumulated
batches on all ranks), so the result does not depend on how a step is split into batches.

The loss takes the final decoder states and the output projection's weight, not logits: the (N, V)
logits exist for one chunk of rows at a time (CHUNK_ROWS at most in training), each chunk's gradient
computed at once
(docs/performance.md, "The loss makes the output projection itself"), its products made by the
`kernels.Products` the training hands in (plain `F.linear` by default).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from transformer.kernels import Products
from transformer.model import Transformer
from transformer.moe import Routing, RoutingStats, dropped_fraction, load_balancing_loss
from transformer.vocab import PAD_ID

CHUNK_ROWS = 4096  # target tokens whose logits exist at once; bounds the loss's memory


PLAIN = Products(onednn=False)  # F.linear


def _loss_and_grads(
    states: Tensor,
    weight: Tensor,
    target: Tensor,
    epsilon: float,
    ignore_index: int,
    grads: bool,
    products: Products,
    chunks: int | None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """Sums of the smoothed loss and of the NLL of the logits states (N, d) @ weight (V, d)^T over the
    rows whose target != ignore_index; with `grads`, also d(loss sum)/d states and d/d weight.

    The rows go in `chunks` equal chunks (default: as many as CHUNK_ROWS rows need), padded with
    ignored rows to a multiple of them. Matrix products run in the autocast dtype where autocast is on
    (bf16 on GPU), sums in float32.
    """
    device = states.device.type
    autocast = torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
    total = torch.promote_types(dtype, torch.float32)  # bf16 -> float32; float64 stays
    n_rows = states.size(0)
    # a fixed count keeps the loop's length, and so a compiled graph, the same for every batch size
    chunks = max(1, -(-n_rows // CHUNK_ROWS)) if chunks is None else chunks
    extra = -n_rows % chunks  # (N + extra) rows: `chunks` chunks of equal size
    loss, nll_sum = states.new_zeros((), dtype=total), states.new_zeros((), dtype=total)
    with torch.autocast(device, enabled=False) if autocast else nullcontext():  # dtypes set here
        h = F.pad(states.to(dtype), (0, 0, 0, extra)).unflatten(0, (chunks, -1))  # (chunks, n, d)
        grad_states = states.new_empty(h.shape[:2] + states.shape[1:]) if grads else None  # (chunks, n, d)
        grad_weight = torch.zeros_like(weight, dtype=total) if grads else None
        target = F.pad(target, (0, extra), value=ignore_index).unflatten(0, (chunks, -1))  # (chunks, n)
        w = weight.to(dtype)
        for i in range(chunks):
            chunk = _chunk(h[i], w, target[i], target[i] != ignore_index, epsilon, total, grads, products)
            loss, nll_sum = loss + chunk[0], nll_sum + chunk[1]
            if grads:
                grad_states[i] = chunk[2]
                grad_weight.add_(chunk[3])
    return loss, nll_sum, None if grad_states is None else grad_states.flatten(0, 1)[:n_rows], grad_weight


def _chunk(
    h: Tensor,
    w: Tensor,
    target: Tensor,
    valid: Tensor,
    epsilon: float,
    total: torch.dtype,
    grads: bool,
    products: Products,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
    """`_loss_and_grads` for one chunk of rows h (n, d); its (n, V) tensors are freed on return."""
    vocab = w.size(0)
    off = epsilon / (vocab - 1)  # the mass of each non-gold token
    z = products(h, w).to(total)  # (n, V) logits
    gold, z_sum = z.gather(-1, target[:, None]).squeeze(-1), z.sum(-1)  # (n,) twice
    top = z.amax(-1, keepdim=True)  # (n, 1)
    p = z.sub_(top).exp_()  # in place: exp(z - max), the softmax up to its sum
    p_sum = p.sum(-1, keepdim=True)  # (n, 1)
    lse = (top + p_sum.log()).squeeze(-1)  # (n,) log sum_j exp z_j
    nll = lse - gold  # -log p_gold
    smooth = vocab * lse - z_sum  # -sum_j log p_j
    per_token = (1.0 - epsilon - off) * nll + off * smooth  # -sum_j q_j log p_j
    loss, nll_sum = torch.where(valid, per_token, 0.0).sum(), torch.where(valid, nll, 0.0).sum()
    if not grads:
        return loss, nll_sum, None, None
    g = p.div_(p_sum).sub_(off)  # dH/dz = p - q, q = off everywhere but gold ...
    g.scatter_add_(-1, target[:, None], g.new_full((g.size(0), 1), -(1.0 - epsilon - off)))
    g = g.mul_(valid[:, None]).to(h.dtype)  # ... and pad rows get no gradient
    return (
        loss,
        nll_sum,
        products(g, w.t()),
        products.weight_grad(g, h),
    )  # dH/dh = g W (n, d); dH/dW = g^T h (V, d)


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        states: Tensor,
        weight: Tensor,
        target: Tensor,
        epsilon: float,
        ignore_index: int,
        products: Products,
        chunks: int | None,
    ) -> tuple[Tensor, Tensor]:
        loss, nll_sum, grad_states, grad_weight = _loss_and_grads(
            states, weight, target, epsilon, ignore_index, True, products, chunks
        )
        ctx.save_for_backward(grad_states, grad_weight)
        ctx.weight_dtype = weight.dtype
        ctx.mark_non_differentiable(nll_sum)
        return loss, nll_sum

    @staticmethod
    def backward(ctx, grad_loss: Tensor, _grad_nll: Tensor) -> tuple[Tensor | None, ...]:
        grad_states, grad_weight = ctx.saved_tensors
        return grad_states * grad_loss, (grad_weight * grad_loss).to(ctx.weight_dtype), *[None] * 5


def smoothed_cross_entropy(
    states: Tensor,
    weight: Tensor,
    target: Tensor,
    epsilon: float,
    ignore_index: int,
    products: Products = PLAIN,
    chunks: int | None = None,
) -> tuple[Tensor, Tensor]:
    """The label-smoothed cross-entropy of the logits states (N, d) @ weight (V, d)^T against target
    (N,) -> (sum of the loss, sum of the NLL), float32 scalars (float64 for float64 inputs).

    Rows whose target is `ignore_index` are left out; the NLL sum is for logging (perplexity) only.
    The logits exist for one of `chunks` chunks of rows at a time (default: CHUNK_ROWS rows each).
    """
    if torch.is_grad_enabled() and (states.requires_grad or weight.requires_grad):
        return _SmoothedCrossEntropy.apply(states, weight, target, epsilon, ignore_index, products, chunks)
    return _loss_and_grads(states, weight, target, epsilon, ignore_index, False, products, chunks)[:2]


class Seq2SeqLoss(nn.Module):
    """The training objective around a `Transformer`; the module that compile and DDP wrap.

    forward(src (B, S), tgt_in (B, T), tgt_out (B, T)) -> (loss sum, NLL sum, figures) over non-pad
    targets; `figures`: with mixtures of experts in training, {"moe_dropped": the share of assignments
    past capacity} (a device scalar), else empty. In training the loss includes the experts'
    load-balancing loss, `model.moe_aux_loss` times its sum over the layers per target token.
    """

    def __init__(
        self,
        model: Transformer,
        label_smoothing: float,
        products: Products = PLAIN,
        chunks: int | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.label_smoothing = label_smoothing
        self.products = products
        self.chunks = chunks  # of the loss's rows (`smoothed_cross_entropy`): fixed, one graph fits all
        self.cross_entropy = smoothed_cross_entropy

    def compile_regions(self) -> None:
        """torch.compile, with dynamic shapes, where the step spends its time: each layer and the loss.
        The layers of a stack share one compiled graph, so compiling costs one encoder and one decoder
        layer, and every batch shape runs through the same graphs."""
        for layer in (*self.model.encoder, *self.model.decoder):
            layer.compile(dynamic=True)
        self.cross_entropy = torch.compile(smoothed_cross_entropy, dynamic=True)

    def forward(
        self, src: Tensor, tgt_in: Tensor, tgt_out: Tensor
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        model = self.model
        src_mask = model.src_mask(src)
        routed: list[RoutingStats] = []  # what mixtures of experts report in training
        encoder = decoder = None
        if self.training:
            encoder, decoder = Routing(src_mask, routed), Routing(tgt_in != PAD_ID, routed)
        memory = model.encode(src, src_mask, encoder)
        states = model.decode(tgt_in, memory, src_mask, routing=decoder)  # (B, T, d_model)
        # the pre-softmax projection (§3.4) happens inside the loss, a chunk of rows at a time
        loss, nll = self.cross_entropy(
            states.reshape(-1, states.size(-1)),  # (B * T, d_model)
            model.embed.weight,  # (V, d_model)
            tgt_out.reshape(-1),
            self.label_smoothing,
            PAD_ID,
            self.products,
            self.chunks,
        )
        if not routed:
            return loss, nll, {}
        loss = loss + model.cfg.moe_aux_loss * load_balancing_loss(routed) * (tgt_out != PAD_ID).sum()
        return loss, nll, {"moe_dropped": dropped_fraction(routed)}
