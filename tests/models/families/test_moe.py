"""Mixture-of-experts targets (decoder/moe.py, families/qwen3_moe): logits against transformers on tiny random
configs, each folder layout and llama.cpp's GGUF layout read as the same model, and verification that reads each
expert once while giving every row the bits it has alone."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from conftest import TINY_VOCAB, save_tiny_model
from gguf_files import F16, Q8_0
from gguf_moe_files import write_qwen3moe_gguf
from safetensors.torch import load_file, save_file

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.moe import MoEBlock, MoEConfig, Router
from specdecode.models.decoder.packed_linear import can_pack, pack_linears
from specdecode.models.families import config_from_hf
from specdecode.models.kernels.quantize_module import quantize_linears
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model
from specdecode.models.model_config import ModelConfig
from specdecode.models.model_files import open_gguf_weights, parameter_count

# float32, relative to the largest logit: transformers' eager experts sum in expert order, ours in slot order
RELATIVE_TOLERANCE = 1e-4
IDS = torch.randint(0, TINY_VOCAB, (1, 70), generator=torch.Generator().manual_seed(1))  # [1, 70]


def close(ours: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((ours - expected).abs().max() <= RELATIVE_TOLERANCE * expected.abs().max())


def moe_folder(folder, experts: int = 8, chosen: int = 2, **overrides):
    return save_tiny_model(folder, "qwen3_moe", scale=0.15, num_experts=experts, num_experts_per_tok=chosen,
                           **overrides)


def reference_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 experts_implementation="eager").eval()
    with torch.no_grad():
        return model(ids).logits  # [1, T, V]


def logits(model, ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """The model's logits over ids [1, T], read in chunks of `chunk` tokens (None: at once) -> [1, T, V]."""
    length = ids.shape[1]
    chunk = chunk or length
    cache, parts = model.new_cache(length), []
    with torch.inference_mode():
        for start in range(0, length, chunk):
            positions = torch.arange(start, min(start + chunk, length)).unsqueeze(0)  # [1, C]
            parts.append(model(ids[:, start : start + chunk], positions, cache).logits)
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize(("experts", "chosen", "renormalize", "dense"),
                         [(8, 2, True, [1]), (4, 1, False, []), (16, 4, False, [0, 2])])
def test_logits_match_transformers_whole_in_chunks_and_token_by_token(tmp_path, experts, chosen, renormalize, dense):
    folder = moe_folder(tmp_path / "m", experts, chosen, norm_topk_prob=renormalize, mlp_only_layers=dense)
    model = load_model(folder, dtype="float32").model
    assert model.config.moe.dense_layers == tuple(dense)
    expected = reference_logits(folder, IDS)
    for chunk in (None, 32):  # the prompt longer than a chunk: the cache carries the earlier chunks
        assert close(logits(model, IDS, chunk), expected), chunk
    assert close(logits(model, IDS[:, :30], 1), expected[:, :30])  # decoding, token by token


def test_qwen3_5_moe_logits_match_transformers_whole_in_chunks_and_token_by_token(tmp_path):
    """Qwen 3.5 MoE: the hybrid trunk (Gated DeltaNet and gated attention) with experts and a gated shared expert
    in every layer, against transformers' Qwen3_5MoeForCausalLM."""
    folder = save_tiny_model(tmp_path / "m", "qwen3_5_moe", scale=0.15)
    model = load_model(folder, dtype="float32").model
    assert model.config.moe.shared_gate and not model.config.moe.dense_layers
    expected = reference_logits(folder, IDS)
    for chunk in (None, 32):  # the chunked delta rule, then 32-row forwards over the recurrent form
        assert close(logits(model, IDS, chunk), expected), chunk
    assert close(logits(model, IDS[:, :30], 1), expected[:, :30])  # decoding, token by token


