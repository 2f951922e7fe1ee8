// Runs the w4a8 kernel core (specdecode/models/kernels/w4a8_core.cpp) and the fused layer's row operations
// (row_ops.h) without torch, so that tests/test_kernel_driver.py can build it for every instruction set, an ARM
// one under qemu-user included, and compare the bits each variant gives on the same inputs.
//
//   w4a8_driver INPUT OUTPUT
// INPUT: int64 N, K, M, bits (4 or 3); codes [N/16, K/32, bits * 64] uint8; group_scales [N/16, K/32, 32] uint8;
// block_scales [N/16, ceil(K/256), 32] bfloat16 bits; bias [N] float32; x [M, K] float32; norm weight [K] float32.
// OUTPUT: x times the weight [M, N]; rms_norm(x) [M, K]; silu(gate) * up with x's rows as [gate, up] [M, K/2];
// all float32. Before writing, it checks batch invariance itself: each row alone, and the rows in two uneven
// batches, give the bits the whole batch gives; it exits 1 saying which row differs.
#include "row_ops.h"
#include "w4a8_core.h"
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

template <typename T>
std::vector<T> read_values(FILE* file, int64_t count) {
  std::vector<T> values(count);
  if (fread(values.data(), sizeof(T), count, file) != (size_t)count) {
    fprintf(stderr, "input file too short\n");
    exit(2);
  }
  return values;
}

// out [rows, N] for x's rows [first, first + rows).
std::vector<float> matmul(const W4A8View& weight, const std::vector<float>& x, int64_t first, int64_t rows) {
  const int64_t K = weight.in_features, N = weight.out_features;
  const QuantizedRows quantized = quantize_rows(x.data() + first * K, rows, K);
  std::vector<float> out(rows * N);
  w4a8_tiles(quantized, weight, 0, N / 16, out.data());
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s INPUT OUTPUT\n", argv[0]);
    return 2;
  }
  FILE* input = fopen(argv[1], "rb");
  if (!input) {
    fprintf(stderr, "cannot read %s\n", argv[1]);
    return 2;
  }
  const std::vector<int64_t> sizes = read_values<int64_t>(input, 4);
  const int64_t N = sizes[0], K = sizes[1], M = sizes[2], bits = sizes[3], T = N / 16, G = K / 32;
  const auto codes = read_values<uint8_t>(input, T * G * bits * 64);
  const auto group_scales = read_values<uint8_t>(input, T * G * 32);
  const auto block_scales = read_values<uint16_t>(input, T * ((G + 7) / 8) * 32);
  const auto bias = read_values<float>(input, N);
  const auto x = read_values<float>(input, M * K);
  const auto norm_weight = read_values<float>(input, K);
  fclose(input);

  const W4A8View weight{codes.data(), group_scales.data(), block_scales.data(), bias.data(), N, K, (int)bits};
  const std::vector<float> together = matmul(weight, x, 0, M);  // [M, N]
  const int64_t split = M / 3 + 1;  // two uneven batches, [0, split) and [split, M)
  for (int64_t m = 0; m < M; ++m) {
    const std::vector<float> alone = matmul(weight, x, m, 1);
    const int64_t first = m < split ? 0 : split;
    const std::vector<float> batch = matmul(weight, x, first, m < split ? split : M - split);
    if (memcmp(alone.data(), &together[m * N], N * sizeof(float)) != 0 ||
        memcmp(&batch[(m - first) * N], &together[m * N], N * sizeof(float)) != 0) {
      fprintf(stderr, "row %lld: not the same bits alone, in a batch of part of the rows and in the whole batch\n",
              (long long)m);
      return 1;
    }
  }
  std::vector<float> normed(M * K), act(M * K / 2);
  rms_norm(x.data(), M, K, norm_weight.data(), 1e-6f, normed.data());
  silu_times_up(x.data(), M, K / 2, act.data());

  FILE* output = fopen(argv[2], "wb");
  if (!output) {
    fprintf(stderr, "cannot write %s\n", argv[2]);
    return 2;
  }
  for (const std::vector<float>& part : {together, normed, act}) fwrite(part.data(), sizeof(float), part.size(), output);
  fclose(output);
  return 0;
}
