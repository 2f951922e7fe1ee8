"""Hugging Face names of the parts several families share, and the shapes a config implies for them: the Llama-style
decoder block (self_attn.{q,k,v,o}_proj with their biases and q/k norms, mlp.{gate,up,down}_proj, the two norms)
and the published MTP layouts (DeepSeek's and MiMo's names for a module's norms and projection). Names are without
"model."; our parameter names fuse q/k/v and gate/up so each layer streams two fewer weights per token."""

from __future__ import annotations

from dataclasses import replace

from specdecode.models.model_config import ModelConfig

# Our MTP module parts (decoder/mtp.py) -> their names in each layout, after the layout's prefix.
MTP_NAMES = {
    "deepseek": {"token_norm": "enorm", "hidden_norm": "hnorm", "proj": "eh_proj", "out_norm": "shared_head.norm"},
    "mimo": {"token_norm": "token_layernorm", "hidden_norm": "hidden_layernorm", "proj": "input_proj",
             "out_norm": "final_layernorm"},
}
# DeepSeek-named modules may carry copies of the trunk's embedding and head ("shares parameters" in
# DeepSeek-V3's README_WEIGHTS); like SGLang we use the trunk's own and never read these.
MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def attention_sources(dst: str, src: str, config: ModelConfig) -> dict[str, list[str]]:
    """A Llama-style attention's parameters under `dst` -> the Hugging Face names under `src` they stack."""
    sources = {}
    for kind in ("weight", "bias"):
        if kind == "weight" or config.qkv_bias:
            sources[dst + f"attn.qkv.{kind}"] = [src + f"self_attn.{p}_proj.{kind}" for p in "qkv"]
        if kind == "weight" or config.o_bias:
            sources[dst + f"attn.o.{kind}"] = [src + f"self_attn.o_proj.{kind}"]
    if config.qk_norm:
        sources[dst + "attn.q_norm.weight"] = [src + "self_attn.q_norm.weight"]
        sources[dst + "attn.k_norm.weight"] = [src + "self_attn.k_norm.weight"]
    return sources


def mlp_sources(dst: str, src: str, config: ModelConfig) -> dict[str, list[str]]:
    """A gated MLP's parameters under `dst` -> the Hugging Face names under `src` they stack."""
    sources = {dst + "mlp.gate_up.weight": [src + "mlp.gate_proj.weight", src + "mlp.up_proj.weight"],
               dst + "mlp.down.weight": [src + "mlp.down_proj.weight"]}
    if config.mlp_bias:
        sources[dst + "mlp.gate_up.bias"] = [src + "mlp.gate_proj.bias", src + "mlp.up_proj.bias"]
        sources[dst + "mlp.down.bias"] = [src + "mlp.down_proj.bias"]
    return sources


def block_sources(dst: str, src: str, config: ModelConfig, sparse: bool = False) -> dict[str, list[str]]:
    """One Llama-style decoder layer's parameters under `dst` -> the Hugging Face names under `src`; `sparse`: its
    MLP is a mixture of experts (decoder/moe.py)."""
    return ({dst + "attn_norm.weight": [src + "input_layernorm.weight"],
             dst + "mlp_norm.weight": [src + "post_attention_layernorm.weight"]}
            | attention_sources(dst, src, config)
            | (moe_sources(dst, src, config) if sparse else mlp_sources(dst, src, config)))


def moe_sources(dst: str, src: str, config: ModelConfig) -> dict[str, list[str]]:
    """A mixture of experts' parameters under `dst` -> the Hugging Face names under `src`: the router `mlp.gate`,
    each expert under `mlp.experts.{e}.` (a fused folder's are read under these names too, weight_source.py), and
    the shared experts under the name the family gives them (MoEConfig.shared_name)."""
    moe = config.moe
    sources = {dst + "mlp.router.weight": [src + "mlp.gate.weight"]}
    if moe.score_bias:
        sources[dst + "mlp.router.score_bias"] = [src + "mlp.gate.e_score_correction_bias"]
    for e in range(moe.num_experts):
        expert = f"{src}mlp.experts.{e}."
        sources[dst + f"mlp.experts.{e}.gate_up.weight"] = [expert + "gate_proj.weight", expert + "up_proj.weight"]
        sources[dst + f"mlp.experts.{e}.down.weight"] = [expert + "down_proj.weight"]
    if moe.shared_size:
        shared = f"{src}mlp.{moe.shared_name}."
        sources[dst + "mlp.shared.gate_up.weight"] = [shared + "gate_proj.weight", shared + "up_proj.weight"]
        sources[dst + "mlp.shared.down.weight"] = [shared + "down_proj.weight"]
    if moe.shared_gate:
        sources[dst + "mlp.shared_gate.weight"] = [f"{src}mlp.{moe.shared_name}_gate.weight"]
    return sources