def test_a_folder_of_fused_experts_is_the_model_its_per_expert_folder_is(tmp_path):
    """transformers 5 holds experts fused ([E, 2I, H] gate and up, [E, H, I] down); published checkpoints store
    them per expert. Both read as one model."""
    from transformers import AutoModelForCausalLM

    per_expert = moe_folder(tmp_path / "per-expert")
    fused = tmp_path / "fused"
    shutil.copytree(per_expert, fused)
    state = AutoModelForCausalLM.from_pretrained(str(per_expert), dtype=torch.float32).state_dict()
    assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file({name: value.contiguous() for name, value in state.items()}, fused / "model.safetensors")
    assert torch.equal(logits(load_model(fused, dtype="float32").model, IDS[:, :20]),
                       logits(load_model(per_expert, dtype="float32").model, IDS[:, :20]))


def test_parameter_count_counts_every_expert(tmp_path):
    folder = moe_folder(tmp_path / "m")
    stored = sum(value.numel() for value in load_file(folder / "model.safetensors").values())
    assert parameter_count(load_model(folder, dtype="float32").config) == stored


def float16_exact(folder):
    """Round the folder's weights to float16 values, so a GGUF file storing them in F16 holds them exactly."""
    state = load_file(folder / "model.safetensors")
    save_file({name: value.half().float() for name, value in state.items()}, folder / "model.safetensors")
    return folder


def test_a_qwen3moe_gguf_is_the_model_its_folder_is(tmp_path):
    folder = float16_exact(moe_folder(tmp_path / "hf", num_hidden_layers=2, mlp_only_layers=[]))
    path = tmp_path / "m.gguf"
    write_qwen3moe_gguf(path, folder, experts_type=F16)
    ours = load_model(path, dtype="float32", quant="none").model
    assert ours.config.moe.num_experts == 8 and ours.config.moe.renormalize  # llama.cpp always renormalises
    assert torch.equal(logits(ours, IDS[:, :20]), logits(load_model(folder, dtype="float32").model, IDS[:, :20]))


def test_quantized_expert_tensors_are_read_one_expert_at_a_time(tmp_path):
    """A Q8_0 tensor of experts read as expert e's rows equals gguf-py's own dequantization of the whole
    tensor, at expert e."""
    import gguf

    folder = moe_folder(tmp_path / "hf", num_hidden_layers=2, mlp_only_layers=[])
    path = tmp_path / "m.gguf"
    stacked = write_qwen3moe_gguf(path, folder, experts_type=Q8_0)
    weights = open_gguf_weights(path)
    whole = {tensor.name: tensor for tensor in weights.reader.tensors}["blk.1.ffn_down_exps.weight"]
    expected = gguf.dequantize(whole.data, whole.tensor_type)  # [E, H, I]
    assert expected.shape == stacked["blk.1.ffn_down_exps.weight"].shape
    for expert in (0, 5, 7):
        read = weights.get(f"layers.1.mlp.experts.{expert}.down_proj.weight")  # [H, I]
        assert np.array_equal(read.numpy(), expected[expert])
        assert torch.equal(weights.get(f"layers.1.mlp.experts.{expert}.down_proj.weight", slice(3, 9)), read[3:9])


ROUTINGS = {
    "softmax": {},  # Qwen3-MoE
    "sigmoid-groups-shared": {"scoring": "sigmoid", "score_bias": True, "groups": 4, "groups_kept": 2,
                              "renormalize": True, "scaling": 2.5, "float32_router": True,
                              "shared_size": 32},  # DeepSeek-V3's routing
}


def moe_block(routing: str) -> MoEBlock:
    config = ModelConfig(architecture="moe-test", vocab_size=16, hidden_size=64, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=16,
                         moe=MoEConfig(num_experts=16, experts_per_token=4, expert_size=32, **ROUTINGS[routing]))
    torch.manual_seed(0)
    block = MoEBlock(config)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0, 0.2)
    return block.eval()


