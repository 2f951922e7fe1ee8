"""llama.cpp's deepseek2 GGUF files (DeepSeek-V3 and GLM-4.7-Flash) read as the Hugging Face folders they were
converted from: the same config, and logits bitwise equal (every tensor stored in F32), whether kv_b_proj is
split into attn_k_b/attn_v_b (today's converter) or whole (older files); the MTP module too."""

from __future__ import annotations

import struct

import pytest
import torch
from gguf_mla_files import write_deepseek2_gguf
from test_mla import IDS, add_mtp_module, logits, mla_folder

from specdecode.errors import SpecDecodeError
from specdecode.models.loader import load_model
from specdecode.models.survey import survey


@pytest.mark.parametrize(("arch", "split"), [("deepseek_v3", True), ("deepseek_v3", False), ("glm4_moe_lite", True)])
def test_a_deepseek2_file_is_the_model_its_folder_is(tmp_path, arch, split):
    folder = mla_folder(tmp_path / "m", arch, rms_norm_eps=1e-6)  # as transformers' latent norms: one epsilon
    write_deepseek2_gguf(tmp_path / "m.gguf", folder, split_kv_b=split)
    from_folder = load_model(folder, dtype="float32").model
    from_file = load_model(tmp_path / "m.gguf", dtype="float32").model
    ours, theirs = from_file.config, from_folder.config
    assert (ours.moe, ours.mla, ours.rope_scaling, ours.num_layers) == (theirs.moe, theirs.mla, theirs.rope_scaling,
                                                                        theirs.num_layers)
    for chunks in ((70,), (60,) + (1,) * 10):
        assert torch.equal(logits(from_file, IDS, chunks), logits(from_folder, IDS, chunks)), chunks


def test_glm_4_7_flash_file_brings_its_mtp_module(tmp_path):
    folder = mla_folder(tmp_path / "m", "glm4_moe_lite", num_hidden_layers=4, rms_norm_eps=1e-6,
                        mlp_layer_types=["dense"] + ["sparse"] * 3)
    add_mtp_module(folder)
    write_deepseek2_gguf(tmp_path / "m.gguf", folder)
    facts = survey(tmp_path / "m.gguf")  # what `inspect` says
    assert facts.runs and (facts.mtp_declared, facts.mtp_present) == (1, 1)
    models = [load_model(path, dtype="float32").model for path in (folder, tmp_path / "m.gguf")]
    tokens, positions = IDS[:, :20], torch.arange(19).unsqueeze(0)  # [1, 20], [1, 19]
    drafts = []
    with torch.inference_mode():
        for model in models:
            assert model.config.mtp_layers == 1
            hidden = model(tokens, torch.arange(20).unsqueeze(0), model.new_cache(20), final_hidden=True).final_hidden
            drafts.append(model.mtp_forward(0, tokens[:, 1:], hidden[:, :-1], positions, model.new_mtp_cache(20))[0])
    assert torch.equal(*drafts)


def test_a_softmax_routed_file_is_deepseek_v2_and_refused_with_why(tmp_path):
    folder = mla_folder(tmp_path / "m", "deepseek_v3")
    path = tmp_path / "m.gguf"
    write_deepseek2_gguf(path, folder)
    data = path.read_bytes()
    key = b"deepseek2.expert_gating_func"
    at = data.index(key) + len(key) + 4  # the value follows its type (uint32 4 bytes)
    path.write_bytes(data[:at] + struct.pack("<I", 1) + data[at + 4 :])
    with pytest.raises(SpecDecodeError, match="DeepSeek-V2"):
        load_model(path, dtype="float32")
