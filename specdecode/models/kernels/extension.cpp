// The torch extension's one translation unit: every file that uses torch's headers, included here and compiled
// together. torch/extension.h takes about 25 s to parse at -O3, so seven translation units spent most of a
// variant's two-minute compile parsing the same headers seven times; one takes about 35 s. w4a8_core.cpp stays
// its own unit: it is torch-free, and the kernel driver (tests/kernel_driver) builds it alone.
// The files keep their own anonymous namespaces; a name two of them define alike fails this compile, not a user's.
#include "attention.cpp"
#include "delta_rule.cpp"
#include "head_products.cpp"
#include "w4a8_kernel.cpp"
#include "w4a8_latent.cpp"
#include "w4a8_moe.cpp"
#include "w4a8_layer.cpp"
