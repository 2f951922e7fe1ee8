"""Tiny Gemma 4 checkpoints written by transformers itself: the text model (Gemma4ForCausalLM), the multimodal
layout (Gemma4ForConditionalGeneration, language model under model.language_model beside a vision tower), and an
assistant drafter (Gemma4AssistantForCausalLM) for a target."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import TINY_VOCAB, byte_tokenizer

# Every Gemma 4 part at once: PLE, two KV-shared layers (the double-wide MLP), full layers with a wider head, fewer
# KV heads and values from keys, a sliding window shorter than the test prompts, soft-capped logits.
FULL_FEATURED = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
    num_kv_shared_layers=2, hidden_size_per_layer_input=8, vocab_size_per_layer_input=TINY_VOCAB, sliding_window=8,
    layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                 "sliding_attention", "full_attention"],
    final_logit_softcapping=30.0, use_double_wide_mlp=True, max_position_embeddings=512, bos_token_id=256,
    eos_token_id=257, pad_token_id=0)
# Every part in three layers (one KV-shared), for tests that run thousands of forwards.
SMALL = dict(num_hidden_layers=3, num_kv_shared_layers=1, layer_types=["sliding_attention", "full_attention",
                                                                       "full_attention"])
# None of them: every layer its own keys and values, no PLE, default rope on the full layers, no cap.
PLAIN = dict(
    vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, global_head_dim=16, num_global_key_value_heads=None, attention_k_eq_v=False,
    num_kv_shared_layers=0, hidden_size_per_layer_input=0, vocab_size_per_layer_input=TINY_VOCAB, sliding_window=5,
    use_double_wide_mlp=False, final_logit_softcapping=None,
    layer_types=["sliding_attention", "full_attention", "full_attention"],
    rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                     "full_attention": {"rope_type": "default", "rope_theta": 100000.0}},
    max_position_embeddings=512, bos_token_id=256, eos_token_id=257, pad_token_id=0, tie_word_embeddings=False)


def text_config(**overrides):
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(**{**FULL_FEATURED, **overrides})


def randomise(model: torch.nn.Module, seed: int, scale: float, noise: float = 0.0) -> None:
    """Random weights that make a tiny model's output depend on every part (norm weights near 1); `noise`
    perturbs them with a generator of its own (a noisy copy: a draft that agrees with the seed's model often)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, scale) if param.dim() > 1 else param.uniform_(0.8, 1.2)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.7, 1.1)
        if noise:
            generator = torch.Generator().manual_seed(seed + 1000)
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * noise)


def save_gemma(folder: Path, seed: int = 0, scale: float = 0.3, multimodal: bool = False, noise: float = 0.0,
               **overrides) -> Path:
    """A random Gemma 4 text model in transformers' layout (or the multimodal one) with the byte tokenizer."""
    from transformers import Gemma4Config, Gemma4ForCausalLM, Gemma4ForConditionalGeneration, Gemma4VisionConfig

    config = text_config(**overrides)
    if multimodal:
        vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=2, head_dim=16)
        model = Gemma4ForConditionalGeneration(Gemma4Config(text_config=config.to_dict(),
                                                            vision_config=vision.to_dict(), audio_config=None))
    else:
        model = Gemma4ForCausalLM(config)
    randomise(model, seed, scale, noise)
    model.save_pretrained(str(folder))
    byte_tokenizer().save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257]}))
    return folder


def reference_model(folder: Path):
    """transformers' own model of a folder save_gemma wrote, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()


ASSISTANT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 layer_types=["sliding_attention", "full_attention"], hidden_size_per_layer_input=0,
                 vocab_size_per_layer_input=0, use_double_wide_mlp=False, final_logit_softcapping=None)


def save_assistant(folder: Path, target: Path, seed: int = 1, scale: float = 0.3, centroids: int = 0,
                   follow: bool = False) -> Path:
    """A random Gemma4AssistantForCausalLM for the target saved in `target` (its sizes: backbone hidden, the KV
    shapes of each layer kind, vocabulary). `centroids` > 0: the ordered-embedding head with that many clusters
    (top 2 scored). `follow`: it mostly repeats the target's own last prediction (its width the target's,
    pre_projection passing the hidden state through, layers that add little, the target's embedding as its output head),
    which a tiny random target's repetitive output often accepts."""
    from safetensors.torch import load_file
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    target_config = json.loads((target / "config.json").read_text())
    target_config = target_config.get("text_config", target_config)
    keep = ("vocab_size", "num_key_value_heads", "head_dim", "sliding_window", "rope_parameters",
            "attention_k_eq_v", "max_position_embeddings", "bos_token_id", "eos_token_id", "pad_token_id",
            "rms_norm_eps")
    text = {key: target_config[key] for key in keep if key in target_config}
    full_layer = next(i for i, kind in enumerate(ASSISTANT["layer_types"]) if kind == "full_attention")
    target_full = next(i for i, kind in enumerate(target_config["layer_types"]) if kind == "full_attention")
    per_layer = (target_config.get("per_layer_config") or {}).get(str(target_full))
    text["per_layer_config"] = {str(full_layer): per_layer} if per_layer else {}
    backbone = target_config["hidden_size"]
    sizes = {**ASSISTANT, "hidden_size": backbone} if follow else ASSISTANT
    config = Gemma4AssistantConfig(
        text_config=text_config(**{**text, **sizes}).to_dict(), backbone_hidden_size=backbone,
        use_ordered_embeddings=bool(centroids), num_centroids=centroids or 2048, centroid_intermediate_top_k=2)
    model = Gemma4AssistantForCausalLM(config)
    randomise(model, seed, scale)
    if centroids:
        order = torch.randperm(config.text_config.vocab_size, generator=torch.Generator().manual_seed(seed))
        model.masked_embedding.token_ordering.copy_(order)
    if follow:
        embedding = next(v for k, v in load_file(str(target / "model.safetensors")).items()
                         if k.endswith("embed_tokens.weight"))
        with torch.no_grad():
            model.pre_projection.weight.mul_(0.01)
            model.pre_projection.weight[:, backbone:] += torch.eye(backbone)
            model.post_projection.weight.copy_(torch.eye(backbone))
            for layer in model.model.layers:  # the sandwich norms set what each block adds
                layer.post_attention_layernorm.weight.mul_(0.05)
                layer.post_feedforward_layernorm.weight.mul_(0.05)
            model.model.embed_tokens.weight.copy_(embedding)
            model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(str(folder))
    return folder
