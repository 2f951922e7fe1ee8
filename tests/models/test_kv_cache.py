"""KV cache rollback: truncate (chain) and compact (tree) must leave a cache indistinguishable from one that
never saw the rejected tokens; overflow and bad rollbacks fail loudly."""

from __future__ import annotations

import pytest
import torch
from conftest import ancestor_mask

from specdecode.errors import SpecDecodeError
from specdecode.models.decoder.kv_cache import KVCache
from specdecode.models.loader import load_model

LAYERS, BATCH, KV_HEADS, HEAD_DIM, CAPACITY = 2, 2, 2, 4, 16


def filled_cache(length: int) -> KVCache:
    """A cache whose slot s of sequence b holds the value 100*b + s everywhere, and position 10 + s."""
    cache = KVCache(LAYERS, BATCH, KV_HEADS, HEAD_DIM, CAPACITY, torch.float32)
    slots = torch.arange(length, dtype=torch.float32)
    keys = torch.stack([slots + 100 * b for b in range(BATCH)])  # [B, T]
    keys = keys.view(BATCH, 1, length, 1).expand(BATCH, KV_HEADS, length, HEAD_DIM)  # [B, Hkv, T, D]
    cache.record_positions(torch.arange(10, 10 + length).expand(BATCH, -1))
    for layer in range(LAYERS):
        cache.write(layer, keys + 1000 * layer, -(keys + 1000 * layer))
    cache.advance(length)
    return cache


def slot_values(cache: KVCache, batch_index: int, layer: int = 0) -> list[float]:
    """The value stored in each used slot of one sequence (every head and channel hold the same number)."""
    keys = cache.keys[layer, batch_index, :, : cache.lengths[batch_index]]  # [Hkv, S, D]
    assert (keys == keys[:1, :, :1]).all()
    return keys[0, :, 0].tolist()


@pytest.fixture(scope="module")
def model(tiny_models):
    return load_model(tiny_models["qwen2"], dtype="float32").model


def forward(model, tokens: list[int], start: int, cache, **kwargs):
    """tokens at consecutive positions from `start`, batch of one."""
    return model(torch.tensor([tokens]), torch.arange(start, start + len(tokens)).unsqueeze(0), cache, **kwargs)


def test_write_returns_every_slot_a_query_may_see():
    cache = filled_cache(5)
    new = torch.full((BATCH, KV_HEADS, 2, HEAD_DIM), 7.0)
    keys, values = cache.write(0, new, -new)
    assert keys.shape == values.shape == (BATCH, KV_HEADS, 7, HEAD_DIM)
    assert keys[0, 0, :, 0].tolist() == [0, 1, 2, 3, 4, 7, 7]
    assert cache.lengths == [5, 5]  # writing does not advance: the caller does, once per forward


def test_truncate_then_write_overwrites_the_stale_slots():
    cache = filled_cache(6)
    cache.truncate(3)
    assert cache.lengths == [3, 3]
    new = torch.full((BATCH, KV_HEADS, 2, HEAD_DIM), -5.0)
    cache.write(0, new, new)
    cache.advance(2)
    assert slot_values(cache, 0) == [0, 1, 2, -5, -5]
    assert slot_values(cache, 1) == [100, 101, 102, -5, -5]


def test_truncate_one_sequence_leaves_the_others_alone():
    cache = filled_cache(6)
    cache.truncate(2, batch_index=1)
    assert cache.lengths == [6, 2]
    assert slot_values(cache, 0) == [0, 1, 2, 3, 4, 5]


def test_truncating_beyond_the_length_raises():
    cache = filled_cache(4)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(5)
    with pytest.raises(ValueError, match="cannot truncate"):
        cache.truncate(-1, batch_index=0)
    assert cache.lengths == [4, 4]
    cache.truncate(2, batch_index=1)
    with pytest.raises(ValueError, match="sequence 1"):
        cache.truncate(3)  # fine for sequence 0, too far for sequence 1: nothing may change
    assert cache.lengths == [4, 2]


def test_compact_keeps_exactly_the_chosen_slots_in_order():
    cache = filled_cache(9)
    cache.compact(torch.tensor([5, 7, 8]), start=4, batch_index=0)
    assert cache.lengths == [7, 9]
    for layer in range(LAYERS):
        expected = [v + 1000 * layer for v in (0, 1, 2, 3, 5, 7, 8)]
        assert slot_values(cache, 0, layer) == expected
        values = cache.values[layer, 0, :, :7]
        assert torch.equal(values, -cache.keys[layer, 0, :, :7])
    assert cache.positions[0, :7].tolist() == [10, 11, 12, 13, 15, 17, 18]
    # the other sequence is untouched
    assert slot_values(cache, 1) == [100 + s for s in range(9)]
    assert cache.positions[1, :9].tolist() == list(range(10, 19))


