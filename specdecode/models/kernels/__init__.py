"""Our CPU kernels and the layers that run on them: int8, int4 and w4a8 linears (int4 weights with int8
activations, C++ with AVX-512 VNNI, AVX2 or NEON), the fused w4a8 decoder layer, and the fixed-order float
attention; compiled at first use."""
