"""The learning-rate schedule, Eq. (3) of §5.3, against the formula written out here."""

import pytest
import torch

from transformer.config import OptimConfig
from transformer.training.schedule import inverse_sqrt_lr, make_scheduler


def paper_lrate(step_num: int, d_model: int, warmup_steps: int) -> float:
    return d_model**-0.5 * min(step_num**-0.5, step_num * warmup_steps**-1.5)


@pytest.mark.parametrize("d_model,warmup", [(512, 4000), (1024, 4000), (64, 10)])
def test_values_follow_equation_3(d_model, warmup):
    for step in [1, 2, warmup // 2, warmup - 1, warmup, warmup + 1, 2 * warmup, 25 * warmup]:
        assert inverse_sqrt_lr(step, d_model, warmup) == pytest.approx(
            paper_lrate(step, d_model, warmup), rel=1e-12
        )
    assert inverse_sqrt_lr(10, d_model, warmup, lr_scale=2.0) == pytest.approx(
        2 * paper_lrate(10, d_model, warmup)
    )


def test_peak_at_warmup_then_inverse_square_root_decay():
    d_model, warmup = 512, 4000
    values = [inverse_sqrt_lr(s, d_model, warmup) for s in range(1, 3 * warmup)]
    assert values.index(max(values)) + 1 == warmup
    peak = d_model**-0.5 * warmup**-0.5  # about 7.0e-4 for the base model
    assert max(values) == pytest.approx(peak)
    assert inverse_sqrt_lr(warmup // 4, d_model, warmup) == pytest.approx(peak / 4)  # linear warmup
    assert inverse_sqrt_lr(4 * warmup, d_model, warmup) == pytest.approx(peak / 2)  # 1/sqrt(step)


def test_scheduler_sets_the_learning_rate_of_each_update_and_resumes():
    cfg = OptimConfig(warmup_steps=5, lr_scale=1.5)
    param = torch.nn.Parameter(torch.zeros(2))

    def build():
        optimizer = torch.optim.Adam([param], lr=1.0)
        return optimizer, make_scheduler(optimizer, cfg, d_model=16)

    optimizer, scheduler = build()
    seen = []
    for _ in range(7):
        seen.append(optimizer.param_groups[0]["lr"])  # the rate the next update will use
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([1.5 * paper_lrate(k, 16, 5) for k in range(1, 8)])
    resumed_optimizer, resumed = build()
    resumed_optimizer.load_state_dict(optimizer.state_dict())
    resumed.load_state_dict(scheduler.state_dict())
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(1.5 * paper_lrate(8, 16, 5))
    resumed_optimizer.step()
    resumed.step()
    assert resumed_optimizer.param_groups[0]["lr"] == pytest.approx(1.5 * paper_lrate(9, 16, 5))


def test_scheduler_needs_unit_base_lr():
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="lr=1.0"):
        make_scheduler(optimizer, OptimConfig(), d_model=512)
