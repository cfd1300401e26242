"""Speed machinery, applied from outside the paper's modules (docs/performance.md).

`apply_cpu_kernels(model)` swaps the classes of a CPU model's modules for subclasses that compute the
same functions faster there; parameters, buffers and state_dict keys stay as they are. The entry
points apply it after `.to(device)` and before `torch.compile` and DDP (`training.distributed.wrap`,
`translation.Translator`, the benchmark). `prepacked` packs the weights decoding multiplies by once for
a whole translation session (in 8 bits for precision=int8). `keep_freed_memory` and
`cache_onednn_kernels` keep a CPU run's memory and oneDNN kernels from one batch to the next.
"""

from transformer.kernels.cpu import apply_cpu_kernels
from transformer.kernels.memory import cache_onednn_kernels, keep_freed_memory
from transformer.kernels.onednn import linear, prepacked

__all__ = ["apply_cpu_kernels", "cache_onednn_kernels", "keep_freed_memory", "linear", "prepacked"]
