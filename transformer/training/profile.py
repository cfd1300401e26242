"""torch.profiler over a few training steps (`trainer.profile_steps`): each operator's host and device
time, a Chrome trace, and the device's busy share, its kernels' time over the wall time of the steps:
below 1, the GPU waited for the host (docs/performance.md, "The real loop, measured")."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity


@dataclass
class Profiled:
    """What a profile of `steps` steps measured; kernel_seconds: on CUDA, else None."""

    steps: int
    wall_seconds: float
    kernel_seconds: float | None
    table: str  # the operators, most time first
    profile: torch.profiler.profile

    @property
    def busy(self) -> float | None:
        """The device's busy share: its kernels' time over the wall time."""
        return None if self.kernel_seconds is None else self.kernel_seconds / self.wall_seconds


class Profiler:
    """`start()`, then `stop(steps)` once the steps are queued (it waits for the device), or `cancel()`."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.cuda = device, device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.profile = torch.profiler.profile(activities=activities)
        self.started = 0.0

    @staticmethod
    def set_up(device: torch.device) -> None:
        """Start and stop a profile on CUDA once, before any CUDA graph is recorded: a graph recorded
        before the profiler's first start can fault when replayed under it (pytorch issue 75504)."""
        if device.type == "cuda":
            with torch.profiler.profile(activities=[ProfilerActivity.CUDA]):
                pass

    def start(self) -> None:
        self.profile.start()
        self.started = time.perf_counter()

    def stop(self, steps: int) -> Profiled:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.started
        self.profile.stop()
        averages = self.profile.key_averages()
        # the kernels' own events, as the table's "Self CUDA time total" (an operator repeats its kernels')
        kernels = [event for event in averages if event.device_type == DeviceType.CUDA]
        kernel = sum(event.self_device_time_total for event in kernels) / 1e6 if self.cuda else None
        order = "self_device_time_total" if self.cuda else "self_cpu_time_total"
        return Profiled(steps, wall, kernel, averages.table(sort_by=order, row_limit=40), self.profile)

    def cancel(self) -> None:
        self.profile.stop()
