"""Label-smoothed cross-entropy (§5.4) against explicit math and torch's own cross_entropy."""

import math
from contextlib import nullcontext

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from transformer.config import ModelConfig
from transformer.data.batching import pad_batch
from transformer.kernels import Kernels
from transformer.model import Transformer
from transformer.training import loss as loss_module
from transformer.training.distributed import attention_backends
from transformer.training.loss import Seq2SeqLoss, smoothed_cross_entropy

PAD = 0


def states_weight_and_target(n: int = 11, vocab: int = 13, d: int = 5, seed: int = 0, dtype=torch.float64):
    """Final decoder states (n, d), an output projection (vocab, d) and targets with two pads."""
    g = torch.Generator().manual_seed(seed)
    states = torch.randn(n, d, generator=g).to(dtype)
    weight = (1.5 * torch.randn(vocab, d, generator=g)).to(dtype)
    target = torch.randint(1, vocab, (n,), generator=g)
    target[[2, 7]] = PAD
    return states, weight, target


def smoothed_distribution(target: torch.Tensor, vocab: int, eps: float) -> torch.Tensor:
    """q: 1 - eps on the gold token, eps / (V - 1) on every other token (fairseq, tensor2tensor)."""
    q = torch.full((len(target), vocab), eps / (vocab - 1), dtype=torch.float64, device=target.device)
    q[torch.arange(len(target), device=target.device), target] = 1 - eps
    return q


def explicit_loss(logits: torch.Tensor, target: torch.Tensor, eps: float) -> torch.Tensor:
    """sum over non-pad rows of H(q, p) = -sum_j q_j log p_j, written out."""
    q = smoothed_distribution(target, logits.size(1), eps)
    per_row = -(q * torch.log_softmax(logits.double(), dim=-1)).sum(-1)
    return per_row[target != PAD].sum()


def test_without_smoothing_it_is_torch_nll():
    states, weight, target = states_weight_and_target()
    loss, nll = smoothed_cross_entropy(states, weight, target, 0.0, PAD)
    expected = F.cross_entropy(states @ weight.T, target, ignore_index=PAD, reduction="sum")
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(nll, expected)


@pytest.mark.parametrize("eps", [0.1, 0.2, 0.5])
def test_matches_explicit_smoothed_cross_entropy_and_kl(eps):
    states, weight, target = states_weight_and_target()
    logits = states @ weight.T
    vocab = logits.size(1)
    q = smoothed_distribution(target, vocab, eps)
    torch.testing.assert_close(q.sum(-1), torch.ones(len(target), dtype=torch.float64))
    loss, nll = smoothed_cross_entropy(states, weight, target, eps, PAD)
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
    states, weight, target = states_weight_and_target(vocab=29)
    eps = 0.1
    loss, _ = smoothed_cross_entropy(states, weight, target, eps, PAD)
    expected = F.cross_entropy(
        states @ weight.T, target, ignore_index=PAD, reduction="sum", label_smoothing=eps * 29 / 28
    )
    torch.testing.assert_close(loss, expected)


def fused_and_reference_grads(states, weight, target, eps=0.1, scale=2.5):
    """Gradients of scale x the loss w.r.t. states and weight: ours, and autograd through the explicit
    loss of the explicit logits."""
    ours = [states.clone().requires_grad_(), weight.clone().requires_grad_()]
    reference = [states.clone().requires_grad_(), weight.clone().requires_grad_()]
    smoothed_cross_entropy(*ours, target, eps, PAD)[0].mul(scale).backward()
    explicit_loss(reference[0] @ reference[1].T, target, eps).mul(scale).backward()
    return [t.grad for t in ours], [t.grad for t in reference]


def test_gradients_match_autograd_of_the_explicit_loss():
    states, weight, target = states_weight_and_target()
    (grad_states, grad_weight), (ref_states, ref_weight) = fused_and_reference_grads(states, weight, target)
    torch.testing.assert_close(grad_states, ref_states)
    torch.testing.assert_close(grad_weight, ref_weight)
    assert grad_states[target == PAD].abs().max() == 0
    assert grad_states[target != PAD].abs().min() > 0


def test_a_second_backward_of_a_retained_graph_gives_the_same_gradients():
    states, weight, target = states_weight_and_target()
    states.requires_grad_()
    loss, _ = smoothed_cross_entropy(states, weight, target, 0.1, PAD)
    first = torch.autograd.grad(loss, states, retain_graph=True)[0]
    second = torch.autograd.grad(3 * loss, states)[0]
    torch.testing.assert_close(second, 3 * first)


def test_without_gradients_the_sums_are_the_same():
    states, weight, target = states_weight_and_target()
    with torch.no_grad():
        plain = smoothed_cross_entropy(states.requires_grad_(), weight, target, 0.1, PAD)
    assert not plain[0].requires_grad
    fused = smoothed_cross_entropy(states, weight, target, 0.1, PAD)
    assert fused[0].requires_grad
    torch.testing.assert_close(plain, tuple(t.detach() for t in fused))


