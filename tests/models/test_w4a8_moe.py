"""The compiled mixture-of-experts block (kernels/w4a8_moe.py, w4a8_moe.cpp) of every MoE family, for each kernel
variant this CPU runs: it routes each row to the experts the PyTorch router chooses, in the same slot order, and
computes what the PyTorch block computes over the same w4a8 experts within float rounding; a row's bits do not
depend on the rows beside it; and a w4a8 model loads with its blocks compiled and stays batch-invariant."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_model
from test_w4a8_linear import each_variant

from specdecode.models.decoder.moe import ExpertTally, MoEBlock
from specdecode.models.families import family_of
from specdecode.models.kernels import w4a8_linear
from specdecode.models.kernels.w4a8_decoder import W4A8DecoderLayer
from specdecode.models.kernels.w4a8_moe import W4A8MoEBlock, moe_kernel
from specdecode.models.loader import load_model
from specdecode.models.quantized_model import WEIGHTS_FILE

# Each family's routing: softmax and renormalised (Qwen3-MoE, its layers fused whole), sigmoid with a correction
# bias, scaling and a shared expert (GLM-4.5, DeepSeek-V3 with groups, GLM-4.7-Flash), a gated shared expert
# (Qwen 3.5 MoE: 64 wide, as w4a8 tiles need; the gate's one row stays int8).
FAMILIES = {"qwen3_moe": {}, "glm4_moe": {}, "deepseek_v3": {}, "glm4_moe_lite": {},
            "qwen3_5_moe": {"shared_expert_intermediate_size": 64}}


@pytest.fixture(autouse=True, params=each_variant())
def variant(request, monkeypatch):
    """Every w4a8 model of a test runs on this kernel variant."""
    monkeypatch.setattr(w4a8_linear, "_kernel", w4a8_linear.load_variant(request.param))


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request, tmp_path_factory):
    arch = request.param
    folder = save_tiny_model(tmp_path_factory.mktemp(arch) / arch, arch, scale=0.15, **FAMILIES[arch])
    return load_model(folder, dtype="float32", quant="w4a8").model


def moe_blocks(model) -> list[MoEBlock]:
    return [module for module in model.modules() if isinstance(module, MoEBlock)]


def test_a_w4a8_model_loads_with_its_experts_compiled_and_stays_batch_invariant(model):
    blocks = moe_blocks(model)
    assert blocks and all(block.router.in_kernel for block in blocks)
    if family_of(model.config).name == "qwen3_moe":  # attention and experts in one call per layer
        assert all(isinstance(layer, W4A8DecoderLayer) for layer in model.layers)
    else:  # latent attention, partial rotary or the hybrid trunk's layers stay in PyTorch around the compiled block
        assert all(isinstance(block, W4A8MoEBlock) for block in blocks)
    assert model.routers_invariant and family_of(model.config).batch_invariant(model)


def test_the_compiled_block_routes_and_computes_as_the_pytorch_block(model):
    generator = torch.Generator().manual_seed(0)
    for block in moe_blocks(model):
        rows = torch.randn(24, model.config.hidden_size, generator=generator)  # [N, H]
        ours, experts = moe_kernel(block).forward(rows)  # [N, H], [N, k]
        _, reference_experts = block.router(rows)  # [N, k], best first
        assert torch.equal(experts, reference_experts)
        reference = MoEBlock.forward(block, rows[None])[0]  # the PyTorch block over the same submodules
        # Both round the experts' activations to int8, and an input a float32 rounding away from a rounding step
        # flips a code (test_w4a8_decoder.py); a wrong weight, bias, gate or slot would move every row by far more.
        scale = reference.abs().max()
        by_row = (ours - reference).abs().amax(-1)  # [N]
        assert by_row.max() < 0.05 * scale and by_row.median() < 1e-4 * scale


def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(model):
    generator = torch.Generator().manual_seed(1)
    block = moe_blocks(model)[-1]
    kernel = moe_kernel(block)
    rows = torch.randn(6, model.config.hidden_size, generator=generator)  # [6, H]
    rows = torch.cat([rows, rows[:2]])  # repeated rows: experts with several rows each
    together, _ = kernel.forward(rows)  # [8, H]
    for i in range(len(rows)):
        alone, _ = kernel.forward(rows[i : i + 1].contiguous())  # [1, H]
        assert torch.equal(alone[0], together[i])


def test_the_tally_counts_the_distinct_experts_a_forward_read(model):
    """What per-step choice prices a draft by (drafters/verify_cost.py): the union of the rows' experts, per sparse
    layer, counted by the compiled block (alone or inside a fused layer) as it runs."""
    block = moe_blocks(model)[-1]
    kernel = moe_kernel(block)
    rows = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))  # [5, H]
    _, experts = kernel.forward(rows)  # [5, k]
    assert kernel.touched() == len(experts.unique())
    tally = ExpertTally.of(model)
    moe = model.config.moe
    sparse = [i for i in range(model.config.num_layers) if moe.sparse(i)]
    assert len(tally.blocks) == len(sparse)  # the trunk's blocks: its MTP modules' are drafting, not verifying
    cache = model.new_cache(16)
    ids = torch.arange(3, 11).unsqueeze(0)  # [1, 8]
    with torch.inference_mode():
        model(ids[:, :1], torch.arange(1).unsqueeze(0), cache)
        assert tally.last() == moe.experts_per_token  # one row reads its k experts, no more
        model(ids[:, 1:], torch.arange(1, 8).unsqueeze(0), cache)
    assert moe.experts_per_token < tally.last() <= min(moe.num_experts, 7 * moe.experts_per_token)


def test_a_cached_models_experts_are_mapped_from_its_file_not_copied(tmp_path, cache):
    """Loaded again from its quantized copy, a mixture of experts keeps its experts as views into the mapped file
    (pages of experts no token routes to are never read, and the system may drop idle ones), every other weight in
    an allocation of its own; the model is the one built before, bit for bit."""
    folder = save_tiny_model(tmp_path / "moe", "qwen3_moe", scale=0.15)
    built = load_model(folder, dtype="float32", quant="w4a8")  # quantized, then saved to the cache
    cached = load_model(folder, dtype="float32", quant="w4a8")  # read back from it
    [file] = cache.glob(f"quantized/*/{WEIGHTS_FILE}")
    size = file.stat().st_size
    storages = {name: buffer.untyped_storage() for name, buffer in cached.model.named_buffers()
                if name.endswith(("codes", "group_scales", "block_scales"))}
    experts = {name: storage for name, storage in storages.items() if ".experts." in name}
    assert experts and len({storage.data_ptr() for storage in experts.values()}) == 1  # one mapping, all experts
    assert all(storage.nbytes() == size for storage in experts.values())
    assert all(storage.nbytes() < size for name, storage in storages.items() if name not in experts)
    ids = torch.arange(3, 15).unsqueeze(0)  # [1, 12]
    with torch.inference_mode():
        logits = [m.model(ids, torch.arange(12).unsqueeze(0), m.model.new_cache(12)).logits for m in (built, cached)]
    assert torch.equal(*logits)