def test_compact_to_an_empty_path_drops_every_new_slot():
    cache = filled_cache(6)
    cache.compact(torch.tensor([], dtype=torch.long), start=4, batch_index=1)
    assert cache.lengths == [6, 4]
    assert slot_values(cache, 1) == [100, 101, 102, 103]


def test_overflowing_the_capacity_raises_and_changes_nothing(model):
    cache = model.new_cache(8)
    forward(model, [1, 2, 3, 4, 5, 6], 0, cache)
    keys_before = cache.keys.clone()
    with pytest.raises(SpecDecodeError, match="capacity of 8"):
        forward(model, [7, 8, 9], 6, cache)
    assert cache.lengths == [6]
    assert torch.equal(cache.keys, keys_before)
    forward(model, [7, 8], 6, cache)  # exactly full is fine
    assert cache.lengths == [8]


@torch.no_grad()
def test_forward_after_truncate_equals_a_cache_that_never_saw_the_rejected_tokens(model):
    prompt, draft, correction = [5, 17, 42, 99, 3, 250], [60, 61, 62, 63], 77
    cache = model.new_cache(32)
    forward(model, prompt, 0, cache)
    forward(model, draft, len(prompt), cache)
    cache.truncate(len(prompt) + 1)  # the first drafted token was accepted, the other three rejected
    after_rollback = forward(model, [correction, 8, 9], len(prompt) + 1, cache).logits

    fresh = model.new_cache(32)
    clean = forward(model, prompt + draft[:1] + [correction, 8, 9], 0, fresh).logits
    torch.testing.assert_close(after_rollback, clean[:, -3:], atol=1e-5, rtol=0)
    used = fresh.lengths[0]
    assert cache.lengths == fresh.lengths
    torch.testing.assert_close(cache.keys[:, :, :, :used], fresh.keys[:, :, :, :used], atol=1e-5, rtol=0)
    assert torch.equal(cache.positions[:, :used], fresh.positions[:, :used])


@torch.no_grad()
def test_compact_after_a_tree_forward_equals_the_accepted_chain(model):
    prompt = [5, 17, 42, 99, 3, 250]
    start = len(prompt)
    # root, branch A (a1, a2), branch B (b1, b2); B is accepted.
    nodes, depths = [10, 20, 30, 40, 50], [0, 1, 2, 1, 2]
    tree = ancestor_mask([-1, 0, 1, 0, 3])  # [1, 5, 5]
    cache = model.new_cache(32)
    forward(model, prompt, 0, cache)
    model(torch.tensor([nodes]), torch.tensor([depths]) + start, cache, attn_mask=tree)
    cache.compact(torch.tensor([start + 0, start + 3, start + 4]), start=start)
    assert cache.positions[0, : start + 3].tolist() == list(range(start + 3))
    after_compact = forward(model, [99, 98], start + 3, cache).logits

    fresh = model.new_cache(32)
    clean = forward(model, prompt + [10, 40, 50, 99, 98], 0, fresh).logits
    torch.testing.assert_close(after_compact, clean[:, -2:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_a_mask_over_cached_tree_nodes_hides_the_other_branches(model):
    """A drafter expanding a tree level by level feeds later levels while earlier ones sit in the cache: the
    mask's leading columns cover those cached nodes, so each new node sees only its own ancestors."""
    prompt = [5, 17, 42, 99, 3, 250]
    start = len(prompt)
    cache = model.new_cache(32)
    forward(model, prompt, 0, cache)
    # Level 1: siblings a1 and b1, both children of the prompt's last token.
    model(torch.tensor([[10, 40]]), torch.tensor([[start, start]]), cache,
          attn_mask=torch.tensor([[[True, False], [False, True]]]))
    # Level 2: a2 under a1, b2 under b1; columns: a1, b1 (cached), a2, b2 (new).
    mask = torch.tensor([[[True, False, True, False], [False, True, False, True]]])  # [1, 2, 4]
    level2 = model(torch.tensor([[20, 50]]), torch.tensor([[start + 1, start + 1]]), cache, attn_mask=mask).logits

    for row, branch in enumerate(([10, 20], [40, 50])):
        alone = forward(model, prompt + branch, 0, model.new_cache(32)).logits[:, -1]  # [1, V]
        torch.testing.assert_close(level2[:, row], alone, atol=1e-4, rtol=0)  # summed in another order
