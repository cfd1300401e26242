"""The CPU kernels (transformer/kernels/): oneDNN linear maps, forward and backward, against the explicit
float64 math; written-out short attention and noise dropout against their plain counterparts; and the
module replacements of `Kernels.apply`, which keep the model's parameters, keys and outputs and leave
the model they copy untouched."""

import copy
import math

import pytest
import torch
from conftest import sdpa_calls, sources
from torch.utils._python_dispatch import TorchDispatchMode

from transformer.attention import MultiHeadAttention
from transformer.config import ModelConfig
from transformer.kernels import Kernels, Products
from transformer.kernels.cpu import FEW_QUERIES, NARROW_HEAD, SHORT_KEYS, NoiseDropout, ShortAttention
from transformer.model import Transformer

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")
linear = Products(onednn=True)
CPU = Kernels.choose(torch.device("cpu"), "on")


class OpsCalled(TorchDispatchMode):
    """The ATen ops run within the block, by name, with the layouts of their tensor arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.layout]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        layouts = [a.layout for a in args if isinstance(a, torch.Tensor)]
        self.calls.append((func.overloadpacket.__name__, layouts))
        return func(*args, **(kwargs or {}))

    def count(self, name: str) -> int:
        return sum(called == name for called, _ in self.calls)


@onednn
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
# 80 rows (the last shape) are enough for weight_grad's other order of the product
@pytest.mark.parametrize("shape", [(7, 24), (3, 5, 24), (2, 40, 24)])
def test_forward_and_gradients_match_float64_math(shape, bias, relu):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g, requires_grad=True)
    w = torch.randn(40, 24, generator=g, requires_grad=True)
    b = torch.randn(40, generator=g, requires_grad=True) if bias else None
    y = linear(x, w, b, relu=relu)
    assert type(y.grad_fn).__name__ == "_OneDNNLinearBackward"  # the path under test was taken
    grad_y = torch.randn(y.shape, generator=g)
    y.backward(grad_y)

    x64, w64, gy64 = x.detach().double(), w.detach().double(), grad_y.double()
    expected = x64 @ w64.T + (b.detach().double() if bias else 0)
    if relu:  # max(0, .), and no gradient flows where it clipped
        assert (expected < 0).any() and (expected > 0).any()
        gy64 = gy64 * (expected > 0)
        expected = expected.clamp(min=0)
    torch.testing.assert_close(y.detach().double(), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), gy64 @ w64, rtol=1e-5, atol=1e-5)  # dL/dx = dL/dy W
    gy2, x2 = gy64.reshape(-1, 40), x64.reshape(-1, 24)
    torch.testing.assert_close(w.grad.double(), gy2.T @ x2, rtol=1e-5, atol=1e-5)  # dL/dW = dL/dy^T x
    assert w.grad.is_contiguous()
    if bias:
        torch.testing.assert_close(b.grad.double(), gy2.sum(0), rtol=1e-5, atol=1e-5)


@onednn
def test_strided_input_weight_update_and_inference_path():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 9, generator=g).t()  # (9, 24), not contiguous
    w = torch.randn(16, 24, generator=g)
    with torch.no_grad():
        torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        w.add_(1.0)  # an optimizer step changes the weight in place (outside prepacked: never cached)
        torch.testing.assert_close(linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(linear(x, w, relu=True), (x @ w.T).clamp(min=0), rtol=1e-5, atol=1e-5)


def test_other_dtypes_the_global_switch_and_plain_products_fall_back_to_f_linear():
    x, w = torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(3, 8, dtype=torch.float64)
    assert type(linear(x, w).grad_fn).__name__ != "_OneDNNLinearBackward"
    torch.testing.assert_close(linear(x, w, relu=True), (x @ w.T).clamp(min=0))
    x32, w32 = x.detach().float().requires_grad_(), w.float()
    with torch.backends.mkldnn.flags(enabled=False):
        y = linear(x32, w32)
    assert type(y.grad_fn).__name__ != "_OneDNNLinearBackward"
    plain = Products(onednn=False)
    assert type(plain(x32, w32).grad_fn).__name__ != "_OneDNNLinearBackward"
    torch.testing.assert_close(
        plain.weight_grad(x32.detach(), torch.ones(4, 2)), x32.detach().T @ torch.ones(4, 2)
    )


def test_no_rows_give_no_rows_and_zero_weight_gradients():
    """An expert no token chose multiplies no rows, and must still give its weights a gradient."""
    x, w = torch.randn(0, 8, requires_grad=True), torch.randn(3, 8, requires_grad=True)
    b = torch.randn(3, requires_grad=True)
    y = linear(x, w, b, relu=True)
    assert y.shape == (0, 3)
    y.sum().backward()
    assert torch.equal(w.grad, torch.zeros(3, 8)) and torch.equal(b.grad, torch.zeros(3))


def test_module_keeps_nn_linear_parameters_and_keys():
    plain = torch.nn.Linear(8, 3)
    layer = CPU.apply(plain)
    assert type(layer).__name__ == "OneDNNLinear" and type(plain) is torch.nn.Linear
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
    assert layer.weight is plain.weight and layer.bias is plain.bias
    x = torch.randn(2, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_bias_alone_that_needs_its_gradient_gets_it():
    x, w = torch.randn(5, 8), torch.randn(3, 8)
    b = torch.zeros(3, requires_grad=True)
    grad_y = torch.randn(5, 3)
    linear(x, w, b).backward(grad_y)
    torch.testing.assert_close(b.grad, grad_y.sum(0))


@onednn
def test_prepacked_weights_give_the_same_products_and_follow_in_place_changes():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(6, 24, generator=g), torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    chunk = w[8:24]  # a view (a vocabulary chunk) is packed on its own
    products = Products(onednn=True)
    with torch.no_grad():
        plain, plain_chunk = products(x, w, b, relu=True), products(x, chunk)
        with OpsCalled() as entry, products.prepacked([w, chunk, torch.randn(3, 4, dtype=torch.float64)]):
            assert entry.count("_reorder_linear_weight") == 2  # float32 CPU weights only, once each
            with OpsCalled() as ops:
                torch.testing.assert_close(products(x, w, b, relu=True), plain, rtol=1e-6, atol=1e-5)
                torch.testing.assert_close(products(x, chunk), plain_chunk, rtol=1e-6, atol=1e-5)
                with products.prepacked([w]):  # nested: the copy already made is reused
                    pass
            assert ops.count("_reorder_linear_weight") == 0  # oneDNN's own blocked copies, made on entry
            assert [
                torch._mkldnn in layouts for name, layouts in ops.calls if name == "_linear_pointwise"
            ] == [
                True,
                True,
            ]
            w.mul_(2.0)  # changed in place: the stale copy must not be used
            torch.testing.assert_close(products(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-5)
        with OpsCalled() as after:  # outside the block: plain weights again
            products(x, chunk)
        assert [torch._mkldnn in layouts for name, layouts in after.calls if name == "_linear_pointwise"] == [
            False
        ]


@pytest.mark.parametrize("kind", ["encoder_self", "decoder_self", "cross"])
def test_short_attention_is_written_out_and_longer_attention_fused(kind, monkeypatch):
    torch.manual_seed(0)
    attn = MultiHeadAttention(32, 4, 8, 8, 2, 0.0, cross=kind == "cross", causal=kind == "decoder_self")
    attn = attn.double().eval()
    x, memory = torch.randn(2, 5, 32, dtype=torch.float64), torch.randn(2, 7, 32, dtype=torch.float64)
    key_mask = (
        None if kind == "decoder_self" else torch.ones(2, 7 if kind == "cross" else 5, dtype=torch.bool)
    )
    if key_mask is not None:
        key_mask[1, -2:] = False
    expected = attn(x, memory, key_mask)  # the plain module: the fused kernel
    attn = CPU.apply(attn)
    assert type(attn) is ShortAttention

    def check(fused_calls: int, grad: bool = True, module: torch.nn.Module = attn, tolerance: float = 1e-10):
        with torch.set_grad_enabled(grad), sdpa_calls(monkeypatch) as calls:
            x_, memory_ = (t.to(next(module.parameters()).dtype) for t in (x, memory))
            out = module(x_, memory_, key_mask).double()
        torch.testing.assert_close(out, expected, rtol=tolerance, atol=tolerance)
        assert len(calls) == fused_calls

    check(0, grad=False)  # 5 or 7 keys: written out at inference,
    check(0)  # and in training with heads of 8 dimensions
    monkeypatch.setattr("transformer.kernels.cpu.NARROW_HEAD", 4)  # wider heads than that:
    check(0, grad=False)  # written out at inference,
    check(1)  # fused in float32 training,
    check(0, module=copy.deepcopy(attn).to(torch.bfloat16), tolerance=0.1)  # written out in bf16 training
    frozen = copy.deepcopy(attn).requires_grad_(False)
    check(0, module=frozen)  # and where no gradient flows, as at inference
    monkeypatch.setattr("transformer.kernels.cpu.SHORT_KEYS", 0)  # longer attention:
    monkeypatch.setattr("transformer.kernels.cpu.NARROW_HEAD", 32)
    check(1)  # fused in training whatever the heads,
    check(0, grad=False)  # written out at inference with a few (5) queries,
    monkeypatch.setattr("transformer.kernels.cpu.FEW_QUERIES", 4)
    check(1, grad=False)  # and fused with more
    assert (SHORT_KEYS, FEW_QUERIES, NARROW_HEAD) == (64, 16, 32)


@pytest.mark.parametrize("dropout", [torch.nn.Dropout, NoiseDropout])
def test_dropout_zeroes_each_unit_with_probability_p_and_scales_the_rest(dropout):
    """§5.4 P_drop, torch's and the noise-drawn one alike: in training a unit is zeroed with probability
    p, independently of the others, and the rest are scaled by 1 / (1 - p) (forward and backward); in
    evaluation it is the identity."""
    torch.manual_seed(0)
    p, n = 0.3, 1_000_000
    drop = dropout(p)
    x = (torch.rand(1000, 1000) + 0.5).requires_grad_()  # no zeros of its own
    y = drop(x)
    kept = y != 0
    tolerance = 5 * math.sqrt(p * (1 - p) / (n / 2))  # five standard deviations of a binomial fraction
    for half in (kept[:500], kept[500:], kept[:, ::2], kept[:, 1::2]):  # the same rate everywhere
        assert abs((~half).float().mean().item() - p) < tolerance
    torch.testing.assert_close(y[kept], x[kept] / (1 - p))
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.float() / (1 - p))
    assert (kept != (drop(x) != 0)).float().mean().item() > 0.3  # a new mask at every call
    assert torch.equal(drop.eval()(x), x) and torch.equal(dropout(0.0)(x), x)


@pytest.mark.parametrize("dropout", [torch.nn.Dropout, NoiseDropout])
def test_dropout_of_bf16_activations_keeps_the_rate_p(dropout):
    """Under bf16 autocast the activations dropout sees are bf16: a unit is still zeroed with probability
    p (noise drawn in bf16 has 8 bits, which would round p = 0.1 up to 26/256), the rest scaled by
    1 / (1 - p) in bf16."""
    torch.manual_seed(0)
    p, n = 0.1, 4_000_000
    y = dropout(p)(torch.ones(n, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert abs((y == 0).float().mean().item() - p) < 5 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(y[y != 0].unique(), torch.tensor([1 / (1 - p)], dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "overrides", [{}, {"norm_first": True, "n_kv_heads": 2}, {"moe_experts": 16, "moe_top_k": 1}]
)
def test_the_cpu_kernels_keep_the_parameters_keys_outputs_and_gradients(overrides):
    cfg = ModelConfig(vocab_size=40, d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.1, **overrides)
    torch.manual_seed(0)
    plain, model = Transformer(cfg), Transformer(cfg)
    model.load_state_dict(plain.state_dict())
    fast = CPU.apply(model)
    assert {type(m).__name__ for m in fast.modules()} >= {"OneDNNLinear", "NoiseDropout", "ShortAttention"}
    assert {type(m).__name__ for m in model.modules()}.isdisjoint(
        {"OneDNNLinear", "ShortAttention"}
    )  # as it was
    assert fast.state_dict().keys() == plain.state_dict().keys()
    assert all(a is b for a, b in zip(model.parameters(), fast.parameters(), strict=True))  # the same tensors
    src, tgt = sources([5, 3, 7], 40), sources([4, 6, 2], 40)
    for model in (plain, fast):
        model.eval()  # dropout off: the two draw their masks differently
        model(src, tgt).logsumexp(-1).sum().backward()
    torch.testing.assert_close(fast(src, tgt), plain(src, tgt), rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(plain.named_parameters(), fast.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("relu", [False, True])
def test_int8_products_are_the_8_bit_weights_times_the_input_within_the_activations_rounding(relu):
    """prepacked(int8=True): weights rounded to 8 bits per output row (symmetric, scale = max|w| / 127),
    activations rounded per call to at most 256 levels over their range; so each output is the product
    with the rounded weights, off by at most half an activation step times the row's sum of |w|."""
    g = torch.Generator().manual_seed(0)
    x, w, b = (
        torch.randn(6, 48, generator=g),
        torch.randn(40, 48, generator=g) * 0.1,
        torch.randn(40, generator=g),
    )
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    w8 = (w / scale).round().clamp(-127, 127) * scale  # (N, K): what the 8-bit weights stand for
    expected = x @ w8.T + b
    bound = (x.max() - x.min()) / 127 / 2 * w8.abs().sum(dim=1)  # (N,): 7-bit activations, the coarser case
    with torch.inference_mode(), linear.prepacked([(w, b)], int8=True):
        y = linear(x, w, b, relu=relu)
        with pytest.raises(ValueError, match="another bias"):
            linear(x, w, torch.zeros(40))
    if relu:
        expected = expected.clamp(min=0)
    assert ((y - expected).abs() <= bound + 1e-5).all()
    assert (y - expected).abs().max() > 0  # the activations were rounded indeed
    assert not torch.allclose(w8, w)  # and the weights


def test_int8_packing_follows_in_place_changes_and_the_innermost_blocks_precision():
    g = torch.Generator().manual_seed(1)
    x, w, b = torch.randn(5, 32, generator=g), torch.randn(24, 32, generator=g), torch.randn(24, generator=g)
    with torch.inference_mode():
        with linear.prepacked([(w, b)], int8=True):
            int8 = linear(x, w, b)
        assert not torch.allclose(int8, x @ w.T + b, atol=1e-5)  # rounded: the 8-bit path was taken
        with linear.prepacked([w]), linear.prepacked([(w, b)], int8=True):  # the inner block's precision wins
            torch.testing.assert_close(linear(x, w, b), int8)
        with linear.prepacked([(w, b)], int8=True):
            b.add_(1.0)  # the packed bias changed in place: the float product, with the new bias
            torch.testing.assert_close(linear(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-5)
