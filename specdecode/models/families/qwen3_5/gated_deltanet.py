"""Gated DeltaNet (Yang, Kautz and Hatamizadeh, 2024): the linear-attention token mixer of Qwen 3.5's hybrid trunk.

Each value head carries a state S [dk, dv] instead of a KV cache. For each token:

    x          = in_proj's q/k/v channels through a causal depthwise convolution (kernel K) and SiLU
    q, k, v    = x split; q and k L2-normalised, q scaled by dk^-1/2 (a key head serves Hv/Hk value heads)
    decay      = exp(-exp(A_log) * softplus(a + dt_bias))      a and b: one value per head from in_proj
    beta       = sigmoid(b)
    S          = decay * S
    S          = S + k (beta (v - S^T k))^T                     the delta rule: write what S mispredicts
    out        = S^T q
    y          = out_proj(gated_norm(out, z))                   z: in_proj's gate channels

Two forms of the same recurrence:
- sequential, for decoding and for the rows of a verify forward (up to SEQUENTIAL_ROWS, or any tree): one row
  at a time from its parent's state (the previous row, or in a tree its parent node). Each row is computed with
  the same element-wise operations whatever the number of rows, so a token's output is bitwise the same decoded
  alone or verified among drafts, and every row's state is at hand for rollback (cache.py keeps them).
- chunked, for reading long prompts: the delta rule's WY form over chunks of CHUNK rows (a triangular solve and
  matmuls inside a chunk, the state carried from chunk to chunk); only the final state comes out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.models.model_config import ModelConfig

SEQUENTIAL_ROWS = 64  # chains up to this many rows run sequentially (every verify forward); longer ones chunked
CHUNK = 64
_VECTOR_ROW = 64  # floats: a multiple of what PyTorch's vectorized loops take at once on AVX2, AVX-512 and NEON


def padded(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an element-wise fn built on exp (softplus, sigmoid), x [..., n] with n small (one value per head).
    PyTorch computes exp in SIMD lanes with one approximation and in the loop's leftover elements with another,
    whose last bits differ; a [T, 16] tensor at T = 1 is all leftover and at T = 8 all lanes. Each row padded to
    a whole number of vectors goes through the lanes whatever the number of rows, so a row's values are bitwise
    the same decoded alone or verified among drafts."""
    width = -(-x.shape[-1] // _VECTOR_ROW) * _VECTOR_ROW
    return fn(F.pad(x, (0, width - x.shape[-1])))[..., : x.shape[-1]]


class GatedRMSNorm(nn.Module):
    """RMSNorm over each head's output, then times SiLU of the gate (its weight is not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:  # [..., D] each -> [..., D]
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig, recurrent_index: int):
        super().__init__()
        self.index = recurrent_index  # which of the cache's recurrent states is this layer's
        self.key_heads, self.value_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.key_dim, self.value_dim = config.linear_key_head_dim, config.linear_value_head_dim
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.conv_channels = 2 * keys + values
        self.kernel = config.linear_conv_kernel
        # in_proj_qkv, in_proj_z, in_proj_b and in_proj_a in one matmul: one weight stream per layer.
        self.split = [self.conv_channels, values, self.value_heads, self.value_heads]
        self.in_proj = nn.Linear(config.hidden_size, sum(self.split), bias=False)
        self.conv = nn.Parameter(torch.zeros(self.conv_channels, 1, self.kernel))  # [C, 1, K] depthwise, as stored
        self.dt_bias = nn.Parameter(torch.zeros(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(values, config.hidden_size, bias=False)
        # The compiled sequential form (kernels/delta_rule.cpp), set by families/qwen3_5/kernels.py where it runs:
        # one read and one write of the state per row. None: sequential_delta_rule's PyTorch operations.
        self.fused_rule = None

    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int, int]]:
        """(the convolution's state [K-1, C], the recurrent state [Hv, dk, dv]) of one sequence."""
        return (self.kernel - 1, self.conv_channels), (self.value_heads, self.key_dim, self.value_dim)

    def forward(self, x: torch.Tensor, cache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; reads and writes this layer's states in `cache` (a HybridCache or a
        CacheBatch of them), whose row_parents say each row's parent ([B, T], -1 = the cached state; None =
        a chain)."""
        batch, new, _ = x.shape
        mixed, z, b, a = self.in_proj(x).split(self.split, dim=-1)  # [B, T, C], [B, T, Hv*dv], [B, T, Hv] x2
        conv_state, state = cache.recurrent_state(self.index)  # [B, K-1, C], [B, Hv, dk, dv] float32
        parents = cache.row_parents
        sequential = parents is not None or new <= SEQUENTIAL_ROWS
        windows = self._windows(mixed, conv_state.to(mixed.dtype), parents)  # [B, T, K, C]
        taps = self.conv[:, 0].T  # [K, C]
        conv_out = windows[:, :, 0] * taps[0]
        for tap in range(1, self.kernel):  # tap by tap: the same sums in the same order for every row
            conv_out = conv_out + windows[:, :, tap] * taps[tap]
        q, k, v = F.silu(conv_out).split([self.key_heads * self.key_dim] * 2 + [self.value_heads * self.value_dim],
                                         dim=-1)
        q = self._heads(q) * self.key_dim ** -0.5  # [B, T, Hv, dk] float32, normalised and scaled
        k = self._heads(k)  # [B, T, Hv, dk] float32, normalised
        v = v.reshape(batch, new, self.value_heads, self.value_dim).float()  # [B, T, Hv, dv]
        log_decay = -self.A_log.float().exp() * padded(F.softplus, a.float() + self.dt_bias)  # [B, T, Hv]
        beta = padded(torch.sigmoid, b).float()  # [B, T, Hv]
        keep_from = cache.rows_kept_from(new)
        if sequential:
            if self.fused_rule is not None:
                out, states = self.fused_rule(q, k, v, padded(torch.exp, log_decay), beta, state, parents, keep_from)
            else:
                out, states = sequential_delta_rule(q, k, v, log_decay, beta, state, parents, keep_from)
            conv_rows = windows[:, keep_from:, 1:]  # [B, T', K-1, C] each kept row's convolution state
        else:
            out, final = chunked_delta_rule(q, k, v, log_decay, beta, state)
            states, conv_rows = [final], windows[:, -1:, 1:]  # the last row's only
        cache.write_recurrent(self.index, conv_rows, states, every_row=sequential)
        out = self.norm(out.to(x.dtype), z.reshape(batch, new, self.value_heads, self.value_dim))
        return self.out_proj(out.reshape(batch, new, -1))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, Hk*dk] -> [B, T, Hv, dk] float32, L2-normalised, each key head repeated for its value heads."""
        batch, new, _ = x.shape
        x = x.reshape(batch, new, self.key_heads, self.key_dim).float()
        x = x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)
        return x.repeat_interleave(self.value_heads // self.key_heads, dim=2)

    def _windows(self, mixed: torch.Tensor, conv_state: torch.Tensor, parents: torch.Tensor | None) -> torch.Tensor:
        """Each row's convolution window [B, T, K, C]: its K-1 predecessors on its path, then itself (mixed
        [B, T, C], conv_state [B, K-1, C] in mixed's dtype)."""
        if parents is None:
            joined = torch.cat([conv_state, mixed], dim=1)  # [B, K-1+T, C]
            return joined.unfold(1, self.kernel, 1).transpose(2, 3)
        windows = []  # [B, K, C] per row
        for t in range(mixed.shape[1]):
            before = conv_state if t == 0 else torch.stack(
                [windows[p][b, 1:] for b, p in enumerate(parents[:, t].tolist())])  # [B, K-1, C]
            windows.append(torch.cat([before, mixed[:, t : t + 1]], dim=1))
        return torch.stack(windows, dim=1)


def sequential_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor, parents: torch.Tensor | None,
                          keep_from: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one row at a time. q, k [B, T, H, dk]; v [B, T, H, dv]; log_decay, beta [B, T, H];
    state [B, H, dk, dv] before row 0; parents [B, T] (row 0's is -1) or None = each row's parent the one before.
    -> (out [B, T, H, dv], the states after rows keep_from.. ([B, H, dk, dv] each, as computed: kept, not
    copied)), all float32."""
    new = q.shape[1]
    decay = padded(torch.exp, log_decay)  # [B, T, H]
    states: list[torch.Tensor] = []  # [B, H, dk, dv] after each row
    outs = []
    for t in range(new):
        if t == 0:
            before = state
        elif parents is None:
            before = states[t - 1]
        else:
            before = torch.stack([states[p][b] for b, p in enumerate(parents[:, t].tolist())])
        decayed = before * decay[:, t, :, None, None]  # [B, H, dk, dv]
        predicted = (decayed * k[:, t, :, :, None]).sum(-2)  # [B, H, dv]
        delta = (v[:, t] - predicted) * beta[:, t, :, None]  # [B, H, dv]
        after = decayed + k[:, t, :, :, None] * delta[:, :, None, :]  # [B, H, dk, dv]
        outs.append((after * q[:, t, :, :, None]).sum(-2))  # [B, H, dv]
        states.append(after)
    return torch.stack(outs, dim=1), states[keep_from:]


def chunked_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor,
                       beta: torch.Tensor, state: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over a chain, a chunk of rows at a time. Within a chunk, with g_t the decay from the
    chunk's start to row t (inclusive) and S0 the state before it, each row's write u_t satisfies

        u_t = beta_t (v_t - g_t S0^T k_t - sum_{j<t} (g_t/g_j) (k_t . k_j) u_j)

    a unit lower-triangular system (I + A) U = beta V - beta g K S0; then
        out_t = g_t S0^T q_t + sum_{j<=t} (g_t/g_j) (q_t . k_j) u_j,   S_end = g_C S0 + sum_j (g_C/g_j) k_j u_j^T.
    Shapes as sequential_delta_rule's -> (out [B, T, H, dv], the state after the last row [B, H, dk, dv])."""
    new = k.shape[1]
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [B, H, T, d]
    log_decay, beta = log_decay.transpose(1, 2), beta.transpose(1, 2)  # [B, H, T]
    outs = []
    for start in range(0, new, chunk):
        rows = slice(start, min(start + chunk, new))
        qc, kc, vc, bc = q[:, :, rows], k[:, :, rows], v[:, :, rows], beta[:, :, rows]
        cumulative = log_decay[:, :, rows].cumsum(-1)  # [B, H, C] log g_t
        size = cumulative.shape[-1]
        lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()  # [C, C] j <= t
        ratio = (cumulative[..., :, None] - cumulative[..., None, :]).masked_fill(~lower, float("-inf")).exp()
        strictly = ratio.masked_fill(torch.eye(size, dtype=torch.bool, device=q.device), 0.0)  # [B, H, C, C] j < t
        system = torch.eye(size, device=q.device) + bc[..., None] * strictly * (kc @ kc.transpose(-1, -2))
        growth = cumulative.exp()[..., None]  # [B, H, C, 1] g_t
        rhs = bc[..., None] * (vc - growth * (kc @ state))  # [B, H, C, dv]
        writes = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, H, C, dv]
        outs.append(growth * (qc @ state) + (ratio * (qc @ kc.transpose(-1, -2))) @ writes)
        to_end = (cumulative[..., -1:] - cumulative).exp()[..., None]  # [B, H, C, 1] g_C / g_j
        state = cumulative[..., -1].exp()[..., None, None] * state + (kc * to_end).transpose(-1, -2) @ writes
    return torch.cat(outs, dim=2).transpose(1, 2), state
