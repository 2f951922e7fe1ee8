"""Our decoder against transformers' implementation, family by family, on tiny random models.

The reference is always transformers running the whole sequence in one causal forward (fp32, same folder), so
every cached, chunked, batched or tree-masked path of ours is checked against the plain definition.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import TINY_CONFIGS, TINY_VOCAB, ancestor_mask, save_tiny_model

from specdecode.models.loader import load_model

# Both sides compute in fp32 but in a different op order (fused qkv and gate/up matmuls, grouped-query heads
# folded into the query length, SDPA vs transformers' attention): observed |Δlogit| ≈ 2e-5 on logits of size
# ~10. 1e-4 leaves headroom for that rounding and is still far below any real bug (those move logits by ≥1e-2).
LOGITS_ATOL = 1e-4
# Hidden states grow along the residual stream (|h| up to ~20 here), so they get a relative part as well.
HIDDEN_ATOL, HIDDEN_RTOL = 1e-4, 1e-4
# bf16 keeps 8 mantissa bits: through 3 random layers the logits move by up to ~3% of their range (observed
# max |Δ| ≈ 0.55 on a spread of ~19) while each row keeps its shape (cosine ≥ 0.996). Random tiny models have
# near-tied top logits, so argmax agreement is not a fair bf16 check here.
BF16_ATOL_FRACTION = 0.05
BF16_MIN_COSINE = 0.99

ARCHS = [arch for arch in TINY_CONFIGS if arch != "qwen3_5"]  # the Llama family; the hybrid: test_hybrid.py


def token_ids(length: int, seed: int) -> torch.Tensor:
    """[1, length] random ids over the whole tiny vocabulary."""
    return torch.randint(0, TINY_VOCAB, (1, length), generator=torch.Generator().manual_seed(seed))


def run(model, tokens: torch.Tensor, start: int, cache, **kwargs):
    """One forward of `tokens` [B, T] at consecutive positions from `start`."""
    positions = torch.arange(start, start + tokens.shape[1]).expand(tokens.shape[0], -1)
    return model(tokens, positions, cache, **kwargs)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_models):
    """(arch, our model, transformers' model) over the same tiny folder, both fp32."""
    from transformers import AutoModelForCausalLM

    folder = tiny_models[request.param]
    ours = load_model(folder, dtype="float32").model
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    return request.param, ours, reference


@torch.no_grad()
def reference_logits(reference, tokens: torch.Tensor) -> torch.Tensor:
    """[B, T, V] logits of one full causal forward in transformers."""
    return reference(tokens).logits.float()


@torch.no_grad()
def test_full_forward_matches_transformers(pair):
    _, ours, reference = pair
    tokens = token_ids(40, seed=1)  # 40 > mistral's window of 24, so the window is exercised
    logits = run(ours, tokens, 0, ours.new_cache(64)).logits
    assert logits.shape == (1, 40, TINY_VOCAB)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits, reference_logits(reference, tokens), atol=LOGITS_ATOL, rtol=0)


@torch.no_grad()
def test_prefill_decode_and_chunk_through_cache_match_full_forward(pair):
    _, ours, reference = pair
    tokens = token_ids(40, seed=2)
    expected = reference_logits(reference, tokens)
    cache = ours.new_cache(64)
    # prefill 20, six single-token steps, a chunk of 8, then six more single steps: 20 + 6 + 8 + 6 = 40.
    steps = [(0, 20)] + [(i, 1) for i in range(20, 26)] + [(26, 8)] + [(i, 1) for i in range(34, 40)]
    for start, size in steps:
        logits = run(ours, tokens[:, start : start + size], start, cache).logits
        torch.testing.assert_close(logits, expected[:, start : start + size], atol=LOGITS_ATOL, rtol=0,
                                   msg=lambda m, s=start: f"tokens from {s}: {m}")
        assert cache.lengths == [start + size]


@torch.no_grad()
def test_mistral_sliding_window_changes_logits_beyond_the_window(tiny_models):
    """Guards the comparisons above against a window that is silently ignored on both sides."""
    ours = load_model(tiny_models["mistral"], dtype="float32").model
    assert ours.config.sliding_window == 24
    tokens = token_ids(40, seed=3)
    windowed = run(ours, tokens, 0, ours.new_cache(64)).logits
    ours.config = dataclasses.replace(ours.config, sliding_window=None)
    full = run(ours, tokens, 0, ours.new_cache(64)).logits
    torch.testing.assert_close(windowed[:, :24], full[:, :24])  # inside the window nothing is masked
    assert (windowed[:, 24:] - full[:, 24:]).abs().max() > 1e-2


@torch.no_grad()
def test_logits_at_returns_only_the_requested_rows(pair):
    _, ours, _ = pair
    tokens = token_ids(12, seed=4)
    full = run(ours, tokens, 0, ours.new_cache(16)).logits
    rows = torch.tensor([0, 5, 11])
    picked = run(ours, tokens, 0, ours.new_cache(16), logits_at=rows).logits
    assert picked.shape == (1, 3, TINY_VOCAB)
    torch.testing.assert_close(picked, full[:, rows])
    last = run(ours, tokens, 0, ours.new_cache(16), logits_at=slice(-1, None)).logits
    assert last.shape == (1, 1, TINY_VOCAB)
    torch.testing.assert_close(last, full[:, -1:])


