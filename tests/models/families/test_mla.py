"""Multi-head latent attention (decoder/mla.py) and the deepseek_v3 family (DeepSeek-V3, GLM-4.7-Flash): logits
against transformers on tiny random configs, its three forms against one another, verify rows bitwise their
one-row results, the latent cache's size, and the MTP module against the published forward."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_VOCAB, save_tiny_model
from safetensors.torch import load_file, save_file

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.kv_cache import CacheBatch
from specdecode.models.decoder.latent_cache import LatentCache, latent_bytes_per_token
from specdecode.models.decoder.mla import head_weights
from specdecode.models.families import config_from_hf, family_of
from specdecode.models.families.deepseek_v3.trunk import attentions
from specdecode.models.kernels.w4a8_linear import load_kernel, w4a8_unavailable
from specdecode.models.loader import load_model

# float32, relative to the largest logit: transformers sums its eager experts in expert order, ours in slot order,
# and the absorbed forms multiply W_UK and W_UV in another order than the expanded one
RELATIVE_TOLERANCE = 1e-5
IDS = torch.randint(0, TINY_VOCAB, (1, 70), generator=torch.Generator().manual_seed(1))  # [1, 70]
FORMS = ("expanded", "absorbed", "fixed")


def close(ours: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((ours - expected).abs().max() <= RELATIVE_TOLERANCE * expected.abs().max())


def mla_folder(folder, arch: str, **overrides):
    """A tiny model of `arch` whose routers' selection biases are random too (transformers keeps them zero)."""
    save_tiny_model(folder, arch, scale=0.15, **overrides)
    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(2)
    for name, tensor in weights.items():
        if name.endswith("e_score_correction_bias"):
            weights[name] = torch.rand(tensor.shape, generator=generator) * 0.2  # [E]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def reference(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                experts_implementation="eager").eval()


def in_form(model, kernel, form: str):
    """The model with every latent attention in `form`: the fixed-order one it loaded with (over `kernel`, the
    compiled attention it was given), or a PyTorch one."""
    if form == "fixed" and kernel is None:
        pytest.skip("the fixed-order attention does not run on this machine")
    for attn in attentions(model):
        attn.attend = kernel if form == "fixed" else None
        attn.expand_from = 1 if form == "expanded" else 1 << 30
    return model


# How IDS is read: at once; in prefill chunks, later ones attending to the cached latents of earlier ones; a
# prompt and then token by token, as decoding reads it
READINGS = ((70,), (32, 32, 6), (60,) + (1,) * 10)


def logits(model, ids: torch.Tensor, chunks: tuple[int, ...]) -> torch.Tensor:
    """The model's logits over ids [1, T], read in chunks of these sizes -> [1, T, V]."""
    cache, parts, start = model.new_cache(ids.shape[1]), [], 0
    with torch.inference_mode():
        for chunk in chunks:
            positions = torch.arange(start, start + chunk).unsqueeze(0)  # [1, C]
            parts.append(model(ids[:, start : start + chunk], positions, cache).logits)
            start += chunk
    return torch.cat(parts, dim=1)


@pytest.fixture(scope="module", params=["deepseek_v3", "glm4_moe_lite"])
def tiny(request, tmp_path_factory):
    """(our model, transformers' logits over IDS, the compiled attention our model's fixed-order form runs or None)
    for a tiny DeepSeek-V3 (q_lora_rank, YaRN with mscale, groups) and a tiny GLM-4.7-Flash (plain q_proj, default
    rope, dense layers named per layer)."""
    folder = mla_folder(tmp_path_factory.mktemp(request.param) / "m", request.param)
    with torch.no_grad():
        expected = reference(folder)(IDS).logits  # [1, 70, V]
    model = load_model(folder, dtype="float32").model
    return model, expected, attentions(model)[0].attend


@pytest.mark.parametrize("form", FORMS)
def test_logits_match_transformers_whole_in_chunks_and_token_by_token(tiny, form):
    model, expected, kernel = tiny
    in_form(model, kernel, form)
    for chunks in READINGS:
        assert close(logits(model, IDS, chunks), expected), (form, chunks)


def test_the_three_forms_agree_on_a_tree_verified_over_a_cached_prompt(tiny):
    model, _, kernel = tiny
    prompt, nodes = IDS[:, :40], IDS[:, 40:46]  # [1, 40], [1, 6]
    parents = [-1, 0, 0, 1, 3, 2]  # two branches from the first node
    mask = torch.zeros(1, 6, 6, dtype=torch.bool)  # [1, T, T] each node sees itself and its ancestors
    for node, parent in enumerate(parents):
        mask[0, node, node] = True
        if parent >= 0:
            mask[0, node] |= mask[0, parent]
    depths = mask[0].sum(-1) - 1  # [T]
    outputs = {}
    for form in FORMS:
        in_form(model, kernel, form)
        cache = model.new_cache(64)
        with torch.inference_mode():
            model(prompt, torch.arange(40).unsqueeze(0), cache)
            outputs[form] = model(nodes, (40 + depths).unsqueeze(0), cache, attn_mask=mask).logits  # [1, 6, V]
    assert close(outputs["absorbed"], outputs["expanded"]) and close(outputs["fixed"], outputs["expanded"])


