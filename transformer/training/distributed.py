"""Devices, precision and data-parallel training (§5.2: "8 NVIDIA P100 GPUs").

`torchrun --nproc_per_node=N train.py ...` sets RANK, WORLD_SIZE and LOCAL_RANK; a plain `python train.py`
is one process. NCCL is used on GPUs and gloo on CPUs. Wrapping order is fixed:
build -> to(device) -> kernels (`transformer.kernels`, on a CPU) -> torch.compile -> DDP.

When one rank dies, the others exit with an error instead of hanging: gloo fails their next collective
at once ("Connection closed by peer"); torchrun notices the failed worker, stops the others (SIGTERM)
and exits non-zero; and as a backstop every collective has a timeout (`trainer.dist_timeout_minutes`),
after which NCCL's watchdog aborts it. Restart the same command to resume from the last checkpoint.

Only rank 0 prepares the corpus and writes checkpoints; every rank reads them, so on several machines
`data.dir` and `trainer.run_dir` must be on a filesystem they share.
"""

from __future__ import annotations

import gc
import os
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel

from transformer.config import ConfigError, TrainerConfig
from transformer.kernels import Kernels, cache_onednn_kernels, keep_freed_memory
from transformer.training.loss import Seq2SeqLoss
from transformer.utils.devices import resolve_device, training_dtype

PREPARE_TIMEOUT = timedelta(hours=12)  # rank 0 may spend hours preparing WMT14 while the others wait


@dataclass
class Runtime:
    """Where this process runs: its rank among `world_size`, its device, its autocast dtype."""

    rank: int
    world_size: int
    device: torch.device
    dtype: torch.dtype  # torch.bfloat16 under autocast, or torch.float32
    kernels: Kernels = field(default_factory=Kernels)  # the CPU kernels, the plan's choice
    prepare_group: dist.ProcessGroup | None = None  # a gloo group with a long timeout, for data prep

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16)


def init_runtime(cfg: TrainerConfig) -> Runtime:
    """Pick the device, precision and CPU threads, and join the process group when launched by torchrun
    (the CPU kernels are the plan's to choose: they depend on the checkpoint resumed)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = _device(cfg.device, local_rank, world_size)
    dtype = training_dtype(cfg.precision, device)
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    if device.type == "cpu" and dtype == torch.bfloat16:  # before any batch allocates or compiles
        keep_freed_memory()
        cache_onednn_kernels()
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # fp32 matmuls outside autocast use TF32 tensor cores
    if (
        device.type == "cpu"
        and cfg.attention_backends is not None
        and not {"flash", "math"} & set(cfg.attention_backends)
    ):
        raise ConfigError(
            f"trainer.attention_backends={cfg.attention_backends}: on a CPU torch's attention has flash "
            "and math only; name one of them or leave the setting unset"
        )
    runtime = Runtime(rank, world_size, device, dtype)
    if world_size > 1:
        backend = "nccl" if device.type == "cuda" else "gloo"
        timeout = timedelta(minutes=cfg.dist_timeout_minutes)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        runtime.prepare_group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    return runtime


def _device(name: str, local_rank: int, world_size: int) -> torch.device:
    if name.startswith("cuda:") and world_size > 1:  # one GPU for every process: NCCL would refuse late
        raise ConfigError(
            f"trainer.device={name} would put all {world_size} processes on one GPU; with torchrun use "
            "trainer.device=cuda (each process takes the GPU of its LOCAL_RANK) and choose the GPUs with "
            "CUDA_VISIBLE_DEVICES"
        )
    return resolve_device(name, local_rank)


def wrap(objective: Seq2SeqLoss, runtime: Runtime, compile: bool) -> nn.Module:
    """torch.compile -> DDP, in that order, around an objective whose model is on the device with its
    kernels in place."""
    if compile:
        # Dynamic shapes: one compilation serves every batch size and length (static ones would compile
        # anew for each of the ~200 shapes of a WMT epoch), and sizes that happen to be equal in the
        # first batch (S = T) do not become one size that a later batch recompiles for.
        torch.fx.experimental._config.use_duck_shape = False
        objective.compile_regions()
    if runtime.distributed:
        device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
        # The model has no running statistics: its only buffer (the sinusoid table) needs no broadcast.
        return DistributedDataParallel(objective, device_ids=device_ids, broadcast_buffers=False)
    return objective


SDPA_BACKENDS = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}


def attention_backends(names: list[str] | None) -> AbstractContextManager:
    """Where training lets torch's fused attention choose among these backends only
    (trainer.attention_backends); None: among all, torch's choice."""
    return nullcontext() if names is None else sdpa_kernel([SDPA_BACKENDS[name] for name in names])


def all_reduce_sum(values: list[float], runtime: Runtime) -> list[float]:
    """Sum a few numbers over the ranks (one collective); the identity for a single process."""
    if not runtime.distributed:
        return values
    tensor = torch.tensor(values, dtype=torch.float64, device=runtime.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_sum_tensor(tensor: Tensor, runtime: Runtime) -> Tensor:
    """Sum a device tensor over the ranks in place, without waiting for the result; the identity for a
    single process."""
    if runtime.distributed:
        dist.all_reduce(tensor)
    return tensor


def gather_objects(obj: object, runtime: Runtime) -> list[object]:
    """Every rank's `obj`, in rank order (e.g. the RNG states a checkpoint needs from each rank)."""
    if not runtime.distributed:
        return [obj]
    gathered: list[object] = [None] * runtime.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def wait_for_main(runtime: Runtime) -> None:
    """Hold the other ranks until rank 0 has finished work they depend on (data preparation, the
    checkpoint of a stopped run)."""
    if runtime.distributed:
        dist.barrier(group=runtime.prepare_group)


def shutdown(runtime: Runtime) -> None:
    """Leave the process group, with the DDP wrapper already dropped by the caller. The reducer must
    not hold the group's last reference: its destructor, run with the GIL held, joins gloo's worker
    threads, which may need the GIL to free a collective's tensor (a hang seen about 1 run in 5)."""
    if runtime.distributed and dist.is_initialized():
        gc.collect()  # the dropped wrapper's reference cycles, and with them its reducer
        dist.destroy_process_group()