def assert_rows_alone_bitwise(block: MoEBlock, kernel: str) -> None:
    """`block`'s experts on `kernel` (packed-float32 or w4a8), its router packed where it can be: 24 rows in one
    forward give each row the bits it has alone, while sharing experts, and the block counts the experts it read."""
    if kernel == "w4a8":
        reason = w4a8_unavailable()
        if reason is not None:
            pytest.skip(f"w4a8 cannot run on this machine: {reason}")
        quantize_linears(block, "w4a8")
    else:
        if not can_pack(block):
            pytest.skip("oneDNN's packed kernels are unavailable here")
        pack_linears(block)
    if can_pack(block):
        block.router.pack()
    x = torch.randn(1, 24, block.router.weight.shape[1], generator=torch.Generator().manual_seed(3))  # [1, 24, H]
    with torch.inference_mode():
        together = block(x)  # [1, 24, H]
        alone = torch.cat([block(x[:, row : row + 1]) for row in range(24)], dim=1)
        chosen = block.router(x[0])[1]  # [24, k]
    assert len(chosen.unique()) < chosen.numel()  # rows did share experts, each read once for all of them
    assert torch.equal(together, alone)
    with torch.inference_mode():
        block(x)
    assert block.touched() == len(chosen.unique())  # what the block read, for pricing drafts (verify_cost.py)


@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("kernel", ["packed-float32", "w4a8"])
def test_rows_grouped_by_expert_give_each_row_the_bits_it_has_alone(routing, kernel):
    assert_rows_alone_bitwise(moe_block(routing), kernel)


def test_group_limited_sigmoid_routing_chooses_what_transformers_chooses():
    from transformers import AutoConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    hf = AutoConfig.for_model("deepseek_v3", hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                              topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    theirs = DeepseekV3TopkRouter(hf)
    ours = moe_block("sigmoid-groups-shared").router
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
        theirs.e_score_correction_bias.copy_(ours.score_bias)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(5))  # [40, H]
    with torch.no_grad():
        _, their_weights, their_experts = theirs(x)
        our_weights, our_experts = ours(x)
    their_order, our_order = their_experts.argsort(-1), our_experts.argsort(-1)  # slots in expert order
    assert torch.equal(their_experts.gather(1, their_order), our_experts.gather(1, our_order))
    assert torch.allclose(their_weights.gather(1, their_order), our_weights.gather(1, our_order), atol=1e-6)
    assert isinstance(ours, Router)


@pytest.mark.parametrize(("field", "value", "words"), [("num_experts_per_tok", 9, "more than the 8 experts"),
                                                       ("moe_intermediate_size", 0, "moe_intermediate_size"),
                                                       ("decoder_sparse_step", 0, "decoder_sparse_step")])
def test_a_config_whose_experts_cannot_be_is_one_clear_error(tmp_path, field, value, words):
    hf = json.loads((moe_folder(tmp_path / "m").joinpath("config.json")).read_text()) | {field: value}
    with pytest.raises(SpecDecodeError, match=words):
        config_from_hf(hf)


def test_memory_is_said_before_loading_and_a_model_that_cannot_fit_is_refused(tmp_path, monkeypatch, capsys):
    from specdecode.models import memory_needed

    folder = moe_folder(tmp_path / "m")
    load_model(folder, dtype="float32", quiet=False)
    said = capsys.readouterr().err
    total = parameter_count(load_model(folder, dtype="float32").config)
    experts = 2 * 8 * 3 * 64 * 32  # two sparse layers of 8 experts, three 64 x 32 matrices each
    assert f"{total / 1e6:.2f}M weights, {experts / 1e6:.2f}M of them in 8 experts a layer" in said
    monkeypatch.setattr(memory_needed, "available_bytes", lambda: 4 * total - 1)  # float32: 4 bytes a weight
    with pytest.raises(SpecDecodeError, match="needs about .* GiB .* this machine has"):
        load_model(folder, dtype="float32")