def moe_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A mixture of experts' stored names (after the layer's prefix) -> their shapes."""
    moe, hidden = config.moe, config.hidden_size
    shapes = {"mlp.gate.weight": (moe.num_experts, hidden), "mlp.gate.e_score_correction_bias": (moe.num_experts,)}
    for e in range(moe.num_experts):
        shapes.update({f"mlp.experts.{e}.{name.removeprefix('mlp.')}": shape for name, shape in
                       mlp_shapes(hidden, moe.expert_size).items() if name.endswith("weight")})
    shared = {name.replace("mlp.", f"mlp.{moe.shared_name}.", 1): shape
              for name, shape in mlp_shapes(hidden, moe.shared_size).items() if name.endswith("weight")}
    return shapes | shared | {f"mlp.{moe.shared_name}_gate.weight": (1, hidden)}


def attention_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Llama-style attention's stored names (after the layer's prefix) -> their shapes."""
    hidden, head = config.hidden_size, config.head_dim
    q_size, kv_size = config.num_heads * head, config.num_kv_heads * head
    return {"self_attn.q_proj.weight": (q_size, hidden), "self_attn.k_proj.weight": (kv_size, hidden),
            "self_attn.v_proj.weight": (kv_size, hidden), "self_attn.o_proj.weight": (hidden, q_size),
            "self_attn.q_proj.bias": (q_size,), "self_attn.k_proj.bias": (kv_size,),
            "self_attn.v_proj.bias": (kv_size,), "self_attn.o_proj.bias": (hidden,),
            "self_attn.q_norm.weight": (head,), "self_attn.k_norm.weight": (head,)}


def mlp_shapes(hidden: int, inner: int) -> dict[str, tuple[int, ...]]:
    """A gated MLP's stored names (after the layer's prefix) -> their shapes."""
    return {"mlp.gate_proj.weight": (inner, hidden), "mlp.up_proj.weight": (inner, hidden),
            "mlp.down_proj.weight": (hidden, inner), "mlp.gate_proj.bias": (inner,),
            "mlp.up_proj.bias": (inner,), "mlp.down_proj.bias": (hidden,)}


