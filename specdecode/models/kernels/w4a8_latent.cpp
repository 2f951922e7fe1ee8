// The fused w4a8 latent-attention layer (w4a8_latent.h). In PyTorch the layer took about 80 small ops at one
// token (conversions, norms, rope, concatenations around its eight matmul calls), which on GLM-4.7-Flash's widths
// cost more than its matmuls; here they are a few loops over the rows.
#include "w4a8_latent.h"
#include "attention.h"
#include "head_products.h"
#include "row_ops.h"

namespace {

torch::Tensor buffer(int64_t rows, int64_t n) { return torch::empty({rows, n}, torch::kFloat); }

}  // namespace

W4A8LatentLayer::W4A8LatentLayer(
    torch::Tensor attn_norm, c10::optional<W4A8Weight> q, c10::optional<W4A8Weight> q_a,
    c10::optional<torch::Tensor> q_a_norm, c10::optional<W4A8Weight> q_b, W4A8Weight kv_a, torch::Tensor kv_a_norm,
    torch::Tensor key_weights, c10::optional<torch::Tensor> key_scales, torch::Tensor value_weights,
    c10::optional<torch::Tensor> value_scales, W4A8Weight o, torch::Tensor mlp_norm, c10::optional<W4A8Weight> gate_up,
    c10::optional<W4A8Weight> down, std::shared_ptr<W4A8MoE> moe, int64_t heads, int64_t nope, int64_t rope,
    int64_t latent, int64_t value, bool interleave, double query_scale, double eps, double latent_eps)
    : attn_norm_(floats(attn_norm)), kv_a_norm_(floats(kv_a_norm)), mlp_norm_(floats(mlp_norm)), q_(q), q_a_(q_a),
      q_b_(q_b), kv_a_(kv_a), o_(o), key_weights_(key_weights), value_weights_(value_weights),
      key_scales_(key_scales), value_scales_(value_scales), feedforward_{gate_up, down, std::move(moe)},
      shape_{heads, nope, rope, latent, value, interleave, query_scale, eps, latent_eps} {
  hidden_ = attn_norm_.numel();
  const int64_t query = heads * (nope + rope), width = latent + rope;
  TORCH_CHECK(hidden_ % 16 == 0 && latent % 16 == 0 && width % 16 == 0 && rope % 2 == 0,
              "hidden size, latent width and cached row must be multiples of 16, the rotary part even");
  TORCH_CHECK(q.has_value() != (q_a.has_value() && q_a_norm.has_value() && q_b.has_value()),
              "the query is q alone, or q_a, q_a_norm and q_b");
  if (q.has_value()) {
    TORCH_CHECK(q->in_features() == hidden_ && q->out_features() == query, "q: [nh (nope + rope), hidden]");
  } else {
    q_a_norm_ = floats(*q_a_norm);
    const int64_t rank = q_a_norm_.numel();
    TORCH_CHECK(rank % 16 == 0 && q_a->in_features() == hidden_ && q_a->out_features() == rank &&
                q_b->in_features() == rank && q_b->out_features() == query, "q_a, q_b: the query's low rank");
  }
  TORCH_CHECK(kv_a.in_features() == hidden_ && kv_a.out_features() == width && kv_a_norm_.numel() == latent,
              "kv_a: [C + R, hidden], its norm [C]");
  check_head_weights(key_weights_, key_scales_);
  check_head_weights(value_weights_, value_scales_);
  TORCH_CHECK(key_weights_.size(0) == heads && key_weights_.size(1) == nope && key_weights_.size(2) == latent &&
              value_weights_.size(0) == heads && value_weights_.size(1) == latent && value_weights_.size(2) == value,
              "key weights [nh, nope, C], value weights [nh, C, v]");
  TORCH_CHECK(o.in_features() == heads * value && o.out_features() == hidden_, "o: [hidden, nh v]");
  feedforward_.check(hidden_);
}

void W4A8LatentLayer::rotate_into(const float* in, const float* cos, const float* sin, float* out) const {
  const int64_t half = shape_.rope / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = shape_.interleave ? in[2 * i] : in[i], b = shape_.interleave ? in[2 * i + 1] : in[i + half];
    out[i] = a * cos[i] - b * sin[i];
    out[i + half] = b * cos[i] + a * sin[i];
  }
}

