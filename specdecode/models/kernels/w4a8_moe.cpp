// The w4a8 mixture-of-experts block (w4a8_moe.h). One call replaces the PyTorch block's few dozen small ops a
// layer (the router's, and three to five per chosen expert), which at one token a step cost more than the
// experts' own matmuls on a CPU.
//
// Every row is routed on its own (its logits are fixed-order dot products, its top-k its own), each expert runs
// once over all rows routed to it (w4a8_rows: each row quantized and summed on its own), and a row's k weighted
// outputs are summed in its slot order: so a row's bits never depend on which rows share the call, and a verify
// forward gives each drafted token the bits it decodes to alone.
#include "w4a8_moe.h"
#include "row_ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace {

// The sum of x [n] times w [n] in a fixed order (n a multiple of 16).
float dot(const float* x, const float* w, int64_t n) {
  F16 sums = set16(0.f);
  for (int64_t i = 0; i < n; i += 16) sums = fmadd16(load16(x + i), load16(w + i), sums);
  return reduce_add(sums);
}

// The indices of the `count` largest of values [n], largest first; ties to the lower index (as a stable sort).
void best(const std::vector<float>& values, int64_t count, int64_t* out) {
  std::vector<int64_t> order(values.size());
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + count, order.end(), [&](int64_t a, int64_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  std::copy(order.begin(), order.begin() + count, out);
}

}  // namespace

W4A8MoE::W4A8MoE(torch::Tensor router, c10::optional<torch::Tensor> score_bias, std::vector<W4A8Weight> gate_ups,
                 std::vector<W4A8Weight> downs, c10::optional<W4A8Weight> shared_gate_up,
                 c10::optional<W4A8Weight> shared_down, c10::optional<torch::Tensor> shared_gate,
                 int64_t experts_per_token, bool sigmoid, int64_t groups, int64_t groups_kept, bool renormalize,
                 double scaling)
    : router_(floats(router)), gate_ups_(std::move(gate_ups)), downs_(std::move(downs)),
      shared_gate_up_(shared_gate_up), shared_down_(shared_down),
      routing_{experts_per_token, sigmoid, groups, groups_kept, renormalize, (float)scaling} {
  TORCH_CHECK(router_.dim() == 2, "router: [E, H]");
  num_experts_ = router_.size(0);
  hidden_ = router_.size(1);
  TORCH_CHECK(hidden_ % 16 == 0, "the hidden size must be a multiple of 16");
  TORCH_CHECK((int64_t)gate_ups_.size() == num_experts_ && (int64_t)downs_.size() == num_experts_,
              "one gate_up and one down weight per expert");
  TORCH_CHECK(0 < experts_per_token && experts_per_token <= num_experts_ && groups > 0 &&
              num_experts_ % groups == 0 && 0 < groups_kept && groups_kept <= groups &&
              experts_per_token <= groups_kept * (num_experts_ / groups), "routing: impossible k or groups");
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(), "shared experts: both matmuls or neither");
  TORCH_CHECK(!shared_gate.has_value() || shared_gate_up.has_value(), "a shared gate without shared experts");
  if (score_bias.has_value()) {
    score_bias_ = floats(*score_bias);
    TORCH_CHECK(score_bias_.numel() == num_experts_, "score_bias: [E]");
  }
  if (shared_gate.has_value()) {
    shared_gate_ = floats(*shared_gate);
    TORCH_CHECK(shared_gate_.numel() == hidden_, "shared gate: [H]");
  }
  std::vector<std::pair<const W4A8Weight*, const W4A8Weight*>> mlps;
  for (int64_t e = 0; e < num_experts_; ++e) mlps.emplace_back(&gate_ups_[e], &downs_[e]);
  if (shared_gate_up_.has_value()) mlps.emplace_back(&*shared_gate_up_, &*shared_down_);
  for (const auto& [gate_up, down] : mlps) {
    const int64_t inter = gate_up->out_features() / 2;
    TORCH_CHECK(gate_up->in_features() == hidden_ && down->in_features() == inter &&
                down->out_features() == hidden_ && inter % 16 == 0, "an expert's shapes do not match the router's");
  }
}

void W4A8MoE::route(const float* x, int64_t rows, int64_t* experts, float* weights) const {
  const int64_t E = num_experts_, k = routing_.experts_per_token, H = hidden_;
  const float* router = router_.data_ptr<float>();
  const float* bias = score_bias_.defined() ? score_bias_.data_ptr<float>() : nullptr;
  at::parallel_for(0, rows, 1, [&](int64_t first, int64_t end) {
    std::vector<float> scores(E), choice(E);  // each row's
    for (int64_t r = first; r < end; ++r) {
      for (int64_t e = 0; e < E; ++e) scores[e] = dot(x + r * H, router + e * H, H);
      if (routing_.sigmoid) {
        for (float& s : scores) s = 1.f / (1.f + std::exp(-s));
      } else {
        const float top = *std::max_element(scores.begin(), scores.end());
        float total = 0.f;
        for (float& s : scores) total += (s = std::exp(s - top));
        for (float& s : scores) s /= total;
      }
      // The bias only chooses experts; the weights are the unbiased scores.
      for (int64_t e = 0; e < E; ++e) choice[e] = scores[e] + (bias ? bias[e] : 0.f);
      if (routing_.groups > 1) {  // a group's score: the sum of its two best choices (DeepSeek-V3's noaux_tc)
        const int64_t size = E / routing_.groups;
        std::vector<float> group_scores(routing_.groups);
        std::vector<int64_t> two(std::min<int64_t>(2, size)), kept(routing_.groups_kept);
        for (int64_t g = 0; g < routing_.groups; ++g) {
          const std::vector<float> members(choice.begin() + g * size, choice.begin() + (g + 1) * size);
          best(members, (int64_t)two.size(), two.data());
          group_scores[g] = 0.f;
          for (int64_t i : two) group_scores[g] += members[i];
        }
        best(group_scores, routing_.groups_kept, kept.data());
        std::vector<bool> keep(routing_.groups, false);
        for (int64_t g : kept) keep[g] = true;
        for (int64_t e = 0; e < E; ++e) {
          if (!keep[e / size]) choice[e] = -std::numeric_limits<float>::infinity();
        }
      }
      int64_t* chosen = experts + r * k;
      float* weight = weights + r * k;
      best(choice, k, chosen);
      float total = 0.f;
      for (int64_t s = 0; s < k; ++s) total += (weight[s] = scores[chosen[s]]);
      // GLM and DeepSeek add 1e-20 to the sum; Qwen adds nothing (a softmax sum is never near zero).
      const float divisor = total + (routing_.sigmoid ? 1e-20f : 0.f);
      for (int64_t s = 0; s < k; ++s) {
        if (routing_.renormalize) weight[s] /= divisor;
        weight[s] *= routing_.scaling;
      }
    }
  });
}