def test_each_verify_row_is_bitwise_its_one_row_result_alone_and_batched(tiny):
    """What makes speculative output bitwise plain decoding's: a drafted token's logits do not depend on how many
    rows or sequences share its forward."""
    model, _, kernel = tiny
    in_form(model, kernel, "fixed")
    assert family_of(model.config).batch_invariant(model)
    prompt, drafted = IDS[:, :30], IDS[:, 30:36]  # [1, 30], [1, 6]

    def prefilled():
        cache = model.new_cache(40)
        model(prompt, torch.arange(30).unsqueeze(0), cache)
        return cache

    positions = torch.arange(30, 36).unsqueeze(0)  # [1, 6]
    with torch.inference_mode():
        cache = prefilled()
        alone = torch.cat([model(drafted[:, i : i + 1], positions[:, i : i + 1], cache).logits for i in range(6)], 1)
        verified = model(drafted, positions, prefilled()).logits  # [1, 6, V]
        other = model.new_cache(40)  # a second sequence, shorter, verified in the same forward
        model(IDS[:, 50:60], torch.arange(10).unsqueeze(0), other)
        batched = model(torch.cat([drafted, IDS[:, 60:66]]), torch.cat([positions, torch.arange(10, 16)[None]]),
                        CacheBatch([prefilled(), other])).logits  # [2, 6, V]
    assert torch.equal(verified, alone) and torch.equal(batched[:1], alone)


