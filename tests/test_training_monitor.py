"""Model FLOPs for MFU against torch's FLOP counter, and the bf16 peak lookup."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from transformer.attention import record_attention
from transformer.config import ModelConfig
from transformer.model import Transformer
from transformer.training import monitor
from transformer.training.loss import Seq2SeqLoss


@pytest.mark.parametrize("shape", [{}, {"n_kv_heads": 2}, {"d_k": 16, "d_v": 8}])
def test_train_flops_match_the_counted_matmuls_of_forward_and_backward(shape):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_layers=2, **shape)
    objective = Seq2SeqLoss(Transformer(cfg), 0.1)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    # the reference attention path and F.linear are plain matmuls, which the counter sees (the fused
    # CPU attention kernel and the oneDNN linear of transformer/linear.py it does not)
    plain = torch.backends.mkldnn.flags(enabled=False)
    with plain, record_attention(), FlopCounterMode(display=False) as counter:
        loss, _ = objective(src, tgt, tgt)
        loss.backward()
    assert monitor.train_flops(cfg, 3, 7, 5) == counter.get_total_flops()


def test_bf16_peak_by_device_name(monkeypatch):
    assert monitor.bf16_peak_flops(torch.device("cpu")) is None
    for name, expected in [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA GH200 480GB", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("Tesla V100-SXM2-16GB", None),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device, name=name: name)
        assert monitor.bf16_peak_flops(torch.device("cuda", 0)) == expected, name
