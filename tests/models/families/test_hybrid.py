"""Qwen 3.5's hybrid trunk (Gated DeltaNet + gated full attention) against transformers, and speculation over its
recurrent states: rollback and tree paths leave exactly the states of a clean run over the accepted tokens."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_VOCAB, save_tiny_model
from hybrid_reference import add_hybrid_mtp

from specdecode.errors import SpecDecodeError
from specdecode.models.families import config_from_hf
from specdecode.models.families.qwen3_5.gated_deltanet import SEQUENTIAL_ROWS, chunked_delta_rule, sequential_delta_rule
from specdecode.models.loader import load_model

PATTERNS = {
    "one-full-in-four": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "full-first": ["full_attention", "linear_attention", "linear_attention"],
    "full-last": ["linear_attention", "linear_attention", "full_attention"],
}
# float32, relative to the largest logit: our three forms against transformers' torch reference (itself chunked)
RELATIVE_TOLERANCE = 1e-4


def close(ours: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((ours - expected).abs().max() <= RELATIVE_TOLERANCE * expected.abs().max())


def hybrid_folder(root, pattern: str, mtp: bool = False, **overrides):
    folder = save_tiny_model(root / pattern, "qwen3_5", scale=0.15, layer_types=PATTERNS[pattern],
                             num_hidden_layers=len(PATTERNS[pattern]), **overrides)
    if mtp:
        add_hybrid_mtp(folder, follow=1.0)
    return folder


def reference_logits(folder, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits  # [1, T, V]


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_logits_match_transformers_whole_in_chunks_and_token_by_token(tmp_path, pattern):
    folder = hybrid_folder(tmp_path, pattern, linear_num_value_heads=4 if pattern != "full-last" else 2)
    model = load_model(folder, dtype="float32").model
    ids = torch.randint(0, TINY_VOCAB, (1, 2 * SEQUENTIAL_ROWS + 30), generator=torch.Generator().manual_seed(1))
    length = ids.shape[1]
    expected = reference_logits(folder, ids)
    with torch.inference_mode():
        whole = model(ids, torch.arange(length).unsqueeze(0), model.new_cache(length)).logits  # chunked form
        cache, parts = model.new_cache(length), []
        for start in range(0, length, 40):  # the sequential form, 40 rows a forward
            rows = torch.arange(start, min(start + 40, length)).unsqueeze(0)
            parts.append(model(ids[:, start : start + 40], rows, cache).logits)
        cache, steps = model.new_cache(length), []
        for t in range(length):  # decoding
            steps.append(model(ids[:, t : t + 1], torch.tensor([[t]]), cache).logits)
    for ours in (whole, torch.cat(parts, 1), torch.cat(steps, 1)):
        assert close(ours, expected)


def recurrence_inputs(seed: int, batch: int, rows: int, heads: int, key_dim: int, value_dim: int) -> tuple:
    """Random inputs of the delta rule: q, k [B, T, H, dk] normalised, v [B, T, H, dv], log_decay, beta
    [B, T, H], and the state before row 0 [B, H, dk, dv]."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(batch, rows, heads, key_dim, generator=generator), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(batch, rows, heads, key_dim, generator=generator), dim=-1)
    v = torch.randn(batch, rows, heads, value_dim, generator=generator)
    log_decay = -torch.rand(batch, rows, heads, generator=generator)
    beta = torch.rand(batch, rows, heads, generator=generator)
    state = torch.randn(batch, heads, key_dim, value_dim, generator=generator)
    return q, k, v, log_decay, beta, state


def test_chunked_and_sequential_forms_agree():
    q, k, v, log_decay, beta, state = recurrence_inputs(0, batch=2, rows=150, heads=3, key_dim=8, value_dim=5)
    out, states = sequential_delta_rule(q, k, v, log_decay, beta, state, None)
    for chunk in (1, 7, 64, 200):
        chunked, final = chunked_delta_rule(q, k, v, log_decay, beta, state, chunk)
        assert torch.allclose(chunked, out, atol=1e-4) and torch.allclose(final, states[-1], atol=1e-4)