def test_padding_changes_nothing():
    states, weight, target = states_weight_and_target()
    keep = target != PAD
    full = states.clone().requires_grad_()
    compact = states[keep].clone().requires_grad_()
    loss_full, nll_full = smoothed_cross_entropy(full, weight, target, 0.1, PAD)
    loss_compact, nll_compact = smoothed_cross_entropy(compact, weight, target[keep], 0.1, PAD)
    torch.testing.assert_close(loss_full, loss_compact)
    torch.testing.assert_close(nll_full, nll_compact)
    loss_full.backward()
    loss_compact.backward()
    torch.testing.assert_close(full.grad[keep], compact.grad)


@pytest.mark.parametrize(
    "n, chunk_rows, chunks",
    [(23, 4, None), (23, 4096, 5), (23, 4096, 23), (3, 4096, 4), (0, 4096, 3), (0, 4096, None)],
)
def test_chunking_gives_the_same_sums_and_gradients(monkeypatch, n, chunk_rows, chunks):
    """Chunks of CHUNK_ROWS rows (6 of 4, the last of 3), a fixed number of them (rows padded to a
    multiple, more chunks than rows), and no rows at all: the explicit loss and its gradients."""
    states, weight, target = states_weight_and_target(n=max(n, 8))
    states, target = states[:n], target[:n]
    monkeypatch.setattr(loss_module, "CHUNK_ROWS", chunk_rows)
    chunked = [states.clone().requires_grad_(), weight.clone().requires_grad_()]
    loss, nll = smoothed_cross_entropy(*chunked, target, 0.1, PAD, chunks=chunks)
    loss.backward()
    whole = [states.clone().requires_grad_(), weight.clone().requires_grad_()]
    reference = explicit_loss(F.linear(*whole), target, 0.1)
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, explicit_loss(F.linear(states, weight), target, 0.0))
    for ours, expected in zip(chunked, whole):
        torch.testing.assert_close(ours.grad, expected.grad)


