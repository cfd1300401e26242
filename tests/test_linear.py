"""The model's linear maps: oneDNN forward and backward on CPU float32 equal the explicit float64 math."""

import pytest
import torch

from transformer import linear as linear_module
from transformer.linear import Linear, linear, prepacked

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")


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


def test_other_dtypes_and_the_global_switch_fall_back_to_f_linear():
    x, w = torch.randn(4, 8, dtype=torch.float64, requires_grad=True), torch.randn(3, 8, dtype=torch.float64)
    assert type(linear(x, w).grad_fn).__name__ != "_OneDNNLinearBackward"
    torch.testing.assert_close(linear(x, w, relu=True), (x @ w.T).clamp(min=0))
    with torch.backends.mkldnn.flags(enabled=False):
        y = linear(x.detach().float().requires_grad_(), w.float())
    assert type(y.grad_fn).__name__ != "_OneDNNLinearBackward"


def test_module_keeps_nn_linear_parameters_and_keys():
    layer = Linear(8, 3)
    assert isinstance(layer, torch.nn.Linear) and set(layer.state_dict()) == {"weight", "bias"}
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
    with torch.no_grad():
        plain, plain_chunk = linear(x, w, b, relu=True), linear(x, chunk)
        with prepacked([w, chunk, torch.randn(3, 4, dtype=torch.float64)]):
            assert len(linear_module._packed) == 2  # float32 CPU weights only
            packed = linear_module._packed[linear_module._key(w)][2]
            assert packed.layout == torch._mkldnn  # oneDNN's own blocked copy
            torch.testing.assert_close(linear(x, w, b, relu=True), plain, rtol=1e-6, atol=1e-5)
            torch.testing.assert_close(linear(x, chunk), plain_chunk, rtol=1e-6, atol=1e-5)
            with prepacked([w]):  # nested: the copy already made is reused
                assert linear_module._packed[linear_module._key(w)][2] is packed
            w.mul_(2.0)  # changed in place: the stale copy must not be used
            torch.testing.assert_close(linear(x, w, b), x @ w.T + b, rtol=1e-5, atol=1e-5)
        assert linear_module._packed == {}