def add_qwen3_5_moe_mtp(folder, follow: float = 0.0) -> dict[str, torch.Tensor]:
    """Qwen 3.5 MoE's MTP module as its checkpoints ship it (top-level mtp.*, its block a gated full-attention layer
    with experts and a gated shared expert): the trunk's full-attention layer copied (experts as transformers
    saved them, fused), its matrices shrunk, random zero-centred norms and fc (plus follow * identity on the
    hidden half) -> the tensors written to model-mtp.safetensors."""
    config = json.loads((folder / "config.json").read_text())
    hidden, source = config["hidden_size"], f"model.layers.{config['layer_types'].index('full_attention')}."
    generator = torch.Generator().manual_seed(4)
    tensors = {f"mtp.layers.0.{name.removeprefix(source)}": value * (0.5 if value.dim() > 1 else 1.0)
               for name, value in load_file(folder / "model.safetensors").items() if name.startswith(source)}
    tensors |= {f"mtp.{norm}.weight": 0.2 * torch.randn(hidden, generator=generator)  # zero-centred
                for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
    tensors["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=generator) * 0.1  # [H, 2H]
    tensors["mtp.fc.weight"][:, hidden:] += follow * torch.eye(hidden)
    save_file({name: value.contiguous() for name, value in tensors.items()}, folder / "model-mtp.safetensors")
    (folder / "config.json").write_text(json.dumps(config | {"mtp_num_hidden_layers": 1}))
    return tensors


def test_qwen3_5_moe_mtp_module_matches_transformers_mtp_layer_and_drafts_for_mtp(tmp_path):
    """Its block sparse (router, experts, gated shared expert), against transformers' MtpLayer over
    Qwen3_5MoeDecoderLayer; then `mtp` drafting with it gives plain decoding's tokens."""
    from test_mla import fused_experts
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpLayer
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm

    folder = save_tiny_model(tmp_path / "m", "qwen3_5_moe", scale=0.15)
    stored = add_qwen3_5_moe_mtp(folder, follow=1.0)
    loaded = load_model(folder, dtype="float32")
    ours = loaded.model
    assert ours.config.mtp_layers == 1 and ours.mtp[0].block.mlp.router is not None
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                     experts_implementation="eager").eval()
    mtp_config = reference.config.__class__(**{**reference.config.to_dict(), "layer_types": ["full_attention"],
                                               "num_hidden_layers": 1})
    layer = MtpLayer(mtp_config, Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, 0).eval()
    names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "post_norm": "norm"}
    state = {f"{ours_}.weight": stored[f"mtp.{theirs}.weight"] for ours_, theirs in names.items()}
    block = fused_experts({k.removeprefix("mtp.layers.0."): v for k, v in stored.items() if "layers.0." in k})
    layer.load_state_dict(state | {f"mtp_block.{k}": v for k, v in block.items()})
    ids, positions = IDS[:, :12], torch.arange(11).unsqueeze(0)  # [1, 12], [1, 11]
    with torch.inference_mode():
        out = ours(ids[:, :-1], positions, ours.new_cache(12), final_hidden=True)
        drafted, _ = ours.mtp_forward(0, ids[:, 1:], out.final_hidden, positions, ours.new_mtp_cache(12))
        trunk = reference.model(ids[:, :-1], output_hidden_states=True).hidden_states[-1]  # after the final norm
        embeds = reference.model.embed_tokens(ids[:, 1:])
        causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive
        hidden = layer(embeds, trunk, reference.model.rotary_emb(embeds, positions), causal, positions, None)
        expected = reference.lm_head(hidden)  # [1, 11, V]
    assert close(drafted, expected)
    assert_mtp_drafts_give_plain_tokens(loaded)


def assert_mtp_drafts_give_plain_tokens(loaded) -> None:
    """Greedy `mtp` drafting (2 a step, no guard) on two repetitive prompts gives plain decoding's tokens, with
    drafts both accepted and rejected (the check has teeth)."""
    from specdecode import Engine, SamplingParams, SpecConfig

    engine = Engine(loaded)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    accepted = drafted = 0
    for prompt in ("hello hello hello", "abcabcabc abcabc"):
        plain = engine.complete(prompt, greedy, SpecConfig("none")).token_ids
        result = engine.complete(prompt, greedy, SpecConfig("mtp", num_draft_tokens=2, guard=False))
        assert result.token_ids == plain
        accepted, drafted = accepted + result.stats.accepted_tokens, drafted + result.stats.drafted_tokens
    assert 0 < accepted < drafted