def block_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Llama-style decoder layer's stored names (after the layer's prefix) -> their shapes."""
    hidden = config.hidden_size
    return ({"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
            | attention_shapes(config) | mlp_shapes(hidden, config.intermediate_size))


def sparse_block_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A Llama-style decoder layer's stored names with a mixture of experts for its MLP -> their shapes."""
    hidden = config.hidden_size
    return ({"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
            | attention_shapes(config) | moe_shapes(config))


def mtp_prefix(j: int, config: ModelConfig) -> str:
    """Where MTP module j's tensors live, without "model." (DeepSeek numbers them after the trunk's layers)."""
    return f"mtp_layers.{j}." if config.mtp_layout == "mimo" else f"layers.{config.num_layers + j}."


def mtp_part_sources(j: int, config: ModelConfig) -> dict[str, list[str]]:
    """MTP module j's own parts (norms and projection) -> their stored names, in the config's layout."""
    src = mtp_prefix(j, config)
    return {f"mtp.{j}.{ours}.weight": [f"{src}{theirs}.weight"] for ours, theirs in MTP_NAMES[config.mtp_layout].items()}


def mtp_part_shapes(j: int, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    prefix, parts, hidden = mtp_prefix(j, config), MTP_NAMES[config.mtp_layout], config.hidden_size
    shapes = {f"{prefix}{parts[norm]}.weight": (hidden,) for norm in ("token_norm", "hidden_norm", "out_norm")}
    return shapes | {f"{prefix}{parts['proj']}.weight": (hidden, 2 * hidden)}


def mtp_shared_copies(config: ModelConfig) -> set[str]:
    """The stored copies of the trunk's embedding and head that DeepSeek-named MTP modules may carry."""
    if config.mtp_layout != "deepseek":
        return set()
    return {mtp_prefix(j, config) + name for j in range(config.mtp_layers) for name in MTP_SHARED_COPIES}


def sparse_trunk_sources(config: ModelConfig) -> dict[str, list[str]]:
    """A Llama-style trunk whose sparse layers hold experts (decoder/moe.py), with MTP modules in DeepSeek's layout
    (GLM-4.5's): each of our parameter names -> the Hugging Face names stacked into it, in order."""
    found = {"embed.weight": ["embed_tokens.weight"], "norm.weight": ["norm.weight"]}
    if not config.tie_word_embeddings:
        found["lm_head.weight"] = ["lm_head.weight"]
    for i in range(config.num_layers):
        found.update(block_sources(f"layers.{i}.", f"layers.{i}.", config, config.moe.sparse(i)))
    for j in range(config.mtp_layers):
        found.update(sparse_mtp_sources(j, config))
    return found


def sparse_mtp_sources(j: int, config: ModelConfig) -> dict[str, list[str]]:
    """MTP module j's parameters -> their stored names: its block is sparse (transformers builds MTP blocks with
    no dense layer)."""
    return mtp_part_sources(j, config) | block_sources(f"mtp.{j}.block.", mtp_prefix(j, config), config, True)


def sparse_mtp_names(config: ModelConfig) -> set[str]:
    """The stored names of the MTP modules the config declares (all present or none, model_files checks)."""
    declared = replace(config, mtp_layers=config.mtp_declared)
    return {name for j in range(config.mtp_declared) for names in sparse_mtp_sources(j, declared).values()
            for name in names}


def sparse_trunk_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every Hugging Face tensor name of sparse_trunk_sources' trunk -> the shape the config implies for it."""
    hidden = config.hidden_size
    found = {"embed_tokens.weight": (config.vocab_size, hidden), "lm_head.weight": (config.vocab_size, hidden),
             "norm.weight": (hidden,)}
    dense, sparse = block_shapes(config), sparse_block_shapes(config)
    for i in range(config.num_layers):
        found.update({f"layers.{i}.{name}": shape for name, shape in (sparse if config.moe.sparse(i) else dense).items()})
    for j in range(config.mtp_layers):
        found.update({f"{mtp_prefix(j, config)}{name}": shape for name, shape in sparse.items()})
        found.update(mtp_part_shapes(j, config))
    return found


def mla_sources(dst: str, src: str, config: ModelConfig) -> dict[str, list[str]]:
    """A multi-head latent attention's parameters under `dst` (decoder/mla.py) -> the Hugging Face names under
    `src` (DeepSeek-V3's and GLM-4.7-Flash's)."""
    mla, attn, ours = config.mla, src + "self_attn.", dst + "attn."
    names = {"kv_a": "kv_a_proj_with_mqa", "o": "o_proj"}
    names |= {"q": "q_proj"} if mla.q_lora_rank is None else {"q_a": "q_a_proj", "q_b": "q_b_proj"}
    sources = {f"{ours}{mine}.weight": [f"{attn}{theirs}.weight"] for mine, theirs in names.items()}
    if mla.attention_bias:
        biased = ("kv_a", "o") if mla.q_lora_rank is None else ("q_a", "kv_a", "o")
        sources |= {f"{ours}{mine}.bias": [f"{attn}{names[mine]}.bias"] for mine in biased}
    if mla.q_lora_rank is not None:
        sources[ours + "q_a_norm.weight"] = [attn + "q_a_layernorm.weight"]
    return sources | {ours + "kv_a_norm.weight": [attn + "kv_a_layernorm.weight"],
                      ours + "kv_b": [attn + "kv_b_proj.weight"]}


def mla_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """A multi-head latent attention's stored names (after the layer's prefix) -> their shapes."""
    mla, hidden, heads = config.mla, config.hidden_size, config.num_heads
    query = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
    shapes = {"self_attn.q_proj.weight": (query, hidden), "self_attn.kv_a_proj_with_mqa.weight": (mla.width, hidden),
              "self_attn.kv_a_proj_with_mqa.bias": (mla.width,), "self_attn.kv_a_layernorm.weight": (mla.kv_lora_rank,),
              "self_attn.kv_b_proj.weight": (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
              "self_attn.o_proj.weight": (hidden, heads * mla.v_head_dim), "self_attn.o_proj.bias": (hidden,)}
    if mla.q_lora_rank is not None:
        shapes |= {"self_attn.q_a_proj.weight": (mla.q_lora_rank, hidden), "self_attn.q_a_proj.bias": (mla.q_lora_rank,),
                   "self_attn.q_a_layernorm.weight": (mla.q_lora_rank,),
                   "self_attn.q_b_proj.weight": (query, mla.q_lora_rank)}
    return shapes


def mla_block_sources(dst: str, src: str, config: ModelConfig, sparse: bool) -> dict[str, list[str]]:
    """A decoder layer with latent attention: norms, attention, and a mixture of experts or a dense MLP."""
    return ({dst + "attn_norm.weight": [src + "input_layernorm.weight"],
             dst + "mlp_norm.weight": [src + "post_attention_layernorm.weight"]}
            | mla_sources(dst, src, config)
            | (moe_sources(dst, src, config) if sparse else mlp_sources(dst, src, config)))


def mla_block_shapes(config: ModelConfig, sparse: bool) -> dict[str, tuple[int, ...]]:
    hidden = config.hidden_size
    mlp = moe_shapes(config) if sparse else mlp_shapes(hidden, config.intermediate_size)
    return {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)} | mla_shapes(config) | mlp
