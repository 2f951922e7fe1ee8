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


def randomise(model: torch.nn.Module, seed: int, scale: float) -> None:
    """Random weights that make a tiny model's output depend on every part (norm weights near 1)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0, scale) if param.dim() > 1 else param.uniform_(0.8, 1.2)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.uniform_(0.7, 1.1)


def save_gemma(folder: Path, seed: int = 0, scale: float = 0.3, multimodal: bool = False, **overrides) -> Path:
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
    randomise(model, seed, scale)
    model.save_pretrained(str(folder))
    byte_tokenizer().save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257]}))
    return folder


def reference_model(folder: Path):
    """transformers' own model of a folder save_gemma wrote, float32, eager attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
