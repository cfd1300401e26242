"""Model FLOPs for MFU against torch's FLOP counter, the bf16 peak lookup, and what the monitor logs."""

import logging
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from transformer.config import ModelConfig
from transformer.inference.visualize import recording
from transformer.model import Transformer
from transformer.training import monitor
from transformer.training.loss import Seq2SeqLoss

# the mixture: capacity for every assignment, so that each token runs its k experts
MIXTURE = {"moe_experts": 4, "moe_top_k": 2, "moe_capacity": 2.0}


@pytest.mark.parametrize("shape", [{}, {"n_kv_heads": 2}, {"d_k": 16, "d_v": 8}, MIXTURE])
def test_train_flops_match_the_counted_matmuls_of_forward_and_backward(shape):
    cfg = ModelConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64, n_layers=2, **shape)
    objective = Seq2SeqLoss(Transformer(cfg), 0.1)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    # the reference attention path and F.linear are plain matmuls, which the counter sees (the fused
    # CPU attention kernel and the oneDNN linear of transformer/kernels/onednn.py it does not)
    plain = torch.backends.mkldnn.flags(enabled=False)
    with plain, FlopCounterMode(display=False) as counter:
        loss, _, _ = recording(objective)[0](src, tgt, tgt)
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


def test_logged_scalars_are_interval_means_and_the_peak_gpu_memory(tmp_path, monkeypatch, caplog):
    """Every `every` steps: the means over the interval, tokens/s over its wall time, MFU against the
    given peak, and on a GPU the allocator's peak of tensor memory (faked here: no GPU needed)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    peak_of = {torch.device("cuda", 1): 3 * 2**30}  # the card the run is on; no other
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: peak_of.get(device, 0))
    clock = iter([0.0, 1.0, 3.0])  # construction, step 1, step 2: the interval took 3 s
    step = {"nll": 1.0, "lr": 1e-3, "grad_norm": 2.0, "flops": 6e12}
    device = torch.device("cuda", 1)
    with (
        caplog.at_level(logging.INFO),
        monitor.Monitor(tmp_path, True, False, (0, 10), 2, device, 1e12, clock=lambda: next(clock)) as watch,
    ):
        watch.step(1, {**step, "loss": 2.0, "tokens": 100.0})
        watch.step(2, {**step, "loss": 4.0, "tokens": 200.0, "lr": 3e-3})
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    got = {tag: events.Scalars(tag)[0].value for tag in events.Tags()["scalars"]}
    assert got == pytest.approx(
        {
            "train/loss": 3.0,
            "train/ppl": math.e,
            "train/lr": 2e-3,
            "train/grad_norm": 2.0,
            "train/tokens_per_s": 100.0,
            "train/tokens_per_step": 150.0,
            "train/mfu": 4.0,  # 12e12 FLOPs in 3 s against 1e12 FLOP/s
            "train/peak_mem_gib": 3.0,
        }
    )
    assert "step 2:" in caplog.text and "peak_mem_gib 3" in caplog.text


def test_valid_chrf_and_chrf_plus_plus_are_logged_beside_bleu(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scores = {"bleu": 21.5, "sacrebleu": 20.25, "chrf": 48.5, "chrf++": 46.75}
    watch = monitor.Monitor(tmp_path, True, False, (0, 10), 2, torch.device("cpu"), None)
    with caplog.at_level(logging.INFO), watch:
        watch.scores(4, scores)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    got = {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in tags}
    assert got == {f"valid/{name}": [(4, value)] for name, value in scores.items()}
    assert "step 4: valid BLEU 21.50 (sacreBLEU 20.25), chrF 48.50, chrF++ 46.75" in caplog.text