def test_the_compiled_recurrence_matches_the_pytorch_form_and_gives_each_row_the_same_bits_however_called():
    from specdecode.models.kernels.w4a8_linear import load_kernel, w4a8_unavailable

    if (reason := w4a8_unavailable()) is not None:
        pytest.skip(f"the compiled kernels cannot run here: {reason}")
    fused = load_kernel().delta_rule
    rows = 9
    q, k, v, log_decay, beta, state = recurrence_inputs(1, batch=2, rows=rows, heads=3, key_dim=16, value_dim=24)
    tree = torch.tensor([[-1, 0, 0, 1, 2, 4, 3, 6, 5], [-1, 0, 1, 2, 3, 4, 5, 6, 7]])
    for parents in (None, tree):
        expected, expected_states = sequential_delta_rule(q, k, v, log_decay, beta, state, parents, 2)
        out, states = fused(q, k, v, log_decay.exp(), beta, state, parents, 2)
        assert torch.allclose(out, expected, atol=1e-5) and len(states) == rows - 2
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(states, expected_states))
    # A chain's rows one call at a time, each from the state the call before left: bitwise the rows of one call.
    out, states = fused(q, k, v, log_decay.exp(), beta, state, None, 0)
    before = state
    for t in range(rows):
        one, (after,) = fused(*(x[:, t : t + 1] for x in (q, k, v, log_decay.exp(), beta)), before, None, 0)
        assert torch.equal(one[:, 0], out[:, t]) and torch.equal(after, states[t])
        before = after
    with pytest.raises(RuntimeError, match="earlier row"):
        fused(q, k, v, log_decay.exp(), beta, state, tree.flip(1), 0)


def test_a_hybrid_model_decodes_through_the_compiled_recurrence_where_it_runs(hybrid_model):
    from specdecode.models.kernels.w4a8_linear import w4a8_unavailable

    if (reason := w4a8_unavailable()) is not None:
        pytest.skip(f"the compiled kernels cannot run here: {reason}")
    recurrent = [layer.mixer for layer in hybrid_model.layers if layer.kind == "linear_attention"]
    assert recurrent and all(mixer.fused_rule is not None for mixer in recurrent)


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory):
    return load_model(hybrid_folder(tmp_path_factory.mktemp("hybrid"), "one-full-in-four"), dtype="float32").model


def clean_state(model, tokens: list[int]):
    """A clean run: the cache after reading `tokens` in one forward."""
    cache = model.new_cache(len(tokens) + 8)
    with torch.inference_mode():
        model(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0), cache)
    return cache


def assert_same_states(ours, reference):
    for a, b in zip(ours.state().conv + ours.state().ssm, reference.state().conv + reference.state().ssm):
        assert torch.equal(a, b)


@pytest.mark.parametrize("accepted", range(5))
def test_rollback_after_a_rejection_leaves_the_states_of_the_accepted_tokens(hybrid_model, accepted):
    prompt, drafts = [5, 9, 11, 3, 200, 17], [40, 41, 42, 43]
    cache = hybrid_model.new_cache(32, rollback_rows=len(drafts) + 1)
    with torch.inference_mode():
        hybrid_model(torch.tensor([prompt[:-1]]), torch.arange(len(prompt) - 1).unsqueeze(0), cache)
        rows = [prompt[-1], *drafts]  # the root and the drafted chain, one verify forward
        start = len(prompt) - 1
        hybrid_model(torch.tensor([rows]), torch.arange(start, start + len(rows)).unsqueeze(0), cache)
    cache.keep(start, list(range(accepted + 1)))
    assert cache.lengths == [start + accepted + 1]
    assert_same_states(cache, clean_state(hybrid_model, prompt + drafts[:accepted]))


