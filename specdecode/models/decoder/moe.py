"""The mixture-of-experts block several families share (Qwen3-MoE, GLM-4.5, Gemma 4 26B-A4B and the others the
registry names): a router choosing `experts_per_token` of `num_experts` gated experts per token (SwiGLU, or GeGLU
for Gemma 4), shared experts beside them, and the dense layers a config keeps. Computed as transformers 5
computes it (its `grouped_mm` experts): each chosen expert's output times its routing weight, the k products
summed in float32 and rounded once.

Verification reads each expert once: the rows of a forward are grouped by expert, and each chosen expert runs
once over all of its rows. A row's result does not depend on which other rows share its experts: the router
computes each row's logits on their own, each expert's matmuls are row-invariant wherever the model is
batch-invariant (oneDNN's packed kernels or w4a8, probed at load), and a row's k products are summed in its own
slot order. So a drafted token verifies to the bits it decodes to alone.

Where every expert is w4a8, the same block runs as one compiled call instead (kernels/w4a8_moe.py): at one token
a step this PyTorch form's few dozen small ops a layer cost more than the experts' matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.layers import ACTIVATIONS, MLP, DecoderLayer
from specdecode.models.decoder.packed_linear import PackedLinear, can_pack, rows_invariant
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.model_config import ModelConfig

SCORINGS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    """A config's mixture-of-experts part (ModelConfig.moe), filled in by each family from its own field names."""

    num_experts: int
    experts_per_token: int  # k: experts each token is routed to
    expert_size: int  # each routed expert's intermediate width (moe_intermediate_size)
    dense_layers: tuple[int, ...] = ()  # layers keeping a dense MLP of the config's intermediate_size
    scoring: str = "softmax"  # router scores: softmax over all experts (Qwen) or each expert's sigmoid (GLM)
    score_bias: bool = False  # e_score_correction_bias: added to the scores to choose experts, never to weigh them
    groups: int = 1  # n_group: experts split in groups, ...
    groups_kept: int = 1  # topk_group: ... and only the best groups' experts may be chosen
    renormalize: bool = False  # norm_topk_prob: the k weights divided by their sum
    scaling: float = 1.0  # routed_scaling_factor, after the renormalisation
    float32_router: bool = False  # GLM, DeepSeek: logits and weights in float32 (Qwen: logits in the model dtype)
    shared_size: int = 0  # the shared experts' intermediate width, all of them as one MLP; 0 = none
    shared_gate: bool = False  # Qwen 3.5: the shared expert's output times sigmoid(a linear of the input)
    shared_name: str = "shared_experts"  # what checkpoints call them after "mlp." (Qwen 3.5: shared_expert)
    activation: str = "silu"  # the experts' gate (decoder/layers.ACTIVATIONS): SwiGLU, or gelu_tanh (Gemma 4)

    def check(self, config: ModelConfig) -> None:
        sizes = {"num_experts": self.num_experts, "num_experts_per_tok": self.experts_per_token,
                 "moe_intermediate_size": self.expert_size, "n_group": self.groups, "topk_group": self.groups_kept}
        for name, value in sizes.items():
            if type(value) is not int or value < 1:
                raise SpecDecodeError(f"config: {name} must be a positive integer, got {value!r}")
        if self.experts_per_token > self.num_experts:
            raise SpecDecodeError(f"config: num_experts_per_tok ({self.experts_per_token}) is more than the "
                                  f"{self.num_experts} experts")
        if self.num_experts % self.groups or self.groups_kept > self.groups:
            raise SpecDecodeError(f"config: n_group ({self.groups}) must divide the {self.num_experts} experts and "
                                  f"topk_group ({self.groups_kept}) be at most n_group")
        if self.groups > 1 and self.experts_per_token > self.groups_kept * (self.num_experts // self.groups):
            raise SpecDecodeError(f"config: topk_group ({self.groups_kept}) groups hold fewer than the "
                                  f"{self.experts_per_token} experts a token is routed to")
        if self.scoring not in SCORINGS:
            raise SpecDecodeError(f"config: unknown router scoring {self.scoring!r}; known: {', '.join(SCORINGS)}")
        if not all(type(i) is int and 0 <= i < config.num_layers for i in self.dense_layers):
            raise SpecDecodeError(f"config: dense layers {list(self.dense_layers)} must be layer indices below "
                                  f"{config.num_layers}")
        if self.activation not in ACTIVATIONS:
            raise SpecDecodeError(f"config: unknown expert activation {self.activation!r}; known: "
                                  f"{', '.join(ACTIVATIONS)}")
        if type(self.shared_size) is not int or self.shared_size < 0:
            raise SpecDecodeError(f"config: the shared experts' width must be a non-negative integer, got "
                                  f"{self.shared_size!r}")

    def sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` holds experts (else a dense MLP)."""
        return layer not in self.dense_layers


def dense_layers(layers: int, mlp_only: list[int] | tuple[int, ...] = (), sparse_step: int = 1,
                 first_dense: int = 0) -> tuple[int, ...]:
    """The layers transformers builds dense: those in mlp_only_layers, those not a multiple of
    decoder_sparse_step (counting from 1, as Qwen's MoE), and the first first_k_dense_replace (GLM, DeepSeek)."""
    if type(sparse_step) is not int or sparse_step < 1:
        raise SpecDecodeError(f"config: decoder_sparse_step must be a positive integer, got {sparse_step!r}")
    return tuple(i for i in range(layers) if i in mlp_only or (i + 1) % sparse_step or i < first_dense)


class Router(nn.Module):
    """Scores every expert for each row and keeps the best k: (weights [N, k], experts [N, k])."""

    in_kernel = False  # whether a compiled block runs it (kernels/w4a8_moe.py): then never packed for oneDNN

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.moe = moe
        # Not an nn.Linear: quantizers leave it in float, as llama.cpp never quantizes ffn_gate_inp.
        self.weight = nn.Parameter(torch.empty(moe.num_experts, config.hidden_size))  # [E, H]
        self.score_bias = nn.Parameter(torch.zeros(moe.num_experts)) if moe.score_bias else None  # [E]
        self.packed: PackedLinear | None = None  # the weight packed for oneDNN once loaded (pack)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] -> [N, E], in float32 for a float32 router, else in the model's dtype."""
        x = x.float() if self.moe.float32_router else x
        if self.packed is not None:
            return self.packed(x)
        return F.linear(x, self.weight.float() if self.moe.float32_router else self.weight)

    def pack(self) -> None:
        """Run the logits on oneDNN's packed kernel (packed_linear.py): a row's logits then do not depend on the
        number of rows, nor on where its weight sits in memory (MKL's, per row or not, depend on both), so a
        verify row is routed to the experts it is routed to alone."""
        linear = nn.Linear(self.weight.shape[1], self.weight.shape[0], bias=False, device=self.weight.device)
        linear.weight = nn.Parameter(self.weight.detach().float() if self.moe.float32_router else self.weight.detach())
        self.packed = PackedLinear(linear)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.logits(x)  # [N, E]
        weights, experts = self.choose(logits)  # [N, k] each
        return (weights if self.moe.float32_router else weights.to(logits.dtype)), experts

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [N, E] -> the k chosen experts' weights [N, k] float32 (renormalised and scaled as the config
        says) and the experts [N, k]."""
        moe = self.moe
        scores = logits.float().softmax(-1) if moe.scoring == "softmax" else logits.float().sigmoid()  # [N, E]
        choice = scores if self.score_bias is None else scores + self.score_bias.float()  # [N, E]
        if moe.groups > 1:
            choice = self.best_groups(choice)
        experts = choice.topk(moe.experts_per_token, dim=-1).indices  # [N, k]
        weights = scores.gather(1, experts)  # [N, k] unbiased scores
        if moe.renormalize:
            # GLM and DeepSeek add 1e-20 to the sum; Qwen adds nothing (a softmax sum is never near zero).
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
        return weights * moe.scaling if moe.scaling != 1.0 else weights, experts

    def best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice [N, E] with every expert outside the `groups_kept` best groups at -inf; a group's score is the
        sum of its two best choice scores (DeepSeek-V3's noaux_tc)."""
        moe = self.moe
        grouped = choice.view(choice.shape[0], moe.groups, -1)  # [N, G, E/G]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [N, G]
        kept = group_scores.topk(moe.groups_kept, dim=-1).indices  # [N, Gk]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [N, G]
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)


class MoEBlock(nn.Module):
    """Routed experts plus shared experts, in place of a decoder layer's MLP (same input and output)."""

    router_class = Router  # a family's own routing subclasses it (Gemma 4's, families/gemma4/moe.py)

    def __init__(self, config: ModelConfig):
        super().__init__()
        moe = config.moe
        self.router = self.router_class(config)
        self.experts = nn.ModuleList(MLP(config, moe.expert_size, moe.activation) for _ in range(moe.num_experts))
        self.shared = MLP(config, moe.shared_size) if moe.shared_size else None
        self.shared_gate = nn.Linear(config.hidden_size, 1, bias=False) if moe.shared_gate else None
        self.compiled = None  # the kernel's MoE that runs this block where one does (kernels/w4a8_moe.py)
        self.last_touched = 0  # the distinct experts this block's last PyTorch forward ran

    def touched(self) -> int:
        """The distinct experts the block's last forward read: the union of its rows' choices."""
        return self.compiled.touched() if self.compiled is not None else self.last_touched

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, T, H] -> [B, T, H]
        rows = x.reshape(-1, x.shape[-1])  # [N, H]
        weights, experts = self.router(rows)  # [N, k] each
        routed = self.routed(rows, weights, experts).to(x.dtype)  # [N, H]
        if self.shared is not None:
            shared = self.shared(rows)  # [N, H]
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(rows)) * shared
            routed = routed + shared
        return routed.view_as(x)

    def routed(self, rows: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """rows [N, H], weights and experts [N, k] -> [N, H] float32: every expert chosen by some row run once,
        over all of its rows; each row's k weighted outputs summed in its slot order."""
        count, chosen = experts.shape
        slots = experts.flatten()  # [N*k] the expert in each (row, slot)
        order = slots.argsort(stable=True)  # [N*k] (row, slot) pairs grouped by expert
        hits = torch.bincount(slots, minlength=len(self.experts)).tolist()  # rows per expert
        self.last_touched = sum(1 for hit in hits if hit)
        products = torch.empty(count * chosen, rows.shape[-1], dtype=torch.promote_types(rows.dtype, weights.dtype),
                               device=rows.device)  # [N*k, H]
        flat_weights = weights.flatten()  # [N*k]
        start = 0
        for expert, hit in enumerate(hits):
            if not hit:
                continue
            pairs = order[start : start + hit]  # [n] the (row, slot) pairs routed to this expert
            start += hit
            out = self.experts[expert](rows[pairs // chosen])  # [n, H]
            products[pairs] = out * flat_weights[pairs].unsqueeze(-1)  # in the weights' dtype, as transformers
        products = products.view(count, chosen, -1).float()  # [N, k, H]
        total = products[:, 0]  # [N, H] float32
        for slot in range(1, chosen):  # an explicit order: a reduction kernel may pick its own by the row count
            total = total + products[:, slot]
        return total


class MoETransformer(Transformer):
    """The Llama-style trunk with a mixture of experts for each sparse layer's MLP: the layers are DecoderLayers
    whose `mlp` is a MoEBlock, so the fixed-order float layers that replace DecoderLayer (keeping its submodules)
    keep the experts too. Its MTP modules' blocks are sparse (transformers builds them with no dense layer)."""

    routers_invariant = False  # whether every router runs on a row-invariant kernel (finish_loading)

    @staticmethod
    def build_layers(config: ModelConfig) -> nn.ModuleList:
        return nn.ModuleList(sparse_layer(config) if config.moe.sparse(i) else DecoderLayer(config)
                             for i in range(config.num_layers))

    @staticmethod
    def build_mtp_block(config: ModelConfig) -> nn.Module:
        return sparse_layer(config)

    def finish_loading(self, rope_factors: torch.Tensor | None = None) -> None:
        super().finish_loading(rope_factors)
        self.routers_invariant = pack_routers(self)


class ExpertTally:
    """The distinct experts a trunk's last forward read, per sparse layer on average (its MTP modules' blocks,
    which run while drafting, left out): a verify forward reads each of them once, so its cost grows with this
    count rather than with its rows (drafters/verify_cost.py)."""

    def __init__(self, blocks: list[MoEBlock], moe: MoEConfig):
        self.blocks = blocks
        self.num_experts, self.experts_per_token = moe.num_experts, moe.experts_per_token

    @classmethod
    def of(cls, model: nn.Module) -> ExpertTally | None:
        """The tally of a loaded (and fused) model's decoder layers, or None for a model without experts."""
        moe = getattr(getattr(model, "config", None), "moe", None)
        layers = getattr(model, "layers", None)
        blocks = [] if moe is None or layers is None else [m for m in layers.modules() if isinstance(m, MoEBlock)]
        return cls(blocks, moe) if blocks else None

    def last(self) -> float:
        """Distinct experts per sparse layer in the last forward of the trunk."""
        return sum(block.touched() for block in self.blocks) / len(self.blocks)


def pack_routers(model: Transformer) -> bool:
    """Pack every router of a loaded model that runs in PyTorch for oneDNN where this machine has its kernels
    (Router.pack) -> whether every router is then row-invariant: those the w4a8 block kernel runs are by
    construction, the packed ones prove so by a probe at load (as the other packed matmuls)."""
    every = [module for module in model.modules() if isinstance(module, Router)]
    routers = [router for router in every if not router.in_kernel]
    if every and not routers:
        return True
    if not routers or not can_pack(model):
        return False
    for router in routers:
        router.pack()
    dtype = torch.float32 if model.config.moe.float32_router else model.dtype
    return rows_invariant(routers[0].packed, torch.Generator().manual_seed(0), dtype)


def sparse_layer(config: ModelConfig) -> DecoderLayer:
    layer = DecoderLayer(config)
    layer.mlp = MoEBlock(config)  # in place of the dense MLP (built on the meta device: nothing allocated)
    return layer
