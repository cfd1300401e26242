"""Speed machinery, applied from outside the paper's modules (docs/performance.md).

`apply_cpu_kernels(model)` swaps the classes of a CPU model's modules for subclasses that compute the
same functions faster there; parameters, buffers and state_dict keys stay as they are. The entry
points apply it after `.to(device)` and before `torch.compile` and DDP (`training.distributed.wrap`,
`translation.Translator`, the benchmark). `prepacked` packs the weights decoding multiplies by once for
a whole translation session (in 8 bits for precision=int8).
"""

from transformer.kernels.cpu import apply_cpu_kernels
from transformer.kernels.onednn import linear, prepacked

__all__ = ["apply_cpu_kernels", "linear", "prepacked"]