@torch.no_grad()
def test_hidden_layer_ids_are_boundaries_like_transformers_hidden_states(pair):
    _, ours, reference = pair
    layers = ours.config.num_layers
    tokens = token_ids(16, seed=5)
    out = run(ours, tokens, 0, ours.new_cache(16), hidden_layers=tuple(range(layers + 1)))
    hf_hidden = reference(tokens, output_hidden_states=True).hidden_states
    assert len(hf_hidden) == layers + 1
    assert sorted(out.hidden) == list(range(layers + 1))
    torch.testing.assert_close(out.hidden[0], ours.embed(tokens))  # id 0: the embedding output
    for k in range(layers):
        torch.testing.assert_close(out.hidden[k], hf_hidden[k], atol=HIDDEN_ATOL, rtol=HIDDEN_RTOL,
                                   msg=lambda m, k=k: f"boundary {k}: {m}")
    # transformers' last entry is after the final norm; our id L is the residual stream before it.
    torch.testing.assert_close(ours.norm(out.hidden[layers]), hf_hidden[layers], atol=HIDDEN_ATOL,
                               rtol=HIDDEN_RTOL)
    assert not torch.allclose(out.hidden[layers], hf_hidden[layers], atol=1e-2)


@torch.no_grad()
def test_only_requested_hidden_layers_are_returned(pair):
    _, ours, _ = pair
    out = run(ours, token_ids(4, seed=6), 0, ours.new_cache(8), hidden_layers=(1,))
    assert list(out.hidden) == [1]
    assert run(ours, token_ids(4, seed=6), 0, ours.new_cache(8)).hidden == {}


@torch.no_grad()
def test_tree_mask_gives_each_branch_the_logits_of_its_chain(pair):
    _, ours, reference = pair
    prefix_len = 26  # past mistral's window, so the window applies inside the tree too
    prefix = token_ids(prefix_len, seed=7)
    # Tree nodes: root r, then branch A (a1, a2) and branch B (b1, b2), which share positions with A.
    r, a1, a2, b1, b2 = 10, 20, 30, 40, 50
    nodes = torch.tensor([[r, a1, a2, b1, b2]])
    positions = torch.tensor([[0, 1, 2, 1, 2]]) + prefix_len
    tree = ancestor_mask([-1, 0, 1, 0, 3])  # [B, T, T]: a node sees itself and its ancestors
    cache = ours.new_cache(64)
    run(ours, prefix, 0, cache)
    logits = ours(nodes, positions, cache, attn_mask=tree).logits  # [1, 5, V]
    for branch, columns in (((r, a1, a2), [0, 1, 2]), ((r, b1, b2), [0, 3, 4])):
        chain = torch.cat([prefix, torch.tensor([branch])], dim=1)
        expected = reference_logits(reference, chain)[:, prefix_len:]
        torch.testing.assert_close(logits[:, columns], expected, atol=LOGITS_ATOL, rtol=0)


@torch.no_grad()
def test_batch_with_different_cache_lengths_matches_each_sequence_alone(pair):
    _, ours, reference = pair
    first, second = token_ids(34, seed=8), token_ids(34, seed=9)
    cache = ours.new_cache(64, batch_size=2)
    run(ours, torch.cat([first[:, :28], second[:, :28]]), 0, cache)
    cache.truncate(20, batch_index=0)  # the first sequence rolls back 8 tokens: lengths now differ
    assert cache.lengths == [20, 28]
    starts = [20, 28]
    logits_per_step = []
    for size in (3, 1, 1, 1):  # a chunk, then single-token steps with unequal lengths
        tokens = torch.cat([first[:, starts[0] : starts[0] + size], second[:, starts[1] : starts[1] + size]])
        positions = torch.stack([torch.arange(s, s + size) for s in starts])
        logits_per_step.append(ours(tokens, positions, cache).logits)
        starts = [s + size for s in starts]
    assert cache.lengths == [26, 34]
    ours_first = torch.cat([step[0] for step in logits_per_step])  # [6, V] for positions 20..25
    ours_second = torch.cat([step[1] for step in logits_per_step])  # [6, V] for positions 28..33
    torch.testing.assert_close(ours_first, reference_logits(reference, first[:, :26])[0, 20:],
                               atol=LOGITS_ATOL, rtol=0)
    torch.testing.assert_close(ours_second, reference_logits(reference, second)[0, 28:],
                               atol=LOGITS_ATOL, rtol=0)


@torch.no_grad()
def test_bfloat16_model_runs_close_to_float32(pair, tiny_models):
    arch, ours, _ = pair
    bf16 = load_model(tiny_models[arch], dtype="bfloat16").model
    assert bf16.dtype == torch.bfloat16
    tokens = token_ids(24, seed=10)
    expected = run(ours, tokens, 0, ours.new_cache(32)).logits
    cache = bf16.new_cache(32)
    assert cache.keys.dtype == torch.bfloat16
    got = run(bf16, tokens[:, :20], 0, cache).logits
    got = torch.cat([got] + [run(bf16, tokens[:, i : i + 1], i, cache).logits for i in range(20, 24)], dim=1)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    spread = expected.max() - expected.min()
    assert (got - expected).abs().max() < BF16_ATOL_FRACTION * spread
    assert torch.nn.functional.cosine_similarity(got, expected, dim=-1).min() > BF16_MIN_COSINE


@torch.no_grad()
def test_tied_embeddings_load_and_match_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model(tmp_path / "tied", "qwen2", seed=3, tie_word_embeddings=True)
    ours = load_model(folder, dtype="float32").model
    assert ours.config.tie_word_embeddings
    everything = torch.arange(ours.config.vocab_size)
    assert torch.equal(ours.output_rows(everything), ours.embed.weight)  # the head reads the embedding's rows
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tokens = token_ids(16, seed=11)
    torch.testing.assert_close(run(ours, tokens, 0, ours.new_cache(16)).logits,
                               reference_logits(reference, tokens), atol=LOGITS_ATOL, rtol=0)
