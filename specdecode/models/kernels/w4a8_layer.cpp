// A w4a8 model's decoder layer in one call (see w4a8_decoder.py for the why): RMSNorm, the four w4a8 matmuls,
// q/k norms, rotary embeddings, the K/V cache write, attention and SiLU, with the residual stream in float32; or,
// for a mixture of experts, the same attention and the w4a8 expert block (w4a8_moe.cpp) in place of the MLP.
//
// Every row (token) is computed on its own and in the same order whatever else shares the call: the matmuls
// are batch-invariant (w4a8_kernel.cpp), norms and dot products reduce each row in a fixed order, and
// attention sums a row's visible slots in ascending slot order, skipping the rest. So a token's bits depend
// only on the slots it sees, not on how many tokens, sequences or masked slots share the forward.
// Built with -ffp-contract=off so that no a*b+c is fused differently in different places. Written on
// w4a8_simd.h's vectors, so the same algorithm (and order of every sum) is compiled for each instruction set.
#include "attention.h"
#include "delta_rule.h"
#include "head_products.h"
#include "w4a8_kernel.h"
#include "w4a8_latent.h"
#include "w4a8_moe.h"
#include "row_ops.h"
#include <memory>
#include <vector>

class W4A8DecoderLayer {
 public:
  // The MLP: a dense one (gate_up and down) or a mixture of experts (moe), as W4A8Feedforward.
  W4A8DecoderLayer(torch::Tensor attn_norm, W4A8Weight qkv, W4A8Weight o, torch::Tensor mlp_norm,
                   c10::optional<W4A8Weight> gate_up, c10::optional<W4A8Weight> down, std::shared_ptr<W4A8MoE> moe,
                   c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm, int64_t heads,
                   int64_t kv_heads, int64_t head_dim, double eps)
      : attn_norm_(floats(attn_norm)), mlp_norm_(floats(mlp_norm)), qkv_(qkv), o_(o),
        feedforward_{gate_up, down, std::move(moe)}, heads_(heads), kv_heads_(kv_heads), dim_(head_dim),
        hidden_(attn_norm_.numel()), eps_((float)eps) {
    TORCH_CHECK(hidden_ % 16 == 0 && dim_ % 16 == 0 && heads_ % kv_heads_ == 0,
                "hidden size and head size must be multiples of 16");
    TORCH_CHECK(qkv.in_features() == hidden_ && qkv.out_features() == (heads_ + 2 * kv_heads_) * dim_ &&
                o.in_features() == heads_ * dim_ && o.out_features() == hidden_, "layer shapes do not match");
    feedforward_.check(hidden_);
    if (q_norm.has_value()) q_norm_ = floats(*q_norm);
    if (k_norm.has_value()) k_norm_ = floats(*k_norm);
  }

  // x [B, T, hidden] float32; keys[b], values[b] [Hkv, capacity_b, D]: sequence b's cache for this layer
  // (float32 or bfloat16; each sequence its own tensor and capacity); starts [B]: each sequence's cached length,
  // where its T new slots go; cos, sin [B, 1, T, D/2] float32; visible [B, 1, T, S] bool (None: causal over the
  // new tokens, every cached slot visible; it never marks a slot at or past starts[b] + T) -> [B, T, hidden].
  torch::Tensor forward(torch::Tensor x, std::vector<torch::Tensor> keys, std::vector<torch::Tensor> values,
                        std::vector<int64_t> starts, torch::Tensor cos, torch::Tensor sin,
                        c10::optional<torch::Tensor> visible) {
    TORCH_CHECK(x.dim() == 3 && x.size(2) == hidden_ && x.scalar_type() == torch::kFloat && x.is_contiguous(),
                "x: [B, T, hidden] contiguous float32");
    const int64_t batch = x.size(0), new_tokens = x.size(1), rows = batch * new_tokens;
    TORCH_CHECK((int64_t)starts.size() == batch, "one start per sequence");
    const HeadShape shape{heads_, kv_heads_, dim_};
    const std::vector<int64_t> capacities = check_caches(keys, values, starts, new_tokens, shape);
    for (const auto& t : {cos, sin}) {
      TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == rows * dim_ / 2,
                  "cos, sin: [B, 1, T, D/2] contiguous float32");
    }
    const torch::Tensor mask = check_visible(visible, batch, new_tokens);

    torch::Tensor out = x.clone();  // [B, T, hidden]: the residual stream
    float* residual = out.data_ptr<float>();
    const auto buffer = [](int64_t r, int64_t n) { return torch::empty({r, n}, torch::kFloat); };
    torch::Tensor normed = buffer(rows, hidden_), qkv = buffer(rows, qkv_.out_features());
    torch::Tensor attended = buffer(rows, heads_ * dim_), projected = buffer(rows, hidden_);

