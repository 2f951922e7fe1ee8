"""GLM-4.5 (glm4_moe): logits against transformers' Glm4MoeForCausalLM on tiny random configs (biases, q/k norms,
partial rotary, sigmoid routing with a correction bias, group-limited routing, a shared expert, dense first
layers), and the MTP layer it ships (a sparse block) against the published forward and drafting through `mtp`."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from conftest import save_tiny_model
from gguf_moe_files import write_glm4moe_gguf
from safetensors.torch import load_file, save_file
from test_moe import IDS, assert_mtp_drafts_give_plain_tokens, close, logits, reference_logits

from specdecode.models.loader import load_model
from specdecode.models.survey import survey

CONFIGS = {
    "bias-qk-norm-dense-first": {},
    "no-bias-no-norm-groups": {"use_qk_norm": False, "attention_bias": False, "n_group": 4, "topk_group": 2,
                               "first_k_dense_replace": 0, "num_experts_per_tok": 3, "norm_topk_prob": False},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers_whole_in_chunks_and_token_by_token(tmp_path, name):
    folder = save_tiny_model(tmp_path / name, "glm4_moe", scale=0.15, **CONFIGS[name])
    model = load_model(folder, dtype="float32").model
    assert model.config.rotary_dim == 8  # partial_rotary_factor 0.5 of head_dim 16
    expected = reference_logits(folder, IDS)
    for chunk in (None, 32):  # the prompt longer than a chunk: the cache carries the earlier chunks
        assert close(logits(model, IDS, chunk), expected), chunk
    assert close(logits(model, IDS[:, :30], 1), expected[:, :30])  # decoding, token by token


def add_glm_mtp(folder, scale: float = 0.2) -> dict[str, torch.Tensor]:
    """One MTP layer as GLM-4.5 ships it (model.layers.{L}.*): a copy of the last trunk layer (sparse), its
    matrices shrunk by `scale`, and enorm, hnorm, eh_proj (the identity on the hidden half, so the layer mostly
    repeats the trunk's prediction and drafts are often right) and shared_head.norm -> the tensors written."""
    config = json.loads((folder / "config.json").read_text())
    trunk, hidden = config["num_hidden_layers"], config["hidden_size"]
    last, start = f"model.layers.{trunk - 1}.", f"model.layers.{trunk}."
    weights = load_file(folder / "model.safetensors")
    tensors = {start + name.removeprefix(last): value * scale if value.dim() > 1 else value.clone()
               for name, value in weights.items() if name.startswith(last)}
    generator = torch.Generator().manual_seed(7)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        tensors[f"{start}{norm}.weight"] = 0.8 + 0.4 * torch.rand(hidden, generator=generator)
    proj = torch.randn(hidden, 2 * hidden, generator=generator) * 0.03
    proj[:, hidden:] += torch.eye(hidden)  # [enorm(embedding); hnorm(hidden)]: the hidden half
    tensors[f"{start}eh_proj.weight"] = proj
    save_file(tensors, folder / "model-mtp.safetensors")
    (folder / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return tensors


def published_mtp_logits(folder, tensors: dict[str, torch.Tensor], scale: float, ids: torch.Tensor) -> torch.Tensor:
    """The MTP layer over ids [1, T] as transformers' MtpLayer computes it: row i reads the trunk's final
    (post-norm) hidden state at i and the embedding of token i+1, [enorm(e); hnorm(h)] through eh_proj, the sparse
    block, shared_head.norm and the trunk's head -> [T-1, V]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, experts_implementation="eager")
    layers = hf.config.num_hidden_layers
    start = f"model.layers.{layers}."
    block = copy.deepcopy(hf.model.layers[layers - 1])  # the same weights the file's MTP block copied, shrunk
    with torch.no_grad():
        for param in block.parameters():
            if param.dim() > 1:
                param.mul_(scale)
        trunk = hf(ids, output_hidden_states=True)
        final = trunk.hidden_states[-1][:, :-1]  # [1, T-1, H] after the final norm
        embeds = hf.model.embed_tokens(ids[:, 1:])  # [1, T-1, H]

        def norm(x: torch.Tensor, part: str) -> torch.Tensor:
            eps = hf.config.rms_norm_eps
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * tensors[f"{start}{part}.weight"]

        joined = torch.cat([norm(embeds, "enorm"), norm(final, "hnorm")], dim=-1)  # [1, T-1, 2H]
        u = joined @ tensors[f"{start}eh_proj.weight"].T  # [1, T-1, H]
        positions = torch.arange(ids.shape[1] - 1).unsqueeze(0)  # [1, T-1]
        y = block(u, position_ids=positions, position_embeddings=hf.model.rotary_emb(u, positions))
        y = y[0] if isinstance(y, tuple) else y
        return hf.lm_head(norm(y, "shared_head.norm"))[0]  # [T-1, V]


def test_the_mtp_layer_matches_the_published_forward_and_drafts_for_mtp(tmp_path):
    folder = save_tiny_model(tmp_path / "glm", "glm4_moe", scale=0.15)
    tensors = add_glm_mtp(folder)
    loaded = load_model(folder, dtype="float32")
    model = loaded.model
    assert model.config.mtp_layers == 1 and model.mtp[0].block.mlp.router is not None  # a sparse block
    ids = IDS[:, :24]
    count = ids.shape[1]
    with torch.inference_mode():
        trunk = model(ids, torch.arange(count)[None], model.new_cache(count), final_hidden=True)
        ours, _ = model.mtp_forward(0, ids[:, 1:], trunk.final_hidden[:, :-1], torch.arange(count - 1)[None],
                                    model.new_mtp_cache(count))
    assert close(ours[0], published_mtp_logits(folder, tensors, 0.2, ids))
    assert_mtp_drafts_give_plain_tokens(loaded)


def test_a_glm4moe_gguf_with_its_mtp_layer_is_the_model_its_folder_is(tmp_path):
    """Written as llama.cpp's converter writes GLM-4.5 (F16 matrices from a folder of float16-exact weights): the
    same config and bitwise the same logits, the MTP layer's too."""
    folder = save_tiny_model(tmp_path / "glm", "glm4_moe", scale=0.15, n_group=2, topk_group=1)
    add_glm_mtp(folder)
    for file in folder.glob("*.safetensors"):  # float16-exact, so the F16 file holds these very weights
        save_file({name: value.half().float() for name, value in load_file(file).items()}, file)
    write_glm4moe_gguf(tmp_path / "glm.gguf", folder)
    facts = survey(tmp_path / "glm.gguf")  # what `inspect` says
    assert facts.runs and (facts.mtp_declared, facts.mtp_present) == (1, 1)
    models = [load_model(path, dtype="float32").model for path in (folder, tmp_path / "glm.gguf")]
    theirs, ours = (model.config for model in models)
    assert (ours.moe, ours.rotary_dim, ours.qkv_bias, ours.qk_norm, ours.mtp_layers) == (
        theirs.moe, theirs.rotary_dim, theirs.qkv_bias, theirs.qk_norm, 1)
    ids, count = IDS[:, :24], 24
    results = []
    with torch.inference_mode():
        for model in models:
            trunk = model(ids, torch.arange(count)[None], model.new_cache(count), final_hidden=True)
            drafts, _ = model.mtp_forward(0, ids[:, 1:], trunk.final_hidden[:, :-1], torch.arange(count - 1)[None],
                                          model.new_mtp_cache(count))
            results.append((trunk.logits, drafts))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
