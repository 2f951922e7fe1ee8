"""Q4_K tensors of a GGUF file as int4 layers, exactly.

A Q4_K super-block of 256 weights holds 8 groups of 32 with 4-bit codes q, a 6-bit scale sc and min m per group,
and f16 factors d, dmin: w = d*sc*q - dmin*m. The int4 kernel computes w = (q - 8)*s + z per group of 32, so
s = d*sc and z = 8*s - dmin*m reproduce the file's weights with no requantization (up to the rounding of s
and z to the activations' dtype).
"""

from __future__ import annotations

import numpy as np
import torch

Q4_K_GROUP = 32
_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of packed scales and mins, 128 bytes of 4-bit codes


def q4_k_groups(tensor, rows: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K GGUF tensor (or its rows `rows`) -> codes [N, K] int32, scales [N, K/32] and zeros [N, K/32]
    float32."""
    from gguf.quants import Q4_K

    data = np.asarray(tensor.data[rows])  # [N, K/256*144]: every row holds whole blocks
    n_rows, columns = len(data), int(tensor.shape[0])  # GGUF lists dims innermost first
    blocks = data.reshape(-1, _BLOCK_BYTES)  # [B, 144], B = N*K/256
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)  # [B, 1]
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # [B, 8] each
    packed = blocks[:, 16:].reshape(-1, 4, 1, 32)  # [B, 4, 1, 32]: 32 bytes hold two groups of 32 codes
    codes = (packed >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 0x0F  # [B, 4, 2, 32]
    scales = d * sc.astype(np.float32)  # [B, 8]
    zeros = 8 * scales - dmin * m.astype(np.float32)  # [B, 8]
    return (torch.from_numpy(codes.reshape(n_rows, columns).astype(np.int32)),
            torch.from_numpy(scales.reshape(n_rows, columns // Q4_K_GROUP)),
            torch.from_numpy(zeros.reshape(n_rows, columns // Q4_K_GROUP)))