def test_a_tree_path_keeps_the_states_of_a_clean_run_over_it(hybrid_model):
    from conftest import ancestor_mask

    prompt = [7, 8, 9, 10]
    tokens, parents = [50, 51, 52, 53, 54, 55], [-1, -1, 0, 1, 3, 2]  # two branches from the root
    cache = hybrid_model.new_cache(32, rollback_rows=len(tokens) + 1)
    start = len(prompt) - 1
    with torch.inference_mode():
        hybrid_model(torch.tensor([prompt[:-1]]), torch.arange(start).unsqueeze(0), cache)
        depths = [0]
        for p in parents:
            depths.append(depths[p + 1] + 1)
        mask = ancestor_mask([-1] + [p + 1 for p in parents])  # [1, N+1, N+1]: root first, nodes after it
        rows = torch.tensor([[prompt[-1], *tokens]])
        hybrid_model(rows, (start + torch.tensor(depths)).unsqueeze(0), cache, attn_mask=mask)
    path = [0, 2, 4, 5]  # root, node 1, node 3, node 4
    cache.keep(start, path)
    assert_same_states(cache, clean_state(hybrid_model, prompt + [tokens[1], tokens[3], tokens[4]]))


def test_rolling_back_further_than_its_window_is_one_clear_error(hybrid_model):
    cache = hybrid_model.new_cache(32)  # plain decoding's: only the current state
    with torch.inference_mode():
        for t in range(4):
            hybrid_model(torch.tensor([[t + 3]]), torch.tensor([[t]]), cache)
    with pytest.raises(SpecDecodeError, match="keeps the states of its last 1 rows"):
        cache.truncate(1)


def test_the_mtp_module_matches_transformers_mtp_layer(tmp_path):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpLayer
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

    folder = hybrid_folder(tmp_path, "one-full-in-four", mtp=True)
    ours = load_model(folder, dtype="float32").model
    assert ours.config.mtp_layers == 1
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    mtp_config = reference.config.__class__(**{**reference.config.to_dict(), "layer_types": ["full_attention"],
                                               "num_hidden_layers": 1})
    layer = MtpLayer(mtp_config, Qwen3_5DecoderLayer, Qwen3_5RMSNorm, 0).eval()
    from safetensors.torch import load_file

    stored = load_file(str(folder / "model-mtp.safetensors"))
    names = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "eh_proj": "fc", "post_norm": "norm"}
    state = {f"{ours_}.weight": stored[f"mtp.{theirs}.weight"] for ours_, theirs in names.items()}
    state |= {f"mtp_block.{k.removeprefix('mtp.layers.0.')}": v for k, v in stored.items() if "layers.0." in k}
    layer.load_state_dict(state)
    ids = torch.randint(0, TINY_VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(11).unsqueeze(0)
    with torch.inference_mode():
        out = ours(ids[:, :-1], positions, ours.new_cache(12), final_hidden=True)
        logits, fed_back = ours.mtp_forward(0, ids[:, 1:], out.final_hidden, positions, ours.new_mtp_cache(12))
        trunk = reference.model(ids[:, :-1], output_hidden_states=True).hidden_states[-1]  # after the final norm
        embeds = reference.model.embed_tokens(ids[:, 1:])
        rope = reference.model.rotary_emb(embeds, positions)
        causal = torch.full((11, 11), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive
        hidden = layer(embeds, trunk, rope, causal, positions, None)
        expected = reference.lm_head(hidden)
    assert close(out.final_hidden, trunk)
    assert close(logits, expected)
    assert close(fed_back, hidden)  # what a further draft step reads: post-norm
    assert torch.equal(logits.argmax(-1), expected.argmax(-1))  # the draft tokens


def test_a_multimodal_checkpoint_loads_its_language_model_and_skips_the_vision_tower(tmp_path):
    from safetensors.torch import load_file, save_file

    text = hybrid_folder(tmp_path, "full-first")
    folder = tmp_path / "multimodal"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((text / name).read_bytes())
    config = json.loads((text / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": config,
                                                    "vision_config": {"depth": 1}, "eos_token_id": 257}))
    tensors = {k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k: v
               for k, v in load_file(str(text / "model.safetensors")).items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(folder / "model.safetensors"))
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    models = [load_model(f, dtype="float32").model for f in (text, folder)]
    with torch.inference_mode():
        logits = [model(ids, torch.arange(5).unsqueeze(0), model.new_cache(5)).logits for model in models]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize(("model_type", "words"), [("qwen3_next", "mixture-of-experts")])
def test_moe_variants_are_refused_with_the_reason(model_type, words):
    with pytest.raises(SpecDecodeError, match=words):
        config_from_hf({"model_type": model_type, "vocab_size": 8})


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(tmp_path):
    """bf16 rounds through 4 layers of a random model (logits spread about 17); ours stays within twice the
    distance transformers' own bf16 forward keeps from float32 (measured 1.50 against 1.16)."""
    from transformers import AutoModelForCausalLM

    folder = hybrid_folder(tmp_path, "one-full-in-four")
    ids = torch.randint(0, TINY_VOCAB, (1, 24), generator=torch.Generator().manual_seed(10))
    logits = {}
    with torch.inference_mode():
        for dtype in ("float32", "bfloat16"):
            model = load_model(folder, dtype=dtype).model
            logits[dtype] = model(ids, torch.arange(24).unsqueeze(0), model.new_cache(24)).logits
            reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=getattr(torch, dtype)).eval()
            logits[f"reference {dtype}"] = reference(ids).logits.float()
    ours = (logits["bfloat16"] - logits["float32"]).abs().max()
    theirs = (logits["reference bfloat16"] - logits["reference float32"]).abs().max()
    assert torch.isfinite(logits["bfloat16"]).all() and ours <= 2 * theirs


