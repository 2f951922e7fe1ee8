// A mixture-of-experts block whose experts are w4a8 (decoder/moe.py computes the same in PyTorch), in one call:
// the router, the chosen experts each run once over all rows routed to it, shared experts with their gate.
// w4a8_layer.cpp binds it alone and inside a fused decoder layer.
#pragma once
#include "w4a8_kernel.h"
#include <atomic>
#include <memory>
#include <vector>

// out [n, H] = silu(x gate_up[:I]) * (x gate_up[I:]) down, for n rows x [n, H]: a SwiGLU MLP, an expert's or a
// dense layer's.
void swiglu_rows(const float* x, int64_t n, const W4A8Weight& gate_up, const W4A8Weight& down, float* out);

// How a router turns its logits into k experts and their weights (decoder/moe.py, MoEConfig).
struct Routing {
  int64_t experts_per_token;  // k
  bool sigmoid;               // each expert's sigmoid (GLM, DeepSeek) or a softmax over all (Qwen)
  int64_t groups, groups_kept;  // n_group, topk_group: experts only from the best groups (DeepSeek-V3)
  bool renormalize;           // norm_topk_prob: the k weights over their sum
  float scaling;              // routed_scaling_factor
};

class W4A8MoE {
 public:
  // router [E, H] float32 (a copy is kept); score_bias [E]; gate_ups, downs: each expert's two matmuls; the
  // shared experts as one MLP (shared_gate_up, shared_down) and its gate's weight [H], each optional.
  W4A8MoE(torch::Tensor router, c10::optional<torch::Tensor> score_bias, std::vector<W4A8Weight> gate_ups,
          std::vector<W4A8Weight> downs, c10::optional<W4A8Weight> shared_gate_up,
          c10::optional<W4A8Weight> shared_down, c10::optional<torch::Tensor> shared_gate, int64_t experts_per_token,
          bool sigmoid, int64_t groups, int64_t groups_kept, bool renormalize, double scaling);

  // out [R, H] = the block's output for x [R, H] (float32 rows); chosen [R, k], where not null: the experts
  // each row was routed to, best first. Each row's result depends on that row alone.
  void run(const float* x, int64_t rows, float* out, int64_t* chosen = nullptr) const;

  // x [R, H] contiguous float32 -> ([R, H] float32 output, [R, k] int64 experts chosen, in slot order).
  std::tuple<torch::Tensor, torch::Tensor> forward(torch::Tensor x) const;

  int64_t hidden() const { return hidden_; }

  // The distinct experts the last run() read, the union of its rows' choices: a verify forward's cost grows with
  // it, not with its rows (drafters/verify_cost.py prices drafts by it).
  int64_t touched() const { return touched_.load(std::memory_order_relaxed); }

 private:
  // experts [R, k] (each row's slots, best first) and weights [R, k] for x [R, H].
  void route(const float* x, int64_t rows, int64_t* experts, float* weights) const;
  torch::Tensor router_, score_bias_, shared_gate_;  // float32; the last two undefined where a family has none
  std::vector<W4A8Weight> gate_ups_, downs_;
  c10::optional<W4A8Weight> shared_gate_up_, shared_down_;
  Routing routing_;
  int64_t hidden_, num_experts_;
  mutable std::atomic<int64_t> touched_{0};  // run() is const: it only reads the weights
};

// A fused layer's MLP: a dense SwiGLU (gate_up and down) or a mixture of experts (moe).
struct W4A8Feedforward {
  c10::optional<W4A8Weight> gate_up, down;
  std::shared_ptr<W4A8MoE> moe;
  // The checks a layer of hidden size `hidden` needs; -> the dense MLP's width (0 for experts).
  int64_t check(int64_t hidden) const;
  void run(const float* x, int64_t rows, float* out) const;  // out [R, H] for x [R, H]
};