    rms_norm(residual, rows, hidden_, attn_norm_.data_ptr<float>(), eps_, normed.data_ptr<float>());
    w4a8_rows(normed.data_ptr<float>(), rows, qkv_, qkv.data_ptr<float>());
    position_heads(qkv.data_ptr<float>(), rows, cos.data_ptr<float>(), sin.data_ptr<float>());
    attend_rows(qkv.data_ptr<float>(), keys, values, capacities, starts, new_tokens, mask, shape,
                attended.data_ptr<float>());
    w4a8_rows(attended.data_ptr<float>(), rows, o_, projected.data_ptr<float>());
    add_into(residual, projected.data_ptr<float>(), rows * hidden_);

    rms_norm(residual, rows, hidden_, mlp_norm_.data_ptr<float>(), eps_, normed.data_ptr<float>());
    feedforward_.run(normed.data_ptr<float>(), rows, projected.data_ptr<float>());
    add_into(residual, projected.data_ptr<float>(), rows * hidden_);
    return out;
  }

 private:
  static void add_into(float* target, const float* addend, int64_t n) {
    for (int64_t i = 0; i < n; ++i) target[i] += addend[i];
  }

  // q/k norms (Qwen3) and rotary embeddings, in place on qkv [R, (H + 2 Hkv) * D].
  void position_heads(float* qkv, int64_t rows, const float* cos, const float* sin) const {
    const int64_t width = (heads_ + 2 * kv_heads_) * dim_, half = dim_ / 2;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t h = 0; h < heads_ + kv_heads_; ++h) {
        float* head = qkv + r * width + h * dim_;
        const torch::Tensor& norm = h < heads_ ? q_norm_ : k_norm_;
        if (norm.defined()) rms_norm(head, 1, dim_, norm.data_ptr<float>(), eps_, head);
        rotate(head, cos + r * half, sin + r * half, half);
      }
    }
  }

  torch::Tensor attn_norm_, mlp_norm_, q_norm_, k_norm_;  // float32 weights; q/k norms undefined unless Qwen3
  W4A8Weight qkv_, o_;
  W4A8Feedforward feedforward_;
  int64_t heads_, kv_heads_, dim_, hidden_;
  float eps_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  // Module-local: each instruction-set variant is its own extension with its own copy of these classes.
  py::class_<W4A8Weight>(m, "Weight", py::module_local());
  m.def("weight", &make_weight, py::arg("codes"), py::arg("group_scales"), py::arg("block_scales"),
        py::arg("bias") = py::none());
  m.def("w4a8_mm", &w4a8_mm, py::call_guard<py::gil_scoped_release>());
  m.def("attend", &attend, py::call_guard<py::gil_scoped_release>());
  m.def("delta_rule", &delta_rule, py::call_guard<py::gil_scoped_release>());
  m.def("head_products", &head_products, py::arg("x"), py::arg("weights"), py::arg("scales") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  py::class_<W4A8MoE, std::shared_ptr<W4A8MoE>>(m, "MoE", py::module_local())
      .def(py::init<torch::Tensor, c10::optional<torch::Tensor>, std::vector<W4A8Weight>, std::vector<W4A8Weight>,
                    c10::optional<W4A8Weight>, c10::optional<W4A8Weight>, c10::optional<torch::Tensor>, int64_t, bool,
                    int64_t, int64_t, bool, double>())
      .def("forward", &W4A8MoE::forward, py::call_guard<py::gil_scoped_release>())
      .def("touched", &W4A8MoE::touched);
  py::class_<W4A8LatentLayer>(m, "LatentLayer", py::module_local())
      .def(py::init<torch::Tensor, c10::optional<W4A8Weight>, c10::optional<W4A8Weight>, c10::optional<torch::Tensor>,
                    c10::optional<W4A8Weight>, W4A8Weight, torch::Tensor, torch::Tensor, c10::optional<torch::Tensor>,
                    torch::Tensor, c10::optional<torch::Tensor>, W4A8Weight, torch::Tensor, c10::optional<W4A8Weight>,
                    c10::optional<W4A8Weight>, std::shared_ptr<W4A8MoE>, int64_t, int64_t, int64_t, int64_t, int64_t,
                    bool, double, double, double>())
      .def("forward", &W4A8LatentLayer::forward, py::call_guard<py::gil_scoped_release>());
  py::class_<W4A8DecoderLayer>(m, "DecoderLayer", py::module_local())
      .def(py::init<torch::Tensor, W4A8Weight, W4A8Weight, torch::Tensor, c10::optional<W4A8Weight>,
                    c10::optional<W4A8Weight>, std::shared_ptr<W4A8MoE>, c10::optional<torch::Tensor>,
                    c10::optional<torch::Tensor>, int64_t, int64_t, int64_t, double>())
      .def("forward", &W4A8DecoderLayer::forward, py::call_guard<py::gil_scoped_release>());
}
