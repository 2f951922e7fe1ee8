// The Gated DeltaNet recurrence (families/qwen3_5/gated_deltanet.py) one row at a time, fused: each row reads its parent's
// state once and writes its own once, where PyTorch's element-wise form makes five state-sized temporaries per
// row. Every row is computed by the same loops whatever else shares the call, so a token's output is bitwise the
// same decoded alone, verified among drafts, or batched.
#pragma once
#include <torch/extension.h>
#include <vector>

// q, k [B, T, H, dk], v [B, T, H, dv], decay and beta [B, T, H] (decay = exp(log decay), as computed by the
// caller), all float32; state [B, H, dk, dv] float32, the state before row 0; parents [B, T] int64 (row 0's is
// -1: the state before) or none: each row's parent the row before.
// -> (out [B, T, H, dv], the state after each row from keep_from on, [B, H, dk, dv] each, all float32). A chain's
// earlier rows are computed in one working state, in place: only the states asked for are written to memory.
std::tuple<torch::Tensor, std::vector<torch::Tensor>> delta_rule(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor decay, torch::Tensor beta, torch::Tensor state,
    c10::optional<torch::Tensor> parents, int64_t keep_from);
