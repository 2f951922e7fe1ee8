"""DFlash and DSpark drafting for a whole batch in shared forwards: where every matmul is w4a8, the backbone's
attention runs in the fixed-order kernel, so a block's bits do not depend on which other blocks (other context
lengths) share its forward, and each request of a batched step drafts exactly what it drafts alone."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from batched_runs import drafts_in_shared_forwards
from conftest import save_tiny_model
from dflash_drafters import write_random_dflash, write_random_dspark

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.models.formats.dflash import load_dflash
from specdecode.models.kernels.w4a8_linear import load_kernel, w4a8_unavailable
from specdecode.models.loader import load_model

WRITERS = {"dflash": write_random_dflash, "dspark": write_random_dspark}


@pytest.fixture(scope="module")
def target_folder(tmp_path_factory):
    if w4a8_unavailable():
        pytest.skip(f"the w4a8 kernel does not run here ({w4a8_unavailable()})")
    return save_tiny_model(tmp_path_factory.mktemp("blocks") / "target", "qwen2", scale=0.15)


@pytest.fixture(scope="module", params=sorted(WRITERS))
def engine(request, target_folder, tmp_path_factory):
    """A w4a8 target with a w4a8 drafter of each kind that leans to the target's most frequent token (so some
    drafts are accepted and some rejected)."""
    target = load_model(target_folder, dtype="bfloat16", quant="w4a8")
    emitted = Engine(target).complete("The quick brown fox", SamplingParams(max_tokens=24, ignore_eos=True))
    favour = max(set(emitted.token_ids), key=emitted.token_ids.count)
    extra = {"confidence_bias": 0.5} if request.param == "dspark" else {}
    folder = WRITERS[request.param](tmp_path_factory.mktemp(request.param) / "drafter", target, scale=0.05,
                                    favour=favour, **extra)
    return Engine(target, draft_path=folder, draft_quant="w4a8"), request.param


def test_a_block_keeps_its_bits_beside_blocks_over_other_contexts(engine):
    engine, method = engine
    model = engine.drafter(SpecConfig(method, guard=False)).model
    assert model.fixed_attend is not None, "a w4a8 drafter on a w4a8 target must be batch-invariant"
    generator = torch.Generator().manual_seed(0)
    width = model.fc.in_features
    size = model.config.block_size
    caches = []
    for context in (5, 19):  # two requests' contexts of different lengths
        cache = model.new_cache(context + size)
        states = torch.randn(context, width, generator=generator).to(model.dtype)  # [C, n_aux * Ht]
        with torch.inference_mode():
            model.add_context(states, torch.arange(context), cache)
        caches.append(cache)
    tokens = torch.full((2, size), model.config.mask_token_id)  # [N, B]
    tokens[:, 0] = torch.tensor([11, 42])
    positions = torch.tensor([[5], [19]]) + torch.arange(size)  # [N, B]
    with torch.inference_mode():
        alone = [model.blocks_hidden(tokens[n : n + 1], positions[n : n + 1], [caches[n]]) for n in range(2)]
        together = model.blocks_hidden(tokens, positions, caches)  # [2, B, H]
    for n in range(2):
        assert torch.equal(together[n], alone[n][0])
    assert [cache.lengths[0] for cache in caches] == [5, 19], "a block's keys must stay out of the context"


@pytest.mark.parametrize("causal, window", [(False, None), (True, None), (False, 3), (True, 3)])
def test_the_fixed_order_attention_computes_what_the_pytorch_one_does(target_folder, tmp_path, causal, window):
    """The kernel's visibility (the whole context, then the block: non-causal, causal or in a sliding window) is
    the PyTorch path's, which test_dflash.py checks against the authors' code: float32, within rounding."""
    target = load_model(target_folder, dtype="float32")
    model, _ = load_dflash(write_random_dflash(tmp_path / "drafter", target), target.model, 64)
    model.config = replace(model.config, causal_layers=(causal,), windows=(window,))
    model.fixed_attend = load_kernel().attend
    generator = torch.Generator().manual_seed(1)
    cache = model.new_cache(32)
    size = model.config.block_size
    with torch.inference_mode():
        model.add_context(torch.randn(9, model.fc.in_features, generator=generator), torch.arange(9), cache)
        tokens = torch.tensor([17] + [model.config.mask_token_id] * (size - 1))  # [B]
        positions = torch.arange(9, 9 + size)  # [B]
        expected = model.block_hidden(tokens, positions, cache)  # [B, H]
        fixed = model.blocks_hidden(tokens[None], positions[None], [cache])[0]  # [B, H]
    assert torch.allclose(fixed, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_batch_drafts_its_blocks_in_one_forward_and_each_request_as_alone(engine, monkeypatch, temperature):
    engine, method = engine
    spec = SpecConfig(method, guard=False)
    model = engine.drafter(spec).model
    calls = drafts_in_shared_forwards(engine, spec, temperature, model, "blocks_hidden", monkeypatch)
    assert any(args[0].shape[0] > 1 for args, _ in calls), "no block forward ran for several requests"