torch::Tensor W4A8LatentLayer::forward(torch::Tensor x, std::vector<torch::Tensor> caches, std::vector<int64_t> starts,
                                       torch::Tensor cos, torch::Tensor sin, c10::optional<torch::Tensor> visible) {
  TORCH_CHECK(x.dim() == 3 && x.size(2) == hidden_ && x.scalar_type() == torch::kFloat && x.is_contiguous(),
              "x: [B, T, hidden] contiguous float32");
  const int64_t batch = x.size(0), new_tokens = x.size(1), rows = batch * new_tokens;
  const LatentShape& s = shape_;
  const int64_t heads = s.heads, head_query = s.nope + s.rope, width = s.latent + s.rope, half = s.rope / 2;
  TORCH_CHECK((int64_t)starts.size() == batch, "one start per sequence");
  const HeadShape attention{heads, 1, width};  // one key and one value head, both the cached row
  const std::vector<int64_t> capacities = check_caches(caches, caches, starts, new_tokens, attention);
  for (const auto& t : {cos, sin}) {
    TORCH_CHECK(t.scalar_type() == torch::kFloat && t.is_contiguous() && t.numel() == rows * half,
                "cos, sin: [B, 1, T, R/2] contiguous float32");
  }
  const torch::Tensor mask = check_visible(visible, batch, new_tokens);
  const float* cos_ = cos.data_ptr<float>();
  const float* sin_ = sin.data_ptr<float>();

  torch::Tensor out = x.clone();  // [B, T, hidden]: the residual stream
  float* residual = out.data_ptr<float>();
  torch::Tensor normed = buffer(rows, hidden_), query = buffer(rows, heads * head_query);
  rms_norm(residual, rows, hidden_, attn_norm_.data_ptr<float>(), (float)s.eps, normed.data_ptr<float>());
  if (q_.has_value()) {
    w4a8_rows(normed.data_ptr<float>(), rows, *q_, query.data_ptr<float>());
  } else {
    const int64_t rank = q_a_norm_.numel();
    torch::Tensor low = buffer(rows, rank);
    w4a8_rows(normed.data_ptr<float>(), rows, *q_a_, low.data_ptr<float>());
    rms_norm(low.data_ptr<float>(), rows, rank, q_a_norm_.data_ptr<float>(), (float)s.latent_eps, low.data_ptr<float>());
    w4a8_rows(low.data_ptr<float>(), rows, *q_b_, query.data_ptr<float>());
  }
  torch::Tensor kv = buffer(rows, width);  // [R, C + R]: the latent, then the rotary key
  w4a8_rows(normed.data_ptr<float>(), rows, kv_a_, kv.data_ptr<float>());

  // qkv [R, (nh + 2) W]: each head's [latent query | rotated query], then the cached row twice (key and value).
  torch::Tensor qkv = buffer(rows, (heads + 2) * width);
  float* qkv_ = qkv.data_ptr<float>();
  head_products_rows(query.data_ptr<float>(), heads * head_query, head_query, rows, key_weights_, key_scales_, qkv_,
                     (heads + 2) * width, width);
  const float scale = (float)s.query_scale;
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos_ + r * half;
    const float* sn = sin_ + r * half;
    float* row = qkv_ + r * (heads + 2) * width;
    for (int64_t h = 0; h < heads; ++h) {
      float* head = row + h * width;
      rotate_into(query.data_ptr<float>() + (r * heads + h) * head_query + s.nope, c, sn, head + s.latent);
      for (int64_t i = 0; i < width; ++i) head[i] *= scale;
    }
    float* cached = row + heads * width;
    const float* latent_in = kv.data_ptr<float>() + r * width;
    rms_norm(latent_in, 1, s.latent, kv_a_norm_.data_ptr<float>(), (float)s.latent_eps, cached);
    rotate_into(latent_in + s.latent, c, sn, cached + s.latent);
    std::copy_n(cached, width, cached + width);
  }
  torch::Tensor attended = buffer(rows, heads * width), values = buffer(rows, heads * s.value);
  attend_rows(qkv_, caches, caches, capacities, starts, new_tokens, mask, attention, attended.data_ptr<float>());
  head_products_rows(attended.data_ptr<float>(), heads * width, width, rows, value_weights_, value_scales_,
                     values.data_ptr<float>(), heads * s.value, s.value);
  torch::Tensor projected = buffer(rows, hidden_);
  w4a8_rows(values.data_ptr<float>(), rows, o_, projected.data_ptr<float>());
  float* added = projected.data_ptr<float>();
  for (int64_t i = 0; i < rows * hidden_; ++i) residual[i] += added[i];

  rms_norm(residual, rows, hidden_, mlp_norm_.data_ptr<float>(), (float)s.eps, normed.data_ptr<float>());
  feedforward_.run(normed.data_ptr<float>(), rows, added);
  for (int64_t i = 0; i < rows * hidden_; ++i) residual[i] += added[i];
  return out;
}
