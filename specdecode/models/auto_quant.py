"""`--quant auto`: how to run a target fast without changing what it computes, and why.

A GGUF file whose linear weights are mostly 4-bit K-quants (Q4_K_M, Q4_K_S) runs as w4a8 where this CPU has the
kernel: the file's own Q4_K codes with int8 activations, as llama.cpp computes them (its Q6_K tensors are
requantized to 4 bits). Anything else keeps its weights as stored, converted to the float dtype: a float
checkpoint is never quantized unless asked, since that would change the target.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf

from specdecode.models.formats.gguf_header import tensor_types

FLOAT_TYPES = {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.BF16}


def choose_quant(source: Path, device: str, group_size: int, quiet: bool = True) -> tuple[str, str]:
    """-> (the quantization to load `source` with, the reason in a few words)."""
    if device != "cpu":
        return "none", f"weights as stored, on {device}"
    if not source.is_file():
        return "none", "a float checkpoint keeps its dtype (--quant w4a8 or int4 quantizes it)"
    kinds = Counter(kind for name, kind in tensor_types(source).items()
                    if name.startswith("blk.") and kind not in FLOAT_TYPES)
    if not kinds:
        return "none", "its weights are float"
    common = kinds.most_common(1)[0][0]
    if common != gguf.GGMLQuantizationType.Q4_K:
        return "none", f"its weights are mostly {common.name}, not 4-bit K-quants: converted to float"
    if group_size != 32:
        return "none", "4-bit K-quants, but w4a8 needs --group-size 32: converted to float"
    from specdecode.models.kernels.w4a8_linear import w4a8_unavailable

    reason = w4a8_unavailable(quiet)
    if reason:
        return "none", f"4-bit K-quants, but w4a8 cannot run here ({reason}): converted to float"
    return "w4a8", "4-bit K-quants on our int8 kernel, as llama.cpp computes them"
