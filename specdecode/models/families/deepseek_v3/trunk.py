"""DeepSeek-V3's trunk: the Llama-style pre-norm block with latent attention (decoder/mla.py) in place of
grouped-query attention, and the mixture of experts (decoder/moe.py) in every layer after the first dense ones; its
MTP modules' blocks are sparse latent-attention layers, as DeepSeek-V3's reference and transformers' MtpModel build
them. Its caches keep each token's latent and rotary key (decoder/latent_cache.py)."""

from __future__ import annotations

from torch import nn

from specdecode.models.decoder.latent_cache import LatentCache, latent_bytes_per_token
from specdecode.models.decoder.layers import DecoderLayer
from specdecode.models.decoder.mla import LatentAttention
from specdecode.models.decoder.moe import MoEBlock, MoETransformer
from specdecode.models.model_config import ModelConfig


class LatentTransformer(MoETransformer):
    @staticmethod
    def build_layers(config: ModelConfig) -> nn.ModuleList:
        return nn.ModuleList(latent_layer(config, config.moe.sparse(i)) for i in range(config.num_layers))

    @staticmethod
    def build_mtp_block(config: ModelConfig) -> nn.Module:
        return latent_layer(config, sparse=True)

    def new_cache(self, capacity: int, batch_size: int = 1, rollback_rows: int = 1) -> LatentCache:
        c = self.config
        return LatentCache(c.num_layers, batch_size, c.mla.width, capacity, self.dtype, self.device)

    def cache_bytes(self, slots: int, rollback_rows: int = 1) -> int:
        return slots * latent_bytes_per_token(self.config.num_layers, self.config.mla.width, self.dtype)

    def new_mtp_cache(self, capacity: int) -> LatentCache:
        return LatentCache(1, 1, self.config.mla.width, capacity, self.dtype, self.device)


def latent_layer(config: ModelConfig, sparse: bool) -> DecoderLayer:
    """A pre-norm block with latent attention, and experts if `sparse` (built on the meta device: the replaced
    attention and MLP allocate nothing)."""
    layer = DecoderLayer(config)
    layer.attn = LatentAttention(config)
    if sparse:
        layer.mlp = MoEBlock(config)
    return layer


def attentions(model: LatentTransformer) -> list[LatentAttention]:
    """Every latent attention of the trunk and of its MTP modules."""
    return [module for module in model.modules() if isinstance(module, LatentAttention)]
