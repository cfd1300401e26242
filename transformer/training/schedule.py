"""The learning-rate schedule of Eq. (3), §5.3:

    lrate = d_model^-0.5 * min(step_num^-0.5, step_num * warmup_steps^-1.5)

linear warmup for the first `warmup_steps` updates, then decay with the inverse square root of the
step; the peak, at step_num = warmup_steps, is d_model^-0.5 * warmup_steps^-0.5. `lr_scale`
multiplies the whole curve (1.0 = the paper).
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from transformer.config import OptimConfig


def inverse_sqrt_lr(step_num: int, d_model: int, warmup_steps: int, lr_scale: float = 1.0) -> float:
    """Eq. (3) for update number `step_num` (1-based: the first update is step 1)."""
    step_num = max(step_num, 1)
    return lr_scale * d_model**-0.5 * min(step_num**-0.5, step_num * warmup_steps**-1.5)


def make_scheduler(optimizer: Optimizer, cfg: OptimConfig, d_model: int) -> LambdaLR:
    """A LambdaLR whose factor is the learning rate itself (the optimizer is built with lr=1.0).

    LambdaLR counts the updates already taken (0 before the first), so update k+1 gets factor(k).
    Its state_dict holds that count and resumes with the optimizer's.
    """
    for group in optimizer.param_groups:
        if group["lr"] != 1.0:
            raise ValueError("make_scheduler expects an optimizer built with lr=1.0")
    return LambdaLR(
        optimizer, lambda taken: inverse_sqrt_lr(taken + 1, d_model, cfg.warmup_steps, cfg.lr_scale)
    )
