"""Whether a model's forward is batch-invariant: a token's logits bitwise the same however many rows and
sequences share its forward (decoded alone, verified in a chain or a tree, batched with other requests)."""

from __future__ import annotations

from specdecode.models.float_decoder import FloatDecoderLayer
from specdecode.models.quant.w4a8_decoder import W4A8DecoderLayer
from specdecode.models.quant.w4a8_linear import W4A8Linear
from specdecode.models.transformer import Transformer


def batch_invariant(model: Transformer) -> bool:
    """Every decoder layer fused for w4a8 with a w4a8 output head, or every layer a fixed-order float layer
    (installed only with row-invariant linears) and the output head the one fix_float_layers probed. The
    embedding and the final norm work row by row anyway."""
    if all(isinstance(layer, W4A8DecoderLayer) for layer in model.layers):
        return isinstance(model.lm_head, W4A8Linear)
    return (all(isinstance(layer, FloatDecoderLayer) for layer in model.layers)
            and getattr(model.lm_head, "rows_invariant_checked", False))