void swiglu_rows(const float* x, int64_t n, const W4A8Weight& gate_up, const W4A8Weight& down, float* out) {
  const int64_t inter = gate_up.out_features() / 2;
  std::vector<float> both(n * 2 * inter), act(n * inter);  // [n, 2I], [n, I]
  w4a8_rows(x, n, gate_up, both.data());
  silu_times_up(both.data(), n, inter, act.data());
  w4a8_rows(act.data(), n, down, out);
}

void W4A8MoE::run(const float* x, int64_t rows, float* out, int64_t* chosen) const {
  const int64_t k = routing_.experts_per_token, H = hidden_;
  std::vector<int64_t> experts(rows * k);  // [R, k]
  std::vector<float> weights(rows * k);    // [R, k]
  route(x, rows, experts.data(), weights.data());
  if (chosen != nullptr) std::copy(experts.begin(), experts.end(), chosen);
  std::vector<std::vector<int64_t>> pairs(num_experts_);  // each expert's (row, slot) pairs, as r * k + s
  for (int64_t p = 0; p < rows * k; ++p) pairs[experts[p]].push_back(p);
  std::vector<float> products(rows * k * H), inputs, outputs;  // products [R, k, H]
  int64_t touched = 0;
  for (int64_t e = 0; e < num_experts_; ++e) {
    const int64_t n = (int64_t)pairs[e].size();
    if (n == 0) continue;
    ++touched;
    inputs.resize(n * H);
    outputs.resize(n * H);
    for (int64_t j = 0; j < n; ++j) std::copy_n(x + pairs[e][j] / k * H, H, inputs.data() + j * H);
    swiglu_rows(inputs.data(), n, gate_ups_[e], downs_[e], outputs.data());
    for (int64_t j = 0; j < n; ++j) {
      const int64_t p = pairs[e][j];
      for (int64_t i = 0; i < H; ++i) products[p * H + i] = outputs[j * H + i] * weights[p];
    }
  }
  touched_.store(touched, std::memory_order_relaxed);
  for (int64_t r = 0; r < rows; ++r) {  // a row's slots summed in slot order
    float* sum = out + r * H;
    std::copy_n(products.data() + r * k * H, H, sum);
    for (int64_t s = 1; s < k; ++s) {
      const float* product = products.data() + (r * k + s) * H;
      for (int64_t i = 0; i < H; ++i) sum[i] += product[i];
    }
  }
  if (!shared_gate_up_.has_value()) return;
  std::vector<float> shared(rows * H);  // [R, H]
  swiglu_rows(x, rows, *shared_gate_up_, *shared_down_, shared.data());
  for (int64_t r = 0; r < rows; ++r) {  // ungated, a gate of exactly 1
    const float gate = shared_gate_.defined()
        ? 1.f / (1.f + std::exp(-dot(x + r * H, shared_gate_.data_ptr<float>(), H))) : 1.f;
    for (int64_t i = 0; i < H; ++i) out[r * H + i] += gate * shared[r * H + i];
  }
}

std::tuple<torch::Tensor, torch::Tensor> W4A8MoE::forward(torch::Tensor x) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x: [R, H] contiguous float32");
  const int64_t rows = x.size(0), k = routing_.experts_per_token;
  torch::Tensor out = torch::empty({rows, hidden_}, torch::kFloat);
  torch::Tensor experts = torch::empty({rows, k}, torch::kLong);
  run(x.data_ptr<float>(), rows, out.data_ptr<float>(), experts.data_ptr<int64_t>());
  return {out, experts};
}

int64_t W4A8Feedforward::check(int64_t hidden) const {
  if (moe) {
    TORCH_CHECK(!gate_up.has_value() && moe->hidden() == hidden, "experts of the layer's hidden size, alone");
    return 0;
  }
  TORCH_CHECK(gate_up.has_value() && down.has_value(), "a dense MLP needs gate_up and down");
  const int64_t inter = gate_up->out_features() / 2;
  TORCH_CHECK(gate_up->in_features() == hidden && down->in_features() == inter && down->out_features() == hidden &&
              inter % 16 == 0, "MLP shapes do not match the layer's");
  return inter;
}

void W4A8Feedforward::run(const float* x, int64_t rows, float* out) const {
  if (moe) {
    moe->run(x, rows, out);
  } else {
    swiglu_rows(x, rows, *gate_up, *down, out);
  }
}
