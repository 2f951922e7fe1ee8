// The fused Gated DeltaNet recurrence (see delta_rule.h). Built with the w4a8 extension (same flags:
// -ffp-contract=off, so no multiply-add is fused differently from one build to another). For each row and head:
//     decayed = g S                       S [dk, dv], the parent row's state
//     delta   = beta (v - decayed^T k)    [dv]
//     S'      = decayed + k delta^T       written as the row's state
//     out     = S'^T q                    [dv]
// Sums over dk run in ascending order, one accumulator per value column (the inner loop over dv vectorises).
// A row's state may be written over its parent's (before == after): each element is read before it is written.
#include "delta_rule.h"
#include <ATen/Parallel.h>
#include <vector>

namespace {

void check(const torch::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == dims,
              "delta_rule: ", name, " must be a float32 CPU tensor of ", dims, " dimensions");
}

// One head's row: before [dk, dv] -> after [dk, dv], out [dv]; scratch [dv].
void row(const float* before, const float* q, const float* k, const float* v, float decay, float beta,
         int64_t dk, int64_t dv, float* after, float* out, float* scratch) {
  for (int64_t j = 0; j < dv; ++j) scratch[j] = 0.f;
  for (int64_t i = 0; i < dk; ++i) {  // scratch = decayed^T k
    const float* s = before + i * dv;
    const float ki = k[i];
    for (int64_t j = 0; j < dv; ++j) scratch[j] += (s[j] * decay) * ki;
  }
  for (int64_t j = 0; j < dv; ++j) {
    scratch[j] = (v[j] - scratch[j]) * beta;  // delta
    out[j] = 0.f;
  }
  for (int64_t i = 0; i < dk; ++i) {
    const float* s = before + i * dv;
    float* n = after + i * dv;
    const float ki = k[i], qi = q[i];
    for (int64_t j = 0; j < dv; ++j) {
      const float updated = s[j] * decay + ki * scratch[j];
      n[j] = updated;
      out[j] += updated * qi;
    }
  }
}

}  // namespace

std::tuple<torch::Tensor, std::vector<torch::Tensor>> delta_rule(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor decay, torch::Tensor beta, torch::Tensor state,
    c10::optional<torch::Tensor> parents, int64_t keep_from) {
  check(q, 4, "q");
  check(k, 4, "k");
  check(v, 4, "v");
  check(decay, 3, "decay");
  check(beta, 3, "beta");
  check(state, 4, "state");
  q = q.contiguous(), k = k.contiguous(), v = v.contiguous(), decay = decay.contiguous(), beta = beta.contiguous();
  state = state.contiguous();
  const int64_t batch = q.size(0), rows = q.size(1), heads = q.size(2), dk = q.size(3), dv = v.size(3);
  TORCH_CHECK(k.sizes() == q.sizes() && v.size(0) == batch && v.size(1) == rows && v.size(2) == heads &&
                  state.size(0) == batch && state.size(1) == heads && state.size(2) == dk && state.size(3) == dv &&
                  decay.size(0) == batch && decay.size(1) == rows && decay.size(2) == heads &&
                  beta.sizes() == decay.sizes(),
              "delta_rule: shapes do not agree");
  TORCH_CHECK(0 <= keep_from && keep_from <= rows, "delta_rule: keep_from out of range");
  torch::Tensor parent_rows;
  if (parents.has_value()) {
    parent_rows = parents->to(torch::kInt64).contiguous();
    TORCH_CHECK(parent_rows.dim() == 2 && parent_rows.size(0) == batch && parent_rows.size(1) == rows,
                "delta_rule: parents must be [B, T]");
    const int64_t* p = parent_rows.data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t t = 0; t < rows; ++t)
        TORCH_CHECK(p[b * rows + t] < t && (t > 0 || p[b * rows] == -1) && p[b * rows + t] >= -1,
                    "delta_rule: a row's parent must be an earlier row (row 0's is -1)");
  }
  auto out = torch::empty({batch, rows, heads, dv}, q.options());
  // A chain's rows before keep_from share one working state, updated in place (it stays in cache); the kept rows,
  // and every row of a tree (any may be a parent), get their own.
  std::vector<torch::Tensor> states;
  std::vector<float*> state_data;
  torch::Tensor working;
  if (!parents.has_value() && keep_from > 0) working = torch::empty({batch, heads, dk, dv}, q.options());
  for (int64_t t = 0; t < rows; ++t) {
    if (working.defined() && t < keep_from) {
      states.push_back(working);
    } else {
      states.push_back(torch::empty({batch, heads, dk, dv}, q.options()));
    }
    state_data.push_back(states.back().data_ptr<float>());
  }
  const float *qd = q.data_ptr<float>(), *kd = k.data_ptr<float>(), *vd = v.data_ptr<float>();
  const float *gd = decay.data_ptr<float>(), *bd = beta.data_ptr<float>(), *s0 = state.data_ptr<float>();
  const int64_t* pd = parents.has_value() ? parent_rows.data_ptr<int64_t>() : nullptr;
  float* od = out.data_ptr<float>();
  const int64_t head_state = dk * dv;
  // Each (sequence, head) runs its rows in order; the pairs are independent, so they split across threads.
  at::parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(dv);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / heads, h = pair % heads;
      for (int64_t t = 0; t < rows; ++t) {
        const int64_t parent = pd ? pd[b * rows + t] : t - 1;
        const float* before = (parent < 0 ? s0 : state_data[parent]) + (b * heads + h) * head_state;
        const int64_t at = (b * rows + t) * heads + h;  // this row's head in [B, T, H]
        row(before, qd + at * dk, kd + at * dk, vd + at * dv, gd[at], bd[at], dk, dv,
            state_data[t] + (b * heads + h) * head_state, od + at * dv, scratch.data());
      }
    }
  });
  return {out, std::vector<torch::Tensor>(states.begin() + keep_from, states.end())};
}
