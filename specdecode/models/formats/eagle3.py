"""EAGLE-3 heads as users have them, read into our Eagle3Head; and our heads written in the reference layout.

Layouts read (from the code of SafeAILab/EAGLE@cb7e084, vLLM, SGLang and vllm-project/speculators@c05b95b):
- reference (SafeAILab/EAGLE, AngelSlim): `midlayer.*`, `fc`, `norm`, `lm_head`, `d2t`, `t2d`; no layer ids in
  config.json, so the reference's hard-coded (2, L//2, L-3) apply;
- speculators (vLLM's RedHatAI heads): `layers.0.*`, the layer's config nested in `transformer_layer_config`,
  top-level `eagle_aux_hidden_state_layer_ids` in vLLM's convention (a boundary id, used as is);
- SpecForge / SGLang: `eagle_config.eagle_aux_hidden_state_layer_ids`, read with SGLang's rule since its
  PR #25454: ids starting at 1 are "output of layer k" (+1 to our boundary ids), others are boundary ids.
A top-level id list wins over a nested one, as in vLLM. Only safetensors are read here: a head that ships only
`pytorch_model.bin` needs `specdecode convert` first (pickles are never loaded implicitly).
"""

from __future__ import annotations

from pathlib import Path

import torch

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder import llama_config
from specdecode.models.decoder.transformer import Transformer
from specdecode.models.formats.drafter_folder import load_checked, read_drafter_config, write_drafter_folder
from specdecode.models.formats.weight_source import FolderWeights
from specdecode.models.heads.eagle3 import Eagle3Config, Eagle3Head
from specdecode.models.model_config import ModelConfig

# Published names of the one decoder layer (after "midlayer." / "layers.0.") -> ours; q/k/v and gate/up are fused.
LAYER_NAMES = {"hidden_norm.weight": "layer.hidden_norm.weight", "input_layernorm.weight": "layer.input_norm.weight",
               "post_attention_layernorm.weight": "layer.mlp_norm.weight",
               "self_attn.o_proj.weight": "layer.attn.o.weight", "self_attn.o_proj.bias": "layer.attn.o.bias",
               "mlp.down_proj.weight": "layer.mlp.down.weight", "mlp.down_proj.bias": "layer.mlp.down.bias",
               # A Qwen3-typed layer (speculators trains one for a Qwen3 verifier) normalises q and k per head.
               "self_attn.q_norm.weight": "layer.attn.q_norm.weight",
               "self_attn.k_norm.weight": "layer.attn.k_norm.weight"}
