"""Quantized linear layers and the models built from them: int8, int4 and w4a8 (our own CPU kernels)."""
