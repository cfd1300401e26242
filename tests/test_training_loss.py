"""Label-smoothed cross-entropy (§5.4) against explicit math and torch's own cross_entropy."""

import math

import pytest
import torch
import torch.nn.functional as F

from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.training import loss as loss_module
from transformer.training.loss import Seq2SeqLoss, smoothed_cross_entropy

PAD = 0


def logits_and_target(n: int = 11, vocab: int = 13, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(n, vocab, generator=g)).to(dtype)
    target = torch.randint(1, vocab, (n,), generator=g)
    target[[2, 7]] = PAD
    return logits, target


def smoothed_distribution(target: torch.Tensor, vocab: int, eps: float) -> torch.Tensor:
    """q: 1 - eps on the gold token, eps / (V - 1) on every other token (fairseq, tensor2tensor)."""
    q = torch.full((len(target), vocab), eps / (vocab - 1), dtype=torch.float64)
    q[torch.arange(len(target)), target] = 1 - eps
    return q


def explicit_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """sum over non-pad rows of H(q, p) = -sum_j q_j log p_j, written out."""
    q = smoothed_distribution(target, logits.size(1), eps)
    per_row = -(q * torch.log_softmax(logits.double(), dim=-1)).sum(-1)
    return per_row[target != PAD].sum()


def test_without_smoothing_it_is_torch_nll():
    logits, target = logits_and_target()
    loss, nll = smoothed_cross_entropy(logits, target, 0.0, PAD)
    expected = F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected)


@pytest.mark.parametrize("eps", [0.1, 0.2, 0.5])
def test_matches_explicit_smoothed_cross_entropy_and_kl(eps):
    logits, target = logits_and_target()
    vocab = logits.size(1)
    q = smoothed_distribution(target, vocab, eps)
    torch.testing.assert_close(q.sum(-1), torch.ones(len(target), dtype=torch.float64))
    loss, nll = smoothed_cross_entropy(logits, target, eps, PAD)
    torch.testing.assert_close(loss, explicit_loss(logits, target, eps))
    # cross-entropy = KL(q || p) + H(q)
    keep = target != PAD
    log_p = torch.log_softmax(logits, dim=-1)[keep]
    kl = F.kl_div(log_p, q[keep], reduction="sum")
    entropy = -(q[keep] * q[keep].log()).sum()
    torch.testing.assert_close(loss, kl + entropy)
    torch.testing.assert_close(nll, F.cross_entropy(logits, target, ignore_index=PAD, reduction="sum"))


def test_matches_torch_label_smoothing_with_rescaled_eps():
    """torch spreads eps' over all V tokens (gold included); eps' = eps V / (V - 1) gives the same q."""
    logits, target = logits_and_target(vocab=29)
    eps = 0.1
    loss, _ = smoothed_cross_entropy(logits, target, eps, PAD)
    expected = F.cross_entropy(
        logits, target, ignore_index=PAD, reduction="sum", label_smoothing=eps * 29 / 28
    )
    torch.testing.assert_close(loss, expected)


def test_gradient_matches_autograd_of_the_explicit_loss():
    logits, target = logits_and_target()
    ours = logits.clone().requires_grad_()
    reference = logits.clone().requires_grad_()
    smoothed_cross_entropy(ours, target, 0.1, PAD)[0].mul(2.5).backward()
    explicit_loss(reference, target, 0.1).mul(2.5).backward()
    torch.testing.assert_close(ours.grad, reference.grad)
    assert ours.grad[target == PAD].abs().max() == 0


def test_padding_changes_nothing():
    logits, target = logits_and_target()
    keep = target != PAD
    full = logits.clone().requires_grad_()
    compact = logits[keep].clone().requires_grad_()
    loss_full, nll_full = smoothed_cross_entropy(full, target, 0.1, PAD)
    loss_compact, nll_compact = smoothed_cross_entropy(compact, target[keep], 0.1, PAD)
    torch.testing.assert_close(loss_full, loss_compact)
    torch.testing.assert_close(nll_full, nll_compact)
    loss_full.backward()
    loss_compact.backward()
    torch.testing.assert_close(full.grad[keep], compact.grad)


def test_chunking_gives_the_same_sums_and_gradients(monkeypatch):
    logits, target = logits_and_target(n=23)
    whole = logits.clone().requires_grad_()
    loss_whole, _ = smoothed_cross_entropy(whole, target, 0.1, PAD)
    loss_whole.backward()
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", 4)
    chunked = logits.clone().requires_grad_()
    loss_chunked, _ = smoothed_cross_entropy(chunked, target, 0.1, PAD)
    loss_chunked.backward()
    torch.testing.assert_close(loss_chunked, loss_whole)
    torch.testing.assert_close(chunked.grad, whole.grad)


def test_bf16_logits_keep_their_dtype_and_are_summed_in_float32():
    logits, target = logits_and_target(dtype=torch.bfloat16)
    logits.requires_grad_()
    loss, _ = smoothed_cross_entropy(logits, target, 0.1, PAD)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(
        loss.double(), explicit_loss(logits.detach(), target, 0.1), rtol=1e-5, atol=1e-4
    )
    loss.backward()
    assert logits.grad.dtype == torch.bfloat16


def test_seq2seq_loss_is_cross_entropy_of_the_model_logits():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0)
    model = Transformer(cfg).double().eval()
    g = torch.Generator().manual_seed(3)
    src = torch.randint(4, 37, (3, 7), generator=g)
    tgt_in = torch.randint(4, 37, (3, 6), generator=g)
    tgt_out = torch.randint(4, 37, (3, 6), generator=g)
    src[1, 5:] = PAD
    tgt_in[2, 4:] = PAD
    tgt_out[2, 4:] = PAD
    loss, nll = Seq2SeqLoss(model, 0.1)(src, tgt_in, tgt_out)
    logits = model(src, tgt_in).reshape(-1, 37)  # (B * T, V)
    torch.testing.assert_close(loss, explicit_loss(logits, tgt_out.reshape(-1), 0.1))
    torch.testing.assert_close(
        nll, F.cross_entropy(logits, tgt_out.reshape(-1), ignore_index=PAD, reduction="sum")
    )
    assert math.isfinite(loss.item())
