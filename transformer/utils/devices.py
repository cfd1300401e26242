"""Where a command runs and in what precision: the one resolver of `device` and `precision` for
training, decoding and the benchmark.

`precision` means one thing per command:

- training (`trainer.precision`): the dtype autocast runs the forward and backward passes in; the
  weights, their gradients and Adam's moments stay float32. "auto" is bf16 where the device multiplies
  it natively (CUDA, CPUs with AVX512-BF16 or AMX), else fp32.
- decoding (`precision` of translate.py, evaluate.py and visualize_attention.py; `finish.precision`):
  the dtype the weights are cast to, the search adding its scores up in float32; "int8" multiplies by
  8-bit weights on the CPU. "auto" is bf16 on CUDA and fp32 on every CPU.
"""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from transformer.config import ConfigError

log = logging.getLogger(__name__)


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """ "auto" = the GPU of this process (LOCAL_RANK under torchrun) when CUDA is there, else the CPU;
    "cuda" = that GPU; "cpu" and "cuda:N" as they say."""
    if name == "auto":
        return torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device={name} was asked for, but this machine has no CUDA device; use device=cpu")
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


@dataclass(frozen=True)
class CpuFeatures:
    """What this CPU offers the kernels: the vector instructions PyTorch dispatches to
    (`torch.backends.cpu.get_cpu_capability()`: "AVX512", "AVX2", "DEFAULT", or on ARM e.g. "SVE256"),
    whether it is an x86 CPU, and whether it multiplies bf16 natively (AVX512-BF16, AMX)."""

    capability: str
    x86: bool
    bf16: bool
    amx: bool
    name: str  # the CPU's model name, for reports

    @property
    def isa(self) -> str:
        """The vector ISA as reports name it: "AMX", "AVX512-BF16", "AVX-512", "AVX2", or the capability."""
        if self.amx:
            return "AMX"
        if self.capability.startswith("AVX512"):
            return "AVX512-BF16" if self.bf16 else "AVX-512"
        return self.capability


def cpu_features() -> CpuFeatures:
    """This machine's `CpuFeatures`."""
    x86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
    amx = torch.cpu._is_amx_tile_supported()
    return CpuFeatures(torch.backends.cpu.get_cpu_capability(), x86, cpu_has_bf16(), amx, _cpu_name())


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def has_int8_engine() -> bool:
    """Whether PyTorch has fbgemm, its 8-bit engine for x86 CPUs with AVX2 or newer, on this machine."""
    return bool({"fbgemm", "x86"} & set(torch.backends.quantized.supported_engines))


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively: AVX512-BF16 or AMX instructions."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def training_dtype(precision: str, device: torch.device) -> torch.dtype:
    """trainer.precision -> autocast's dtype (torch.float32: autocast off)."""
    if precision == "auto":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_has_bf16())
        return torch.bfloat16 if native else torch.float32
    _check_bf16(precision, device, "trainer.precision")
    return torch.bfloat16 if precision == "bf16" else torch.float32


def decoding_dtype(precision: str, device: torch.device, key: str = "precision") -> torch.dtype:
    """Decoding's precision (the setting `key`) -> the dtype of the weights (int8: float32 weights, 8-bit
    products)."""
    if precision == "int8" and device.type != "cpu":
        raise ConfigError(f"{key}=int8 runs on the CPU; the device here is {device}: add device=cpu")
    if precision == "int8" and not (cpu_features().x86 and has_int8_engine()):
        this_cpu = "has no AVX2" if cpu_features().x86 else "is not an x86 one"
        raise ConfigError(
            f"{key}=int8 multiplies with fbgemm, PyTorch's x86 engine for CPUs with AVX2 or newer; "
            f"this CPU {this_cpu}: use {key}=fp32"
        )
    if precision == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    _check_bf16(precision, device, key)
    return torch.bfloat16 if precision == "bf16" else torch.float32


def _check_bf16(precision: str, device: torch.device, key: str) -> None:
    if precision != "bf16":
        return
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ConfigError(f"{torch.cuda.get_device_name(device)} has no bf16; use {key}=fp32")
    if device.type == "cpu" and not cpu_has_bf16():
        log.warning(
            "this CPU multiplies bf16 without native instructions (AVX512-BF16 or AMX), likely slower than "
            "fp32; %s=fp32 computes the same model",
            key,
        )
