"""The drafter contract (test_drafter_contract.py) over a latent-attention target (a tiny DeepSeek-V3 shipping one
MTP module), for what its verify forward changes: rows attending over compressed latents, routed to experts. A
chain and a tree from a draft model, and the target's own MTP module (test_moe_contract.py runs the drafters that
read the target's hidden states or draft blocks over a mixture of experts; what they read does not depend on the
attention). Greedy output equals plain decoding in float32; on a w4a8 target it is bitwise plain decoding, alone
and with requests verified together in batches. The draft model is a noisy copy of the target."""

from __future__ import annotations

import shutil

import pytest
import torch
from batched_runs import run_batched
from safetensors.torch import load_file, save_file
from test_drafter_contract import CONFIGS, IDS, PROMPTS, greedy
from test_mla import add_mtp_module, mla_folder

from specdecode import Engine, SpecConfig
from specdecode.models.families import family_of
from specdecode.models.kernels.w4a8_latent import W4A8LatentDecoderLayer
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model

CHOSEN = ("draft", "draft-tree", "mtp")
RUNS = [pytest.param(method, options, id=name) for (method, options), name in zip(CONFIGS, IDS) if name in CHOSEN]
BATCHED = [run for run in RUNS if run.id in ("draft-tree", "mtp")]

# These tests compare drafted counts across runs: per-step choice must not read the machine's clock (conftest).
pytestmark = pytest.mark.usefixtures("frozen_choice_clock")


def noisy_copy(folder, copy, noise: float):
    """`folder`'s model with every weight perturbed: a draft that agrees with it often but not always."""
    shutil.copytree(folder, copy)
    weights = load_file(str(copy / "model.safetensors"))
    generator = torch.Generator().manual_seed(5)
    save_file({name: tensor + torch.randn(tensor.shape, generator=generator) * noise
               for name, tensor in weights.items()}, str(copy / "model.safetensors"), metadata={"format": "pt"})
    return copy


def quiet_layers(folder, factor: float) -> None:
    """Scale every layer's output projections (attention's o_proj, the MLPs' and experts' down_proj) by `factor`:
    the trunk's prediction then leans on the current token's embedding, as the MTP module's does (add_mtp_module's
    follow), so the module's drafts are accepted now and then."""
    weights = load_file(str(folder / "model.safetensors"))
    save_file({name: tensor * factor if name.endswith(("o_proj.weight", "down_proj.weight")) else tensor
               for name, tensor in weights.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(the target, its noisy copy as the draft model, the target's folder)."""
    root = tmp_path_factory.mktemp("mla-contract")
    # q_lora_rank 32: w4a8 tiles fit the low rank, so the w4a8 target runs fused layers (kernels/w4a8_latent.py)
    folder = mla_folder(root / "target", "deepseek_v3", num_hidden_layers=4, q_lora_rank=32)
    add_mtp_module(folder, follow=1.0)  # its last layer becomes the MTP module: a 3-layer trunk
    target = load_model(folder, dtype="float32")
    draft = load_model(noisy_copy(folder, root / "draft", 0.01), dtype="float32")
    return target, draft, folder


@pytest.fixture(scope="module")
def quiet_target(pair, tmp_path_factory):
    """The target with quiet layers, whose MTP module's drafts it accepts now and then (the other drafters' are
    accepted by the target as it is)."""
    folder = shutil.copytree(pair[2], tmp_path_factory.mktemp("mla-quiet") / "target")
    quiet_layers(folder, 0.02)
    return load_model(folder, dtype="float32")


@pytest.mark.parametrize(("method", "options"), RUNS)
def test_greedy_output_equals_plain_decoding(pair, quiet_target, method, options):
    engine = Engine(quiet_target if method == "mtp" else pair[0], pair[1])
    target = engine.target.model
    assert target.config.mla is not None and target.config.mtp_layers == 1
    assert family_of(target.config).batch_invariant(target)
    drafted = accepted = 0
    for prompt in PROMPTS[:2]:
        plain = engine.complete(prompt, greedy(24), SpecConfig("none")).token_ids
        result = engine.complete(prompt, greedy(24), SpecConfig(method, num_draft_tokens=4, options=options))
        assert result.token_ids == plain, f"{method} {options} diverged on {prompt!r}"
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted  # the check only has teeth if drafts were both accepted and rejected


@pytest.fixture(scope="module")
def w4a8_engine(pair):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    return Engine(load_model(pair[2], dtype="bfloat16", quant="w4a8"), pair[1])


@pytest.mark.parametrize(("method", "options"), BATCHED)
def test_w4a8_target_output_is_bitwise_plain_decoding_alone_and_batched(w4a8_engine, monkeypatch, method, options):
    target = w4a8_engine.target.model
    assert family_of(target.config).batch_invariant(target)
    assert all(isinstance(layer, W4A8LatentDecoderLayer) for layer in target.layers)
    for prompt in PROMPTS[:2]:
        plain = w4a8_engine.complete(prompt, greedy(24), SpecConfig("none")).token_ids
        result = w4a8_engine.complete(prompt, greedy(24), SpecConfig(method, num_draft_tokens=4, options=options))
        assert result.token_ids == plain, f"{method} {options} diverged on {prompt!r} in bf16 w4a8"
    monkeypatch.setattr(w4a8_engine.load_budget, "draft_cap", lambda seqs, wanted: max(wanted))
    requests = [(p, greedy(8 + 6 * i), SpecConfig(method, num_draft_tokens=3, options=options))
                for i, p in enumerate(PROMPTS[:2])] + [(PROMPTS[2], greedy(10), SpecConfig("none"))]
    alone = [w4a8_engine.complete(*request).token_ids for request in requests]
    batched, shapes = run_batched(w4a8_engine, requests)
    assert batched == alone
    assert any(batch > 1 and rows > 1 for batch, rows in shapes), "no batch verified a draft"
