"""Gemma 4's assistant: the drafter Google ships with each small Gemma 4 model (transformers'
Gemma4AssistantForCausalLM), run over our Gemma 4 trunk's KV cache.

One drafting step at the position p of the last committed token (whose keys the target has not computed yet):
    x = pre_projection([embedding of the token ; hidden]), [2 B] -> [H]
        (the target's scaled embedding; the hidden state is the target's final one at p - 1 for the first step,
        then the assistant's own, projected back)
    a few Gemma 4 layers whose queries (at rope position p, every step) attend to the target's cache as it stands:
        full layers to every committed slot of the target's last full layer that computes keys and values, sliding
        layers to the last `sliding_window` + 1 slots of its last such sliding layer (transformers' window for
        the assistant); they compute no keys or values and write nothing
    final norm -> logits (the output head, or the centroid head) and post_projection -> the next step's hidden.
The centroid head scores `num_centroids` clusters, keeps the top `centroid_intermediate_top_k` and scores only their
tokens (token_ordering lists each cluster's); every other token gets no probability (-inf).
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.models.decoder.kv_cache import KVCache
from specdecode.models.decoder.rope import RopeTable
from specdecode.models.families.gemma4.layers import GemmaDecoderLayer
from specdecode.models.families.gemma4.norm import GemmaRMSNorm
from specdecode.models.families.gemma4.trunk import gemma_frequencies
from specdecode.models.model_config import ModelConfig


class GemmaAssistant(nn.Module):
    def __init__(self, config: ModelConfig, backbone_hidden: int, centroids: int, top_clusters: int):
        """`config`: the assistant's own (every layer KV-shared); centroids 0: the whole output head."""
        super().__init__()
        self.config = config
        hidden = config.hidden_size
        self.pre_projection = nn.Linear(2 * backbone_hidden, hidden, bias=False)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i, per_layer_size=0) for i in range(config.num_layers))
        self.norm = GemmaRMSNorm(hidden, config.rms_norm_eps)
        self.post_projection = nn.Linear(hidden, backbone_hidden, bias=False)
        self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.top_clusters = top_clusters
        if centroids:
            self.centroids = nn.Linear(hidden, centroids, bias=False)
            self.register_buffer("token_ordering", torch.zeros(config.vocab_size, dtype=torch.long))
        self.has_centroids = bool(centroids)
        self.ropes: dict[str, RopeTable] = {}

    def read_cache_of(self, target_cache_shape: tuple[int, int]) -> None:
        """Its layers read slots of the target's shape (GemmaAttention.to_slot)."""
        for layer in self.layers:
            layer.attn.cache_shape = target_cache_shape

    def finish_loading(self) -> None:
        weight = self.pre_projection.weight
        self.ropes = {kind: RopeTable(gemma_frequencies(self.config, kind), self.config.max_position_embeddings,
                                      weight.dtype, weight.device) for kind in set(self.config.layer_types)}

    @property
    def dtype(self) -> torch.dtype:
        return self.pre_projection.weight.dtype

    def forward(
        self,
        embedding: torch.Tensor,  # [1, 1, B] the target's scaled embedding of the token at p
        hidden: torch.Tensor,  # [1, 1, B] the hidden state fed back
        position: int,  # p: the target's cache holds positions 0..p-1
        cache: KVCache,  # the target's (one sequence)
        slots: dict[str, int],  # layer kind -> the target's cache slot it reads
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (logits [V] float32, the hidden state to feed back [1, 1, B])."""
        x = self.pre_projection(torch.cat([embedding, hidden], dim=-1).to(self.dtype))  # [1, 1, H]
        positions = torch.tensor([[position]], device=x.device)  # [1, 1]
        committed = cache.lengths[0]
        window = self.config.family_parts.sliding_window + 1
        for layer in self.layers:
            cos, sin = self.ropes[layer.kind].lookup(positions)  # [1, 1, 1, D/2] each
            first = max(0, committed - window) if layer.kind == "sliding_attention" else 0
            view = _SlotView(cache, first)
            x = layer(x, cos, sin, view, slots[layer.kind], None)
        normed = self.norm(x)  # [1, 1, H]
        return self.logits(normed[0, 0]), self.post_projection(normed)

    def logits(self, normed: torch.Tensor) -> torch.Tensor:
        """normed [H] -> [V] float32, over the top clusters' tokens only where there is a centroid head."""
        if not self.has_centroids:
            return self.lm_head(normed).float()
        clusters = self.centroids(normed).topk(self.top_clusters).indices  # [k]
        per_cluster = self.config.vocab_size // self.centroids.out_features
        ids = self.token_ordering.view(-1, per_cluster)[clusters].reshape(-1)  # [k * V/C]
        scores = self.lm_head.weight[ids] @ normed  # [k * V/C]
        logits = torch.full((self.config.vocab_size,), float("-inf"), device=normed.device)  # [V]
        return logits.index_copy(0, ids, scores.float())


class _SlotView:
    """The target's cache seen by an assistant layer: its committed slots from `first` on, read only (laid out as
    the target's layers lay them out: the assistant's attention is told the target's cache_shape)."""

    def __init__(self, cache: KVCache, first: int):
        self.cache, self.first = cache, first

    def read(self, layer: int, new: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.cache.read(layer, 0)  # [1, Hc, S, Dc] each: the assistant's token is not in it
        return keys[:, :, self.first :], values[:, :, self.first :]