@pytest.mark.parametrize("kind", ["float32", "bfloat16", "int8"])
def test_the_per_head_products_are_each_heads_matmul_and_fixed_per_row(kind):
    """kernels/head_products.cpp: out[r, h] = x[r, h] @ w[h] (a width of 40: 16-lane vectors and a tail; int8 codes
    times a scale a column, as a quantized model keeps them), each row's bits the same alone and among others."""
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"the kernel cannot run here: {reason}")
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, 24, generator=generator)  # [R, nh, n]
    weights = torch.randn(3, 24, 40, generator=generator)  # [nh, n, m]
    if kind == "int8":
        stored, scales = head_weights(weights, int8=True)  # [nh, n, m] int8, [nh, m]
        exact = stored.float() * scales.unsqueeze(1)  # what the codes stand for
        assert (exact - weights).abs().max() <= scales.max() / 2 + 1e-6  # rounded to the nearest code
    else:
        stored, scales = weights.to(getattr(torch, kind)), None
        exact = stored.float()
    products = load_kernel().head_products
    out = products(x, stored, scales)  # [R, nh, m]
    torch.testing.assert_close(out, torch.einsum("rhn,hnm->rhm", x, exact), rtol=1e-5, atol=1e-5)
    for r in range(5):
        assert torch.equal(products(x[r : r + 1].contiguous(), stored, scales)[0], out[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cache_holds_the_latent_and_the_rotary_key_per_token_and_layer(tiny, dtype):
    model = tiny[0]
    mla, layers = model.config.mla, model.config.num_layers
    per_token = (mla.kv_lora_rank + mla.qk_rope_head_dim) * dtype.itemsize * layers
    position = 8  # each slot's recorded position (int64), as every cache keeps
    assert LatentCache(layers, 1, mla.width, 100, dtype).nbytes == 100 * (per_token + position)
    assert latent_bytes_per_token(layers, mla.width, dtype) == per_token + position
    float32_token = latent_bytes_per_token(layers, mla.width, torch.float32)  # the loaded model's dtype
    assert model.cache_bytes(100) == model.new_cache(100).nbytes == 100 * float32_token


def test_deepseek_v32_and_v2_are_refused_with_why():
    for model_type, why in (("deepseek_v32", "sparse attention"), ("deepseek_v2", "routing")):
        with pytest.raises(SpecDecodeError, match=why):
            config_from_hf({"model_type": model_type})


def test_an_odd_rotary_width_is_one_clear_error(tmp_path):
    hf = json.loads((mla_folder(tmp_path / "m", "deepseek_v3") / "config.json").read_text())
    hf["head_dim"] = hf["qk_rope_head_dim"] = 15
    with pytest.raises(SpecDecodeError, match="must be even"):
        config_from_hf(hf)


def add_mtp_module(folder, follow: float = 0.0) -> dict[str, torch.Tensor]:
    """Turn the last of the tiny model's layers into its MTP module (model.layers.{L}.*, a sparse latent-attention
    block as DeepSeek-V3 ships it) with random enorm, hnorm, eh_proj and shared_head.norm -> the module's
    tensors. `follow` adds follow * identity on eh_proj's embedding half and shrinks the block's outputs, so the
    module mostly predicts from the next token's embedding, as a trunk of quiet layers does (drafts such a target
    sometimes accepts, test_mla_contract.py)."""
    config = json.loads((folder / "config.json").read_text())
    trunk = config["num_hidden_layers"] - 1
    hidden, start = config["hidden_size"], f"model.layers.{trunk}."
    weights = load_file(str(folder / "model.safetensors"))
    generator = torch.Generator().manual_seed(3)
    module = {name: tensor * (0.2 if follow and name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
              for name, tensor in weights.items() if name.startswith(start)}
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        module[f"{start}{norm}.weight"] = 0.8 + 0.4 * torch.rand(hidden, generator=generator)  # [H]
    proj = torch.randn(hidden, 2 * hidden, generator=generator) * 0.15 * (0.2 if follow else 1.0)  # [H, 2H]
    proj[:, :hidden] += follow * torch.eye(hidden)
    module[start + "eh_proj.weight"] = proj
    weights = {name: tensor for name, tensor in weights.items() if not name.startswith(start)} | module
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config["num_hidden_layers"], config["num_nextn_predict_layers"] = trunk, 1
    (folder / "config.json").write_text(json.dumps(config))
    return module


def fused_experts(block: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A block's tensors as published (per expert) -> as transformers' module holds them (gate_up_proj [E, 2I, H],
    down_proj [E, H, I])."""
    count = 1 + max(int(name.split(".")[2]) for name in block if name.startswith("mlp.experts."))
    expert = [{part: block.pop(f"mlp.experts.{e}.{part}_proj.weight") for part in ("gate", "up", "down")}
              for e in range(count)]
    return block | {"mlp.experts.gate_up_proj": torch.stack([torch.cat([e["gate"], e["up"]]) for e in expert]),
                    "mlp.experts.down_proj": torch.stack([e["down"] for e in expert])}


def test_the_mtp_module_matches_the_published_forward(tmp_path):
    """Row i reads the trunk's final (post-norm) hidden state of token i and the embedding of token i+1, through
    [enorm(embedding); hnorm(hidden)], eh_proj, a sparse latent-attention block and shared_head.norm, into the
    trunk's head (DeepSeek-V3's reference; transformers' MtpLayer)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

    folder = mla_folder(tmp_path / "m", "deepseek_v3", num_hidden_layers=4)
    module = add_mtp_module(folder)
    hf = reference(folder)
    config, start, tokens = hf.config, f"model.layers.{hf.config.num_hidden_layers}.", IDS[:, :20]
    with torch.no_grad():
        final = hf(tokens, output_hidden_states=True).hidden_states[-1][:, :-1]  # [1, T-1, H] after the norm

        def norm(x: torch.Tensor, name: str) -> torch.Tensor:
            layer = DeepseekV3RMSNorm(config.hidden_size, config.rms_norm_eps)
            layer.weight.copy_(module[f"{start}{name}.weight"])
            return layer(x)

        joined = torch.cat([norm(hf.model.embed_tokens(tokens[:, 1:]), "enorm"), norm(final, "hnorm")], -1)
        block = DeepseekV3DecoderLayer(config, layer_idx=config.num_hidden_layers)  # past first_k_dense: sparse
        own_parts = ("enorm", "hnorm", "shared_head", "eh_proj")  # the module's, around the block
        block.load_state_dict(fused_experts({k.removeprefix(start): v for k, v in module.items()
                                             if not k.removeprefix(start).startswith(own_parts)}))
        positions = torch.arange(19).unsqueeze(0)  # [1, T-1] the hidden states' positions
        out = block(joined @ module[start + "eh_proj.weight"].T, position_ids=positions,
                    position_embeddings=hf.model.rotary_emb(joined, positions))
        expected = hf.lm_head(norm(out[0] if isinstance(out, tuple) else out, "shared_head.norm"))  # [1, T-1, V]
    model = load_model(folder, dtype="float32").model
    assert model.config.mtp_layers == 1
    with torch.inference_mode():
        hidden = model(tokens, torch.arange(20).unsqueeze(0), model.new_cache(20), final_hidden=True).final_hidden
        ours, _ = model.mtp_forward(0, tokens[:, 1:], hidden[:, :-1], positions, model.new_mtp_cache(20))
    assert close(ours, expected)