def test_under_bf16_autocast_products_are_bf16_and_sums_float32():
    """As the unfused reference under autocast: bf16 logits, float32 loss, float32 parameter grads."""
    states, weight, target = states_weight_and_target(n=40, vocab=300, d=16, dtype=torch.float32)
    ours = [states.clone().requires_grad_(), weight.clone().requires_grad_()]
    reference = [states.clone().requires_grad_(), weight.clone().requires_grad_()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = smoothed_cross_entropy(*ours, target, 0.1, PAD)
        logits = F.linear(*reference)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected = explicit_loss(logits.float(), target, 0.1)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-4)
    loss.backward()
    expected.backward()
    for t, r in zip(ours, reference):
        assert t.grad.dtype == torch.float32
        torch.testing.assert_close(t.grad, r.grad, rtol=0.02, atol=0.02 * r.grad.abs().max().item())


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
    loss, nll, _ = Seq2SeqLoss(model, 0.1)(src, tgt_in, tgt_out)
    logits = model(src, tgt_in).reshape(-1, 37)  # (B * T, V)
    torch.testing.assert_close(loss, explicit_loss(logits, tgt_out.reshape(-1), 0.1))
    torch.testing.assert_close(
        nll, F.cross_entropy(logits, tgt_out.reshape(-1), ignore_index=PAD, reduction="sum")
    )
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("kernels", ["plain", "cpu"])
def test_the_same_pairs_padded_to_two_bucket_shapes_give_equal_loss_and_gradients(kernels):
    """A length bucket pads a batch's pairs further, both sides to one length, and adds empty pairs
    (trainer.length_buckets): the loss, its token counts and every gradient stay as without."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=37, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0)
    chosen = Kernels.choose(torch.device("cpu"), "on" if kernels == "cpu" else "off")
    model = chosen.apply(Transformer(cfg))
    objective = Seq2SeqLoss(model, 0.1, chosen.products)
    g = torch.Generator().manual_seed(4)
    src_lengths, tgt_lengths = np.array([5, 2, 7]), np.array([6, 3, 4])
    src_ids = torch.randint(4, 37, (int(src_lengths.sum()),), generator=g).numpy()
    tgt_ids = torch.randint(4, 37, (int(tgt_lengths.sum()),), generator=g).numpy()
    results = []
    for shape in (None, (4, 16), (9, 24)):
        batch = pad_batch(src_ids, src_lengths, tgt_ids, tgt_lengths, 8, shape)
        model.zero_grad()
        loss, nll, _ = objective(batch.src, batch.tgt_in, batch.tgt_out)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((batch.n_tgt_tokens, loss.detach(), nll.detach(), grads))
    tight = results[0]
    for padded in results[1:]:
        assert padded[0] == tight[0] == int(tgt_lengths.sum()) + 3
        torch.testing.assert_close(padded[1], tight[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded[2], tight[2], rtol=1e-5, atol=1e-5)
        for a, b in zip(padded[3], tight[3]):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_no_vocabulary_sized_activation_is_kept_for_backward():
    """What autograd keeps from the forward pass: nothing with a row per target token and a column
    per vocabulary entry (the logits, their softmax or gradient)."""
    cfg = ModelConfig(vocab_size=101, d_model=16, n_heads=2, d_ff=32, n_layers=1, dropout=0.1)
    objective = Seq2SeqLoss(Transformer(cfg), 0.1)
    src, tgt = torch.randint(4, 101, (3, 7)), torch.randint(4, 101, (3, 6))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss, _, _ = objective(src, tgt, tgt)
    assert saved and (3 * 6, 16) in saved  # the gradient of the states is kept
    assert not [shape for shape in saved if shape[-1] == 101 and shape.numel() >= 3 * 6 * 101]
    loss.backward()
    assert objective.model.embed.weight.grad.abs().sum() > 0


def _cuda_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


@pytest.mark.gpu
def test_cuda_bf16_autocast_matches_the_unfused_loss_and_cpu_float32():
    """Two chunks of rows on the GPU under autocast: as autograd through bf16 logits (F.linear under
    autocast, the explicit loss in float32), and the loss as on the CPU in float32."""
    _cuda_or_skip()
    states, weight, target = states_weight_and_target(n=5000, vocab=3000, d=64, dtype=torch.float32)
    ours = [states.cuda().requires_grad_(), weight.cuda().requires_grad_()]
    reference = [states.cuda().requires_grad_(), weight.cuda().requires_grad_()]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, _ = smoothed_cross_entropy(*ours, target.cuda(), 0.1, PAD)
        logits = F.linear(*reference)
    assert logits.dtype == torch.bfloat16 and loss.dtype == torch.float32
    expected = explicit_loss(logits.float(), target.cuda(), 0.1)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-3)
    cpu_loss, _ = smoothed_cross_entropy(states, weight, target, 0.1, PAD)
    torch.testing.assert_close(loss.cpu(), cpu_loss, rtol=1e-2, atol=0.0)
    loss.backward()
    expected.backward()
    for t, r in zip(ours, reference):
        assert t.grad.dtype == torch.float32
        torch.testing.assert_close(t.grad, r.grad, rtol=0.02, atol=0.02 * r.grad.abs().max().item())


@pytest.mark.gpu
def test_cuda_compiled_objective_matches_eager():
    """The objective compiled as training compiles it (by regions) against eager, in bf16."""
    _cuda_or_skip()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=501, d_model=64, n_heads=4, d_ff=128, n_layers=2, dropout=0.0)
    eager = Seq2SeqLoss(Transformer(cfg), 0.1).cuda()
    compiled = Seq2SeqLoss(Transformer(cfg), 0.1, chunks=2).cuda()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_regions()
    _assert_same_bf16_step(eager, compiled, nullcontext(), nullcontext())


@pytest.mark.gpu
@pytest.mark.parametrize("backends", [["flash", "efficient"], ["cudnn", "math"], ["math"]])
def test_cuda_attention_backends_give_the_loss_and_gradients_of_torchs_choice(backends):
    """trainer.attention_backends: every allowed set gives the step of torch's own choice, in bf16."""
    _cuda_or_skip()
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=501, d_model=64, n_heads=4, d_ff=128, n_layers=2, dropout=0.0)
    chosen = Seq2SeqLoss(Transformer(cfg), 0.1).cuda()
    allowed = Seq2SeqLoss(Transformer(cfg), 0.1).cuda()
    allowed.load_state_dict(chosen.state_dict())
    _assert_same_bf16_step(chosen, allowed, attention_backends(None), attention_backends(backends))


def _assert_same_bf16_step(reference: Seq2SeqLoss, other: Seq2SeqLoss, *contexts) -> None:
    """One bf16 forward and backward of each on the same padded batch: equal within bf16 noise."""
    src, tgt = torch.randint(4, 501, (8, 16), device="cuda"), torch.randint(4, 501, (8, 16), device="cuda")
    src[2, 11:] = PAD
    tgt[1, 9:] = PAD
    losses = []
    for module, context in zip((reference, other), contexts):
        with context, torch.autocast("cuda", dtype=torch.bfloat16):
            loss, _, _ = module(src, tgt, tgt)
            loss.backward()
        losses.append(loss.detach())
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-2, atol=0.0)
    for (name, p), q in zip(reference.named_parameters(), other.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0.05, atol=0.02 * p.grad.abs().max().item(), msg=name)