def test_a_qwen35_draft_model_drafts_chains_for_a_qwen35_target(tmp_path):
    """Both recurrent: the draft rolls its own states back to the committed tokens after every proposal (its
    window covers a proposal and its catch-up); greedy output stays the target's. Its trees are refused."""
    from specdecode import Engine, SamplingParams, SpecConfig

    target = load_model(save_tiny_model(tmp_path / "t", "qwen3_5", scale=0.15), dtype="float32")
    draft = load_model(save_tiny_model(tmp_path / "d", "qwen3_5", scale=0.15, noise=0.01), dtype="float32")
    engine = Engine(target, draft)
    sampling = SamplingParams(max_tokens=32, ignore_eos=True)
    drafted = accepted = 0
    for prompt in ("hello hello hello", "1 2 3 1 2 3 1 2"):
        plain = engine.complete(prompt, sampling, SpecConfig("none")).token_ids
        for k in (1, 4):
            result = engine.complete(prompt, sampling, SpecConfig("draft", num_draft_tokens=k))
            assert result.token_ids == plain
            drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    assert 0 < accepted < drafted
    with pytest.raises(SpecDecodeError, match="drafts chains"):
        engine.complete("hello", sampling, SpecConfig("draft", options={"draft_tree_nodes": 8}))


def test_a_requests_admitted_size_bounds_the_states_its_verify_forwards_hold(tmp_path, monkeypatch):
    """A server admits requests by Engine.request_cache_bytes: for a hybrid target it must count the recurrent
    states kept for each row of a verify forward (a tree's every node), which is where its memory peaks."""
    from specdecode import Engine, SamplingParams, SpecConfig
    from specdecode.models.families.qwen3_5.cache import HybridCache

    engine = Engine(load_model(save_tiny_model(tmp_path / "t", "qwen3_5", scale=0.3), dtype="float32"),
                    load_model(save_tiny_model(tmp_path / "d", "qwen2", scale=0.3), dtype="float32"))
    held = []  # the cache's bytes just before each rollback: every verified row's states still held
    keep = HybridCache.keep

    def recording(cache, start, rows, batch_index=0):
        held.append(cache.nbytes)
        return keep(cache, start, rows, batch_index)

    monkeypatch.setattr(HybridCache, "keep", recording)
    sampling, prompt = SamplingParams(max_tokens=24, ignore_eos=True), "1 2 3 1 2 3 1 2 3 1 2"
    sizes = {}
    for name, spec in {"plain": SpecConfig("none"), "chain": SpecConfig("draft", num_draft_tokens=6, guard=False),
                       "tree": SpecConfig("draft", num_draft_tokens=4, guard=False,
                                          options={"draft_tree_nodes": 16})}.items():
        held.clear()
        admitted = engine.request_cache_bytes(len(engine.encode(prompt)), sampling, spec)
        result = engine.complete(prompt, sampling, spec)
        assert spec.method == "none" or result.stats.drafted_tokens > 0
        assert held == [] or max(held) <= admitted, name
        sizes[name] = admitted
    assert sizes["plain"] < sizes["chain"] < sizes["tree"]
