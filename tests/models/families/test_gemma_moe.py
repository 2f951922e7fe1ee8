"""Gemma 4 with experts (enable_moe_block, the 26B-A4B's layout; families/gemma4/moe.py) on tiny random configs:
logits against transformers' Gemma4ForCausalLM (its eager and grouped experts) whole, in chunks and token by token;
llama.cpp's gemma4 GGUF layout read as the folder it was written from; verification that reads each expert once
while giving every row the bits it has alone; greedy speculative output equal to plain decoding. Logits agree with
transformers within 1e-4 (float32, logits up to about 15 under the soft cap of 30)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gemma_reference import PLAIN, save_gemma
from safetensors.torch import load_file
from test_moe import assert_rows_alone_bitwise, logits

from specdecode.models.batch_invariance import batch_invariant
from specdecode.models.decoder.moe import MoEConfig
from specdecode.models.families.gemma4.moe import GemmaMoEBlock
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model
from specdecode.models.model_config import ModelConfig
from specdecode.models.model_files import open_gguf_weights, parameter_count

TOLERANCE = 1e-4
IDS = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))  # [1, 40]: 5 sliding windows
CHUNK = 16  # a prefill chunk shorter than the prompt: the cache carries the earlier chunks


def moe_folder(folder, experts: int = 8, chosen: int = 2, plain: bool = False, **overrides):
    """A random Gemma 4 with experts: every part of FULL_FEATURED (PLE, KV-shared layers, ...) or none (PLAIN)."""
    return save_gemma(folder, **(PLAIN if plain else {}), enable_moe_block=True, num_experts=experts,
                      top_k_experts=chosen, moe_intermediate_size=32, **overrides)


def reference_logits(folder, ids: torch.Tensor, experts: str) -> torch.Tensor:
    """transformers' logits (float32, eager attention) with its `experts` implementation."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager",
                                                 experts_implementation=experts).eval()
    with torch.no_grad():
        return model(ids).logits  # [1, T, V]


@pytest.mark.parametrize(("experts", "chosen", "plain"), [(8, 2, False), (4, 1, True), (16, 4, True)])
def test_logits_match_transformers_whole_in_chunks_and_token_by_token(tmp_path, experts, chosen, plain):
    folder = moe_folder(tmp_path / "m", experts, chosen, plain)
    model = load_model(folder, dtype="float32").model
    assert model.config.moe.num_experts == experts and model.config.moe.experts_per_token == chosen
    expected = reference_logits(folder, IDS, "eager")
    assert (reference_logits(folder, IDS, "grouped_mm") - expected).abs().max() < TOLERANCE
    for chunk in (None, CHUNK):
        assert (logits(model, IDS, chunk) - expected).abs().max() < TOLERANCE, chunk
    assert (logits(model, IDS[:, :20], 1) - expected[:, :20]).abs().max() < TOLERANCE  # decoding, token by token
    stored = sum(value.numel() for value in load_file(folder / "model.safetensors").values())
    assert parameter_count(model.config) == stored  # every expert counted


@pytest.mark.parametrize("fused", [True, False])
def test_a_gemma4_gguf_with_experts_is_the_model_its_folder_is(tmp_path, fused):
    """llama.cpp's converter writes gate and up as one ffn_gate_up_exps; separate ffn_gate_exps and ffn_up_exps
    read as the same model. Float32 throughout: the same weights, the same bits."""
    from gguf_gemma4_files import write_gemma4_gguf

    folder = moe_folder(tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_gemma4_gguf(path, folder, fused=fused)
    from_file = load_model(path, dtype="float32", quant="none").model
    from_folder = load_model(folder, dtype="float32", quant="none").model
    assert from_file.config.moe == from_folder.config.moe
    assert from_file.config.family_parts == from_folder.config.family_parts
    assert torch.equal(logits(from_file, IDS), logits(from_folder, IDS))


def test_quantized_fused_gate_and_up_experts_are_read_one_expert_half_at_a_time(tmp_path):
    """A Q8_0 ffn_gate_up_exps [E, 2I, H] read as expert e's gate (and up) rows equals gguf-py's dequantization
    of the whole tensor at expert e's first (and second) I rows."""
    import gguf
    from gguf_files import Q8_0
    from gguf_gemma4_files import write_gemma4_gguf

    path = tmp_path / "m.gguf"
    write_gemma4_gguf(path, moe_folder(tmp_path / "hf"), experts=Q8_0)
    weights = open_gguf_weights(path)
    whole = {tensor.name: tensor for tensor in weights.reader.tensors}["blk.2.ffn_gate_up_exps.weight"]
    expected = gguf.dequantize(whole.data, whole.tensor_type)  # [E, 2I, H]
    for expert in (0, 3, 7):
        gate = weights.get(f"layers.2.experts.{expert}.gate_proj.weight")  # [I, H]
        up = weights.get(f"layers.2.experts.{expert}.up_proj.weight")
        assert np.array_equal(np.concatenate([gate.numpy(), up.numpy()]), expected[expert])
        assert torch.equal(weights.get(f"layers.2.experts.{expert}.up_proj.weight", slice(3, 9)), up[3:9])
        assert weights.shape(f"layers.2.experts.{expert}.gate_proj.weight") == (32, 64)


def gemma_block() -> GemmaMoEBlock:
    config = ModelConfig(architecture="moe-test", vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16,
                         moe=MoEConfig(num_experts=16, experts_per_token=4, expert_size=32, renormalize=True,
                                       activation="gelu_tanh"))
    torch.manual_seed(0)
    block = GemmaMoEBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.2) if param.dim() > 1 else param.uniform_(0.8, 1.2)
    return block.eval()


@pytest.mark.parametrize("kernel", ["packed-float32", "w4a8"])
def test_rows_grouped_by_expert_give_each_row_the_bits_it_has_alone(kernel):
    assert_rows_alone_bitwise(gemma_block(), kernel)  # Gemma's router reads the block's input, as the shared one


@pytest.mark.parametrize("quant", ["none", "w4a8"])
def test_greedy_speculative_output_equals_plain_decoding(tmp_path, quant):
    """Lookup drafters (chains and a tree) on the batch-invariant trunk, float32 and w4a8: the same tokens as
    plain decoding, with drafts both accepted and rejected."""
    from specdecode import Engine, SamplingParams, SpecConfig
    from specdecode.drafters.registry import DRAFTERS

    if quant == "w4a8" and (reason := w4a8_unavailable()) is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    folder = moe_folder(tmp_path / "m", scale=0.2, hidden_size=128, intermediate_size=256)
    loaded = load_model(folder, dtype="float32" if quant == "none" else "bfloat16", quant=quant)
    assert batch_invariant(loaded.model)
    engine = Engine(loaded)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    accepted = drafted = 0
    for prompt in ("hello hello hello", "abcabcabc abcabc"):
        plain = engine.complete(prompt, greedy, SpecConfig("none")).token_ids
        for method, options in (("ngram", {}), ("suffix", {}), ("suffix", DRAFTERS["suffix"].tree_options)):
            result = engine.complete(prompt, greedy, SpecConfig(method, num_draft_tokens=4, options=options))
            assert result.token_ids == plain, f"{method} {options} diverged on {prompt!r}"
            accepted, drafted = accepted + result.stats.accepted_tokens, drafted + result.stats.drafted_tokens
    assert 0 < accepted < drafted