FUSED = {"layer.attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "layer.mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj")}
TOP_NAMES = {"fc.weight": "fc.weight", "norm.weight": "norm.weight", "lm_head.weight": "lm_head.weight",
             "embed_tokens.weight": "embed.weight", "input_norm.weight": "fused_norm.weight"}
# Published tensors we know and do not need: training-only buffers and copies of the verifier's own weights.
UNUSED = {"t2d", "verifier_lm_head.weight", "verifier_norm.weight"}


def load_eagle3_head(path: str | Path, target: Transformer, max_positions: int) -> tuple[Eagle3Head, str]:
    """The head in `path` (a folder), checked against `target`, in the target's dtype and device -> (head, one
    line saying what was loaded)."""
    folder = Path(path)
    hf = read_drafter_config(folder, "an EAGLE-3 head")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        if pickled:
            raise SpecDecodeError(f"{folder} ships only {pickled[0]} (a pickle, never loaded implicitly); run "
                                  f"'specdecode convert {folder}' once to write model.safetensors beside it")
        raise SpecDecodeError(f"{folder} holds no *.safetensors weights")
    tensors = _our_tensors(FolderWeights(files), folder)
    config, layout = _config(hf, tensors, target, folder)
    head = Eagle3Head(config, target.embed, None if config.own_head else target.lm_head)
    d2t = tensors.pop("d2t", None)
    load_checked(head, tensors, folder, "EAGLE-3 head")
    head.to(dtype=target.dtype, device=target.device)
    if d2t is not None:
        head.draft_to_target = _draft_to_target(d2t, config, folder).to(target.device)
    head.finish_loading(max_positions)
    head.requires_grad_(False)
    ids = ", ".join(map(str, config.layer_ids))
    vocab = f"draft vocabulary {config.draft_vocab_size}" if config.own_head else "the target's output head"
    return head, f"EAGLE-3 head {folder.name} ({layout}: target boundaries {ids}; {vocab})"


def _our_tensors(weights: FolderWeights, folder: Path) -> dict[str, torch.Tensor]:
    """Every stored tensor under our module's names (q/k/v and gate/up concatenated), d2t kept as is."""
    stored = weights.names()
    layers = {name.split(".")[1] for name in stored if name.startswith("layers.")}
    if layers - {"0"}:
        raise SpecDecodeError(f"{folder}: a head of {len(layers)} decoder layers; we run one-layer EAGLE-3 heads")
    ours: dict[str, torch.Tensor] = {}
    local = {}
    for name in stored:
        if name in UNUSED:
            continue
        if name == "d2t":
            ours["d2t"] = weights.get(name)
        elif name in TOP_NAMES:
            ours[TOP_NAMES[name]] = weights.get(name)
        elif name.startswith("fc_norm."):
            ours["fc_norms." + name.removeprefix("fc_norm.")] = weights.get(name)
        elif name.startswith(("midlayer.", "layers.0.")):
            local[name.split(".", 1)[1] if name.startswith("midlayer.") else name.split(".", 2)[2]] = name
        else:
            raise SpecDecodeError(f"{folder}: unknown tensor {name!r} for an EAGLE-3 head")
    for short, name in local.items():
        if short in LAYER_NAMES:
            ours[LAYER_NAMES[short]] = weights.get(name)
        elif not any(short.startswith(part + ".") for parts in FUSED.values() for part in parts):
            raise SpecDecodeError(f"{folder}: unknown tensor {name!r} for an EAGLE-3 head")
    for fused, parts in FUSED.items():
        for kind in ("weight", "bias"):
            present = [f"{part}.{kind}" in local for part in parts]
            if any(present) and not all(present):
                raise SpecDecodeError(f"{folder}: the head has only some of {', '.join(parts)} ({kind})")
            if all(present):
                ours[f"{fused}.{kind}"] = torch.cat([weights.get(local[f"{part}.{kind}"]) for part in parts])
    return ours


def _config(hf: dict, tensors: dict[str, torch.Tensor], target: Transformer, folder: Path) -> tuple[Eagle3Config, str]:
    speculators = "transformer_layer_config" in hf or "speculators_config" in hf
    layer_hf = hf.get("transformer_layer_config", hf) if speculators else hf
    if not isinstance(layer_hf, dict):
        raise SpecDecodeError(f"{folder}: transformer_layer_config must be a JSON object")
    for name in ("fc.weight", "layer.attn.qkv.weight", "layer.mlp.gate_up.weight"):
        if name not in tensors:
            raise SpecDecodeError(f"{folder}: not an EAGLE-3 head (no {name.replace('layer.', 'midlayer.')})")
    hidden, fused = tensors["fc.weight"].shape
    tc = target.config
    declared_width = hf.get("target_hidden_size")
    if declared_width not in (None, tc.hidden_size) or fused % tc.hidden_size:
        width = f"hidden size {declared_width}" if declared_width else f"features of another width (fc reads {fused})"
        raise SpecDecodeError(f"{folder}: this EAGLE-3 head was trained for a target of {width}; this target's "
                              f"hidden size is {tc.hidden_size}")
    vocab = layer_hf.get("vocab_size", hf.get("vocab_size"))
    if vocab is not None and vocab != tc.vocab_size:
        raise SpecDecodeError(f"{folder}: this EAGLE-3 head was trained for a vocabulary of {vocab} tokens; this "
                              f"target has {tc.vocab_size}")
    heads = layer_hf.get("num_attention_heads")
    if type(heads) is not int or heads < 1:
        raise SpecDecodeError(f"{folder}: config.json needs num_attention_heads (a positive integer)")
    head_dim, kv_heads = _attention_shape(tensors, heads, layer_hf, folder)
    # RoPE as written: transformers 5 (which speculators 0.9 saves with) keeps it only in rope_parameters.
    rope = {key: layer_hf[key] for key in ("rope_theta", "rope_scaling", "rope_parameters") if key in layer_hf}
    layer = llama_config.from_hf({
        "vocab_size": tc.vocab_size,
        "hidden_size": hidden, "intermediate_size": tensors["layer.mlp.gate_up.weight"].shape[0] // 2,
        "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "rms_norm_eps": layer_hf.get("rms_norm_eps", 1e-6), **rope,
        "max_position_embeddings": tc.max_position_embeddings,
        "attention_bias": "layer.attn.qkv.bias" in tensors, "mlp_bias": "layer.mlp.down.bias" in tensors},
        "qwen3" if _qk_norms(tensors, layer_hf, folder) else "llama")
    if layer.o_bias != ("layer.attn.o.bias" in tensors):
        raise SpecDecodeError(f"{folder}: q/k/v and o_proj must all have biases or none")
    ids, convention = _layer_ids(hf, fused // tc.hidden_size, tc.num_layers, folder)
    own_embedding = "embed.weight" in tensors
    if not own_embedding and hidden != tc.hidden_size:
        raise SpecDecodeError(f"{folder}: the head's width {hidden} differs from the target's {tc.hidden_size}, so it "
                              "needs its own embed_tokens, which the checkpoint lacks")
    own_head = "lm_head.weight" in tensors
    draft_vocab = tensors["lm_head.weight"].shape[0] if own_head else tc.vocab_size
    if own_head and "d2t" not in tensors and draft_vocab != tc.vocab_size:
        raise SpecDecodeError(f"{folder}: lm_head has {draft_vocab} rows but there is no d2t table mapping them to "
                              f"the target's {tc.vocab_size} tokens")
    logit_scale = hf.get("logit_scale", 1.0)
    if isinstance(logit_scale, bool) or not isinstance(logit_scale, (int, float)):
        raise SpecDecodeError(f"{folder}: logit_scale must be a number, got {logit_scale!r}")
    config = Eagle3Config(
        layer=layer, target_hidden_size=tc.hidden_size, draft_vocab_size=draft_vocab, layer_ids=ids,
        norm_before_residual=bool(hf.get("norm_before_residual", speculators)),  # vLLM's default per layout
        norm_output=bool(hf.get("norm_output", False)), norm_before_fc=bool(hf.get("norm_before_fc", False)),
        fc_norm=bool(hf.get("fc_norm", False)), own_embedding=own_embedding, own_head=own_head,
        logit_scale=float(logit_scale))
    layout = "speculators" if speculators else ("SpecForge/SGLang" if convention == "nested" else "reference")
    layout += {"top-level": ", layer ids from its config", "nested": ", layer ids by SGLang's rule",
               "default": ", the reference's default layer ids"}[convention]
    return config, layout


def _qk_norms(tensors: dict, layer_hf: dict, folder: Path) -> bool:
    """Whether the layer normalises q and k per head (a Qwen3-typed layer): both norms stored, or neither."""
    present = ["layer.attn.q_norm.weight" in tensors, "layer.attn.k_norm.weight" in tensors]
    if any(present) and not all(present):
        raise SpecDecodeError(f"{folder}: the head has only one of self_attn.q_norm and self_attn.k_norm")
    if layer_hf.get("model_type") == "qwen3" and not all(present):
        raise SpecDecodeError(f"{folder}: a qwen3-typed EAGLE-3 layer needs self_attn.q_norm and self_attn.k_norm")
    return all(present)


def _attention_shape(tensors: dict, heads: int, layer_hf: dict, folder: Path) -> tuple[int, int]:
    """(head_dim, kv heads) from the weights: the reference ignores a config's head_dim, the weights cannot lie."""
    qkv_rows = tensors["layer.attn.qkv.weight"].shape[0]
    q_rows = tensors["layer.attn.o.weight"].shape[1]
    if q_rows % heads:
        raise SpecDecodeError(f"{folder}: o_proj's {q_rows} inputs are not a multiple of {heads} heads")
    head_dim = q_rows // heads
    kv_rows = (qkv_rows - q_rows) // 2
    if kv_rows < head_dim or kv_rows % head_dim:
        raise SpecDecodeError(f"{folder}: k_proj/v_proj rows ({kv_rows}) do not fit heads of {head_dim}")
    kv_heads = kv_rows // head_dim
    declared = layer_hf.get("num_key_value_heads")
    if declared not in (None, kv_heads):
        raise SpecDecodeError(f"{folder}: config says {declared} key/value heads, the weights hold {kv_heads}")
    return head_dim, kv_heads


def _layer_ids(hf: dict, count: int, num_layers: int, folder: Path) -> tuple[tuple[int, ...], str]:
    """Our boundary ids (HF hidden_states index) for the fused states, and which convention gave them."""
    top = hf.get("eagle_aux_hidden_state_layer_ids")
    nested = hf.get("eagle_config") if isinstance(hf.get("eagle_config"), dict) else {}
    if top:
        ids, convention = top, "top-level"
    elif nested.get("eagle_aux_hidden_state_layer_ids"):
        ids = nested["eagle_aux_hidden_state_layer_ids"]
        convention = "nested"
        if isinstance(ids, list) and ids and ids[0] == 1:  # "output of layer k" (SGLang's rule, PR #25454)
            ids = [i + 1 if type(i) is int else i for i in ids]
    else:
        ids, convention = [2, num_layers // 2, num_layers - 3], "default"
    if not isinstance(ids, list) or not all(type(i) is int for i in ids):
        raise SpecDecodeError(f"{folder}: eagle_aux_hidden_state_layer_ids must be a list of integers, got {ids!r}")
    if len(ids) != count:
        raise SpecDecodeError(f"{folder}: the head's fc reads {count} target states but its config names "
                              f"{len(ids)} layers ({ids})")
    if not all(0 <= i <= num_layers for i in ids) or len(set(ids)) != len(ids):
        raise SpecDecodeError(f"{folder}: target layer ids {ids} must be distinct and within this target's "
                              f"{num_layers} layers; the head was trained for another target")
    return tuple(sorted(ids)), convention  # fc's column blocks follow capture order, which is ascending


def _draft_to_target(d2t: torch.Tensor, config: Eagle3Config, folder: Path) -> torch.Tensor:
    """d2t offsets [Vd] -> target ids [Vd], checked to fall in the target's vocabulary."""
    if d2t.dim() != 1 or d2t.numel() != config.draft_vocab_size or d2t.is_floating_point():
        raise SpecDecodeError(f"{folder}: d2t must be {config.draft_vocab_size} integers (one per lm_head row), "
                              f"got {tuple(d2t.shape)} {d2t.dtype}")
    ids = torch.arange(config.draft_vocab_size) + d2t.long()  # [Vd]
    if int(ids.min()) < 0 or int(ids.max()) >= config.layer.vocab_size:
        raise SpecDecodeError(f"{folder}: d2t maps draft ids outside the target's {config.layer.vocab_size} tokens")
    return ids


def save_eagle3_head(head: Eagle3Head, folder: Path, target_config: ModelConfig) -> Path:
    """Write `head` in the reference layout with explicit layer ids, the form vLLM, SGLang, the speculators
    converter and llama.cpp's converter all read: `midlayer.*` names, d2t offsets and the t2d mask,
    `draft_vocab_size` written out, ids in vLLM's convention both top-level and in `eagle_config` (a first id of
    2 or more reads the same under SGLang's rule). The embedding is the target's and is not written."""
    config, layer = head.config, head.config.layer
    ids = list(config.layer_ids)
    hf = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": layer.hidden_size,
          "intermediate_size": layer.intermediate_size, "num_attention_heads": layer.num_heads,
          "num_key_value_heads": layer.num_kv_heads, "head_dim": layer.head_dim, "num_hidden_layers": 1,
          "rms_norm_eps": layer.rms_norm_eps, "rope_theta": layer.rope_theta, "rope_scaling": layer.rope_scaling,
          "max_position_embeddings": target_config.max_position_embeddings, "vocab_size": layer.vocab_size,
          "draft_vocab_size": config.draft_vocab_size, "target_hidden_size": config.target_hidden_size,
          "tie_word_embeddings": False, "bias": False, "norm_before_residual": config.norm_before_residual,
          "eagle_aux_hidden_state_layer_ids": ids,
          "eagle_config": {"eagle_aux_hidden_state_layer_ids": ids, "use_aux_hidden_state": True},
          "bos_token_id": target_config.bos_token_id, "eos_token_id": list(target_config.eos_token_ids) or None,
          "torch_dtype": "float32"}
    return write_drafter_folder(folder, published_tensors(head, "midlayer."), hf, "the head")


def published_tensors(head: Eagle3Head, layer_prefix: str) -> dict[str, torch.Tensor]:
    """The head's tensors under the published names, float32: the decoder layer's under `layer_prefix` (the
    reference's "midlayer.", speculators' "layers.0."), q/k/v and gate/up apart, d2t offsets and the t2d mask.
    Only heads with the target's embedding, their own lm_head and no norms before fc are written."""
    config = head.config
    if config.own_embedding or not config.own_head or config.norm_before_fc or config.fc_norm:
        raise SpecDecodeError("only heads with the target's embedding, their own lm_head and no extra norms "
                              "are written")
    layer = config.layer
    ours = {name: t.detach().float().cpu().contiguous() for name, t in head.state_dict().items()}
    qkv = ours.pop("layer.attn.qkv.weight")  # [(h + 2 hkv) D, 2H]
    q_rows = layer.num_heads * layer.head_dim
    kv_rows = layer.num_kv_heads * layer.head_dim
    gate, up = ours.pop("layer.mlp.gate_up.weight").split(layer.intermediate_size)  # [I, H] each
    published = {layer_prefix + "self_attn.q_proj.weight": qkv[:q_rows],
                 layer_prefix + "self_attn.k_proj.weight": qkv[q_rows : q_rows + kv_rows],
                 layer_prefix + "self_attn.v_proj.weight": qkv[q_rows + kv_rows :],
                 layer_prefix + "mlp.gate_proj.weight": gate, layer_prefix + "mlp.up_proj.weight": up}
    by_ours = {ours_name: name for name, ours_name in TOP_NAMES.items()}
    by_ours.update({ours_name: layer_prefix + name for name, ours_name in LAYER_NAMES.items()})
    published.update({by_ours[name]: tensor for name, tensor in ours.items()})
    draft_to_target = head.draft_to_target.cpu()  # [Vd]
    published["d2t"] = draft_to_target - torch.arange(config.draft_vocab_size)
    t2d = torch.zeros(layer.vocab_size, dtype=torch.bool)  # [V]
    t2d[draft_to_target] = True
    published["t2d"] = t2d
    return published
