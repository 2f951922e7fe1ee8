"""The drafter contract, run over every registered drafter (and its tree mode, and a chain of methods), so a
new drafter is held to it the day it registers:

- greedy output equals plain decoding token for token (fp32 target), drafts both accepted and rejected;
- the same, bitwise, on a w4a8 target (its kernels are batch-invariant, so verifying cannot change a bit);
- under the coupled rule, sampled output at a seed equals plain decoding's at that seed, token for token (fp32,
  bf16 and w4a8 targets, alone and in batched steps, with the speed guard and per-step choice on), and a drafter
  that samples draws with the noise of the positions its drafts take (the target as its own draft model: every
  draft accepted);
- sampled output follows the target's distribution (end to end, chi-square at alpha = 1e-4);
- after every step the target's KV cache holds exactly the committed tokens, with the values a fresh prefill
  computes (so a tree's rollback kept the accepted path and nothing else);
- one Engine serves interleaved requests: each output is what it is alone, each request's state goes at finish;
- a prompt read in chunks (as the server reads one between batched steps) decodes as one read whole.

Every test runs over three targets: a Llama-family one (Qwen2), a hybrid one (Qwen 3.5: Gated DeltaNet layers
whose recurrent states roll back) and Gemma 4 (sliding and full layers, KV-shared layers, per-layer embeddings),
each shipping its own MTP (Gemma 4's as an assistant model beside it); the draft model is a Qwen2 (a noisy copy of the
target for Gemma 4; a hybrid draft model is tested in test_hybrid_engine.py: it drafts chains only). The
distribution test runs every configuration on Qwen2 and a subset on the others (SAMPLED, below).
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import pytest
import torch
from batched_runs import run_batched
from conftest import TINY_VOCAB, save_tiny_model, started
from dflash_drafters import write_random_dflash, write_random_dspark
from eagle3_reference import head_config, random_head, write_head
from gemma_reference import SMALL, save_assistant, save_gemma
from hybrid_reference import add_hybrid_mtp
from mtp_reference import add_mtp_layers
from test_engine_distribution import SETTINGS, VOCAB, assert_follows_the_target

from specdecode import Engine, SamplingParams, SpecConfig
from specdecode.acceptance import verify as verify_module
from specdecode.acceptance.noise import PositionNoise
from specdecode.drafters.registry import DRAFTERS
from specdecode.models.kernels.w4a8_linear import w4a8_unavailable
from specdecode.models.loader import load_model

PROMPTS = ["hello hello hello", "abcabcabc abcabc", "The quick brown fox", "1 2 3 1 2 3 1 2"]
MAX_TOKENS = 32


def configurations() -> list[tuple[str, dict]]:
    """(method, options) for every registered drafter, its tree mode where it has one, and a chain of two."""
    configs = []
    for name, cls in DRAFTERS.items():
        configs.append((name, {}))
        if cls.caps.emits_trees:
            configs.append((name, cls.tree_options))
    configs.append(("ngram,draft", {**DRAFTERS["ngram"].tree_options, **DRAFTERS["draft"].tree_options}))
    return configs


CONFIGS = configurations()
IDS = [f"{method}{'-tree' if options else ''}" for method, options in CONFIGS]


def test_every_tree_capable_drafter_says_how_to_make_trees():
    for name, cls in DRAFTERS.items():
        assert bool(cls.tree_options) == cls.caps.emits_trees, name


def eagle3_head(folder, target, vocab: int):
    """A random EAGLE-3 head whose draft vocabulary is the tokens the target emits most on the test prompts,
    as the reference builds its draft vocabulary from the target's outputs (so drafts are sometimes right)."""
    draft_ids = None
    if vocab > 16:
        plain = Engine(target)
        counts = torch.bincount(torch.tensor([t for p in PROMPTS for t in plain.complete(p, greedy()).token_ids]),
                                minlength=vocab)
        draft_ids = sorted(counts.topk(6).indices.tolist())
    weights = random_head(target.config.hidden_size, vocab, draft_ids=draft_ids, scale=0.3)
    layers = target.config.num_layers  # the reference's default ids collide on a 4-layer target: name them
    ids = {} if layers == 3 else {"eagle_aux_hidden_state_layer_ids": [1, layers // 2 + 1, layers]}
    return write_head(folder, weights, head_config(weights, vocab, "reference", **ids), "reference")


def drafter_folders(root, target, vocab: int) -> dict[str, object]:
    """Method -> folder for the drafters with weights of their own: an EAGLE-3 head, a DFlash and a DSpark drafter
    (over a tiny vocabulary random drafts are right by chance; over 272 tokens they lean to the target's
    favourite)."""
    favour = None
    if vocab > 16:
        emitted = [t for p in PROMPTS for t in Engine(target).complete(p, greedy()).token_ids]
        favour = max(set(emitted), key=emitted.count)
    return {"eagle3": eagle3_head(root / "eagle3", target, vocab),
            "dflash": write_random_dflash(root / "dflash", target, scale=0.05, favour=favour),
            "dspark": write_random_dspark(root / "dspark", target, scale=0.05, favour=favour, confidence_bias=0.5)}


# These tests compare drafted counts across runs: per-step choice must not read the machine's clock (conftest).
pytestmark = pytest.mark.usefixtures("frozen_choice_clock")


def target_with_mtp(folder, arch: str, **overrides):
    """A tiny target of `arch` shipping one MTP module that mostly repeats the trunk's prediction."""
    if arch == "qwen3_5":  # at 0.3 its greedy output repeats itself enough for n-grams to be accepted
        add_hybrid_mtp(save_tiny_model(folder, arch, scale=0.3, **overrides), follow=1.0)
    elif arch == "gemma4":  # its assistant beside it, as Google ships them; at 0.2 its output repeats now and then
        save_assistant(folder.parent / f"{folder.name}-assistant", save_gemma(folder, scale=0.2, **overrides),
                       follow=True)
    else:
        add_mtp_layers(save_tiny_model(folder, arch, scale=0.15, **overrides), "deepseek", follow=1.0)
    return folder


@pytest.fixture(scope="module", params=["qwen2", "qwen3_5", "gemma4"])
def pair(request, tmp_path_factory):
    """The target (shipping an MTP module), a noisy Qwen2 as the draft model (for the Qwen2 and Gemma 4 targets a
    noisy copy of it), the target's folder, and the folders of drafters with weights of their own (an EAGLE-3 head,
    a DFlash and a DSpark drafter) for it."""
    root = tmp_path_factory.mktemp(f"contract-{request.param}")
    target = load_model(target_with_mtp(root / "target", request.param), dtype="float32")
    if request.param == "gemma4":  # a noisy copy of it (a Qwen2's drafts it never accepts)
        draft = load_model(save_gemma(root / "draft", scale=0.2, noise=0.01), dtype="float32")
    else:
        draft = load_model(save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01), dtype="float32")
    return target, draft, root / "target", drafter_folders(root, target, TINY_VOCAB)


@pytest.fixture(scope="module")
def engine(pair):
    return Engine(pair[0], pair[1], draft_path=pair[3])


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_greedy_output_equals_plain_decoding(engine, method, options):
    drafted = accepted = 0
    for prompt in PROMPTS:
        plain = engine.complete(prompt, greedy(), SpecConfig("none")).token_ids
        for k in (1, 4):
            result = engine.complete(prompt, greedy(), SpecConfig(method, num_draft_tokens=k, options=options))
            assert result.token_ids == plain, f"{method} {options} k={k} diverged on {prompt!r}"
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
    if method != "none":  # the check only has teeth if drafts were both accepted and rejected
        assert 0 < accepted < drafted


@pytest.fixture(scope="module")
def w4a8_engine(pair):
    reason = w4a8_unavailable()
    if reason is not None:
        pytest.skip(f"w4a8 cannot run on this machine: {reason}")
    return Engine(load_model(pair[2], dtype="bfloat16", quant="w4a8"), pair[1], draft_path=pair[3])


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_w4a8_target_output_is_bitwise_plain_decoding(w4a8_engine, method, options):
    for prompt in PROMPTS[:2]:
        plain = w4a8_engine.complete(prompt, greedy(), SpecConfig("none")).token_ids
        result = w4a8_engine.complete(prompt, greedy(), SpecConfig(method, num_draft_tokens=4, options=options))
        assert result.token_ids == plain, f"{method} {options} diverged on {prompt!r} in bf16 w4a8"


def coupled(seed: int, max_tokens: int = MAX_TOKENS) -> SamplingParams:
    """Sampling with the coupled rule's noise (the spec names the rule): peaked enough at 0.7 and top-k 40 for the
    tiny models' drafts to be accepted now and then."""
    return SamplingParams(temperature=0.7, top_k=40, max_tokens=max_tokens, seed=seed, ignore_eos=True)


def coupled_spec(method: str, options: dict, k: int) -> SpecConfig:
    """The guard on and per-step choice for a combination: timing may change every draft, never the output."""
    return SpecConfig(method, num_draft_tokens=k, options=options, combine="best", verification="coupled")


# engine -> (prompt, seed) -> plain output. Keyed by the engine itself, held weakly: an id would be reused by the
# next family's engine once this one is freed, and hand it another model's tokens.
PLAIN_SAMPLED: WeakKeyDictionary[Engine, dict[tuple[str, int], list[int]]] = WeakKeyDictionary()


def plain_sampled(engine: Engine, prompt: str, seed: int) -> list[int]:
    """Plain decoding of `prompt` at `seed` under the coupled rule, once per engine (every configuration compares)."""
    known = PLAIN_SAMPLED.setdefault(engine, {})
    if (prompt, seed) not in known:
        known[prompt, seed] = engine.complete(prompt, coupled(seed), coupled_spec("none", {}, 1)).token_ids
    return known[prompt, seed]


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_coupled_sampled_output_equals_plain_decoding_at_the_same_seed(engine, method, options):
    drafted = accepted = 0
    for seed, prompt in enumerate(PROMPTS[:2]):
        for k in (1, 4):
            result = engine.complete(prompt, coupled(seed), coupled_spec(method, options, k))
            assert result.token_ids == plain_sampled(engine, prompt, seed), f"{method} {options} k={k} on {prompt!r}"
            drafted += result.stats.drafted_tokens
            accepted += result.stats.accepted_tokens
    # Drafts were verified. How many of the tiny models' sampled drafts are accepted varies (on Qwen2 most methods
    # see both outcomes, a few none); the next test shows that a rule keeping a wrong draft is caught.
    assert method == "none" or drafted > 0


def test_a_coupled_rule_keeping_a_draft_that_differs_is_caught(engine, monkeypatch):
    """The identity above has teeth: a coupled walk that also keeps a first draft the target's Gumbel-max token
    differs from makes the draft model's output leave plain decoding's."""
    real_walk = verify_module.coupled_walk

    def keeping_first_drafts(proposal, children, p, noise, relaxed_keeps=None):
        return real_walk(proposal, children, p, noise, [node == 0 for node in range(proposal.size)])

    monkeypatch.setattr(verify_module, "coupled_walk", keeping_first_drafts)
    results = [engine.complete(prompt, coupled(seed), coupled_spec("draft", {}, 3)).token_ids
               for seed, prompt in enumerate(PROMPTS[:2])]
    assert results != [plain_sampled(engine, prompt, seed) for seed, prompt in enumerate(PROMPTS[:2])]


SAMPLING_DRAFTERS = [name for name, cls in DRAFTERS.items() if cls.caps.emits_probs]


@pytest.mark.parametrize("method", SAMPLING_DRAFTERS)
def test_a_sampling_drafter_draws_with_the_noise_of_the_positions_it_drafts_for(engine, monkeypatch, method):
    """Identity holds whatever is drafted, so it cannot see a drafter drawing with another position's noise (only
    its acceptance would fall): each step, the rows a drafter asks for are those of the positions its drafts take,
    in order, and the step's verification then asks for the root's and every node's."""
    asked: list[list[int]] = []
    rows = PositionNoise.rows
    monkeypatch.setattr(PositionNoise, "rows", lambda noise, positions: asked.append(list(positions)) or rows(
        noise, positions))
    seq = started(engine, engine.encode(PROMPTS[0]), coupled(0), coupled_spec(method, {}, 4))
    drafted = 0
    try:
        while seq.generated < MAX_TOKENS:
            asked.clear()
            length = len(seq.tokens)
            engine.step(seq)
            *drawn, verified = asked
            nodes = len(verified) - 1  # a chain: the root's row and one per node
            assert verified == list(range(length, length + nodes + 1))
            assert [p for positions in drawn for p in positions] == list(range(length, length + nodes))
            drafted += nodes
    finally:
        engine.finish(seq)
    assert drafted > 0


def test_the_target_as_its_own_draft_model_has_every_coupled_draft_accepted(pair):
    """The same law and the same noise make the same token: a draft model that is the target drafts exactly the
    target's coupled tokens."""
    engine = Engine(pair[0], pair[0])
    result = engine.complete(PROMPTS[1], coupled(4), coupled_spec("draft", {}, 4))
    assert result.stats.drafted_tokens > 0 and result.stats.accepted_tokens == result.stats.drafted_tokens


@pytest.fixture(scope="module")
def bf16_engine(pair):
    return Engine(load_model(pair[2], dtype="bfloat16"), pair[1], draft_path=pair[3])


@pytest.mark.parametrize("precision", ["bf16", "w4a8"])
@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_coupled_sampled_output_equals_plain_decoding_in_bf16_and_w4a8(pair, request, precision, method, options):
    engine = request.getfixturevalue(f"{precision}_engine")  # the pair's target in that precision
    result = engine.complete(PROMPTS[2], coupled(7), coupled_spec(method, options, 4))
    assert result.token_ids == plain_sampled(engine, PROMPTS[2], 7), f"{method} {options} in {precision}"


@pytest.fixture(scope="module")
def small_vocab_engine(request, tmp_path_factory):
    """An engine over a vocabulary of VOCAB tokens, its target of the architecture request.param names."""
    root = tmp_path_factory.mktemp(f"contract-vocab8-{request.param}")
    if request.param == "qwen3_5":
        add_hybrid_mtp(save_tiny_model(root / "t", "qwen3_5", scale=0.6, vocab_size=VOCAB), follow=1.0)
    elif request.param == "gemma4":  # small weights: the embedding scale and soft cap make larger ones peaked
        target = save_gemma(root / "t", scale=0.12, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
                            bos_token_id=0, eos_token_id=1, **SMALL)
        save_assistant(root / "t-assistant", target, centroids=4, follow=True)
    else:
        add_mtp_layers(save_tiny_model(root / "t", "qwen2", scale=0.6, vocab_size=VOCAB), "mimo", follow=1.0)
    target = load_model(root / "t", dtype="float32")
    draft = load_model(save_tiny_model(root / "d", "qwen2", scale=0.6, noise=0.2, vocab_size=VOCAB), dtype="float32")
    return Engine(target, draft, draft_path=drafter_folders(root, target, VOCAB))


# The distribution test runs every drafter on qwen2, each as a chain and as a tree, but for the lookups, which
# draft deterministically (a one-hot q) and so meet one verification path: it runs their trees once (suffix).
# Plain sampling ('none') is test_engine_distribution.py's. On the other architectures it runs what reaches what
# is theirs: a tree's rollback of the hybrid's recurrent state and of Gemma 4's shared-KV layers under sampled
# drafts, and their own drafter (the hybrid's MTP layers, Gemma's assistant, drafting chains). The other drafters'
# proposals meet the same verification there, which greedy identity and the KV-cache test check for every
# configuration on every architecture. Their full product was 14 minutes of the suite.
OTHER_ARCHITECTURES = ("qwen3_5", "gemma4")
SAMPLED_ON_EVERY_ARCHITECTURE = ("draft-tree", "mtp")
LOOKUP_TREES_SAMPLED_ELSEWHERE = ("ngram-tree", "recycle-tree")  # suffix-tree stands for them
SAMPLED = [pytest.param("qwen2", method, options, id=f"qwen2-{name}") for (method, options), name in zip(CONFIGS, IDS)
           if name != "none" and name not in LOOKUP_TREES_SAMPLED_ELSEWHERE]
SAMPLED += [pytest.param(arch, method, options, id=f"{arch}-{name}") for arch in OTHER_ARCHITECTURES
            for (method, options), name in zip(CONFIGS, IDS) if name in SAMPLED_ON_EVERY_ARCHITECTURE]


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize(("small_vocab_engine", "method", "options"), SAMPLED, indirect=["small_vocab_engine"])
def test_sampled_output_follows_the_target_distribution(small_vocab_engine, method, options):
    """Rejection sampling against each drafter's own q (block verification for its chains): the coupled rule's law
    is plain decoding's by the identity tests above, and test_engine_distribution.py checks plain decoding's."""
    spec = SpecConfig(method, num_draft_tokens=2, adaptive=False, options=options, verification="block")
    assert_follows_the_target(small_vocab_engine, SETTINGS["temperature"], spec)


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_the_kv_cache_holds_exactly_the_committed_tokens(engine, method, options):
    model = engine.target.model
    seq = started(engine, engine.encode(PROMPTS[3]), greedy(), SpecConfig(method, num_draft_tokens=4, options=options))
    try:
        while seq.generated < MAX_TOKENS:
            assert seq.cache.lengths == [len(seq.tokens) - 1]
            engine.step(seq)
        committed = len(seq.tokens) - 1
        assert seq.cache.lengths == [committed]
        fresh = model.new_cache(committed)
        with torch.inference_mode():
            model(torch.tensor([seq.tokens[:-1]]), torch.arange(committed).unsqueeze(0), fresh)
        assert torch.equal(seq.cache.positions[0, :committed], torch.arange(committed))
        # A hybrid trunk's keys went through its recurrent layers, whose one-forward read sums in another order.
        tolerance = {"atol": 1e-4, "rtol": 1e-4} if model.config.recurrent_layers else {"atol": 1e-5}
        for ours, reference in ((seq.cache.keys, fresh.keys), (seq.cache.values, fresh.values)):
            assert torch.allclose(ours[:, :, :, :committed], reference, **tolerance)
        if model.config.recurrent_layers:  # and the recurrent states are those of the committed tokens
            ours, reference = seq.cache.state(), fresh.state()
            for a, b in zip(ours.conv + ours.ssm, reference.conv + reference.ssm):
                assert torch.allclose(a, b, **tolerance)
    finally:
        engine.finish(seq)


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_one_engine_serves_interleaved_requests(engine, method, options):
    spec = SpecConfig(method, num_draft_tokens=3, options=options)
    alone = {p: engine.complete(p, greedy(), spec).token_ids for p in PROMPTS[:2]}
    drafter = engine.drafter(spec)
    assert engine.drafter(SpecConfig(method, num_draft_tokens=3, options=options)) is drafter  # created once
    requests = [started(engine, engine.encode(p), greedy(), spec) for p in PROMPTS[:2]]
    while any(seq.generated < MAX_TOKENS for seq in requests):
        for seq in requests:
            if seq.generated < MAX_TOKENS:
                engine.step(seq)
    for prompt, seq in zip(PROMPTS[:2], requests):
        assert seq.tokens[seq.prompt_len:][:MAX_TOKENS] == alone[prompt]
        engine.finish(seq)
        assert not seq.drafter_state, "finish must drop the request's drafter state"


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_batched_steps_on_a_w4a8_target_equal_each_request_alone(w4a8_engine, monkeypatch, method, options):
    """Requests verified together in one forward (as the server batches them), joining and leaving mid-batch,
    next to plain requests and requests of another method: each output is bitwise what it is alone, and a coupled
    sampled one's is plain decoding's at its seed. The load budget is held open (every sequence drafts what it
    asks), so that drafts are verified in batches."""
    monkeypatch.setattr(w4a8_engine.load_budget, "draft_cap", lambda seqs, wanted: max(wanted))
    spec = SpecConfig(method, num_draft_tokens=3, options=options)
    # recycle drafts from the first steps on, whatever the text (the hybrid target's seldom repeats n-grams)
    others = [SpecConfig("none"), SpecConfig("recycle", num_draft_tokens=2)]
    requests = [(p, greedy(8 + 6 * i), spec) for i, p in enumerate(PROMPTS)]
    requests += [(p, greedy(12), others[i % 2]) for i, p in enumerate(PROMPTS[:2])]
    requests += [(p, coupled(7, 16), coupled_spec(method, options, 3)) for p in PROMPTS[2:]]
    alone = [w4a8_engine.complete(*request).token_ids for request in requests]
    batched, shapes = run_batched(w4a8_engine, requests)
    assert batched == alone
    assert batched[-2:] == [plain_sampled(w4a8_engine, p, 7)[:16] for p in PROMPTS[2:]]
    assert any(batch > 1 and rows > 1 for batch, rows in shapes), "no batch verified a draft"


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_a_prompt_read_in_chunks_decodes_as_one_read_whole(pair, w4a8_engine, method, options):
    """The server reads an arriving prompt a few tokens at a time between batched steps (prefill.py): the
    drafter starts on the whole prompt's hidden states, so it drafts the same tokens and the output is bitwise
    the same (w4a8 target; each run in a fresh Engine, as suffix decoding learns across requests; no speed
    guard, whose clock would make the drafts differ)."""
    spec = SpecConfig(method, num_draft_tokens=3, options=options, guard=False)

    def decoded(ids: list[int], chunk: int | None) -> tuple[int, list[int], int, int]:
        engine = Engine(w4a8_engine.target, w4a8_engine.draft, draft_path=pair[3])
        seq = engine.begin(ids, greedy(16), spec, chunk)
        reads = 1
        while engine.prefill(seq) is None:
            reads += 1
        while seq.generated < 16:
            engine.step(seq)
        engine.finish(seq)
        return reads, seq.tokens[seq.prompt_len:][:16], seq.stats.drafted_tokens, seq.stats.accepted_tokens

    for prompt in PROMPTS[:2]:
        ids = w4a8_engine.encode(prompt)
        whole, chunked = decoded(ids, None), decoded(ids, 3)
        assert whole[0] == 1 and chunked[0] == -(-len(ids) // 3) > 1
        assert chunked[1:] == whole[1:], f"{method} {options} on {prompt!r}"


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_a_prompt_taken_from_the_prefix_cache_decodes_as_one_read_whole(pair, w4a8_engine, method, options):
    """A chat's second turn begins with its first turn and answer: the prefix cache (prefix_cache.py) gives it
    those rows' keys and values, and their hidden states to a drafter that reads them, so it drafts the
    same tokens and the output is bitwise the same (w4a8 target; fresh engines, both given the first turn); a
    coupled sampled answer from the cached prefix is plain decoding's at its seed."""
    spec = SpecConfig(method, num_draft_tokens=3, options=options, guard=False)
    first_turn = w4a8_engine.encode(PROMPTS[0])

    def decoded(engine: Engine, ids: list[int]) -> tuple[list[int], int, int, int]:
        seq = started(engine, ids, greedy(12), spec)
        while seq.generated < 12:
            engine.step(seq)
        engine.finish(seq)
        stats = seq.stats
        return seq.tokens[seq.prompt_len:][:12], stats.drafted_tokens, stats.accepted_tokens, stats.cached_prompt_tokens

    def fresh(prefix_cache_bytes: int = 0) -> Engine:
        return Engine(w4a8_engine.target, w4a8_engine.draft, draft_path=pair[3], prefix_cache_bytes=prefix_cache_bytes)

    cached, uncached = fresh(2**24), fresh()  # both run the first turn: suffix decoding learns from it
    answer = decoded(cached, first_turn)[0]
    assert decoded(uncached, first_turn)[0] == answer
    second_turn = first_turn + answer + w4a8_engine.encode(PROMPTS[1], raw=True)
    reused, whole = decoded(cached, second_turn), decoded(uncached, second_turn)
    assert reused[3] == len(first_turn) + len(answer) - 1  # all but the answer's last token, which was never read
    assert whole[3] == 0
    assert reused[:3] == whole[:3], f"{method} {options}"
    # A third turn sampled by the coupled rule from the cached second turn and answer: plain decoding's tokens at the
    # seed, read whole.
    third_turn = second_turn + reused[0] + w4a8_engine.encode(PROMPTS[2], raw=True)
    sampled = cached.complete(third_turn, coupled(3, 12), coupled_spec(method, options, 3))
    assert sampled.stats.cached_prompt_tokens == len(second_turn) + len(reused[0]) - 1
    assert sampled.token_ids == uncached.complete(third_turn, coupled(3, 12), coupled_spec("none", {}, 1)).token_ids
