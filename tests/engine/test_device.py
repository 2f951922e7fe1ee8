"""The drafter contract on each device the engine can run on: CUDA in float32 and bfloat16 where a GPU is present
(skipped with the reason elsewhere), and the CPU in float32, which keeps these tests' own logic exercised on
every machine (tests/drafters/test_drafter_contract.py is the CPU's full contract).

On each device, for every registered drafter, its tree mode and a chain of two: greedy output equal to plain
decoding on that device, token for token, alone and batched; a chat's second turn taken from the prefix cache
decoding as one read whole; and sampled output following the target's law (chi-square), for every drafter on
CUDA and for the draft model on the CPU.

Greedy identity needs the verify forward of k + 1 rows to give each row the logits a one-row forward gives, or at
least the same argmax. The CPU's float path gets that from its fixed-order layers; on CUDA the matmuls and
attention are PyTorch's own, whose kernels may change with the row count. docs/benchmarks/gpu_check.py measures
how far such rows differ (its "row invariance" table) on the default target's shape.

    bash docs/benchmarks/gpu_check.sh   # on a machine with a GPU: these tests, then the measurements
"""

from __future__ import annotations

import pytest
import torch
from batched_runs import run_batched
from conftest import TINY_VOCAB, save_tiny_model, started
from hybrid_reference import add_hybrid_mtp
from mtp_reference import add_mtp_layers
from test_drafter_contract import CONFIGS, IDS, PROMPTS, drafter_folders, greedy, target_with_mtp
from test_engine_distribution import SETTINGS, VOCAB, assert_follows_the_target

from specdecode import Engine, SpecConfig
from specdecode.models.loader import load_model

NO_GPU = "no CUDA device here: these checks run on a machine with a GPU (docs/benchmarks/gpu_check.sh)"
CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)]
SETUPS = [pytest.param(("cpu", "float32"), id="cpu-float32"),
          pytest.param(("cuda", "float32"), id="cuda-float32", marks=CUDA),
          pytest.param(("cuda", "bfloat16"), id="cuda-bfloat16", marks=CUDA)]
TOKENS = 24


pytestmark = pytest.mark.usefixtures("frozen_choice_clock")  # drafted counts never depend on the machine's load


@pytest.fixture(scope="module", params=SETUPS)
def device_engine(request, tmp_path_factory):
    """An engine on the device: a Qwen2 target shipping an MTP module, a noisy copy as the draft model, and
    EAGLE-3, DFlash and DSpark drafters for it (built against the float32 CPU target, loaded by the engine)."""
    device, dtype = request.param
    root = tmp_path_factory.mktemp(f"device-{device}-{dtype}")
    folder = target_with_mtp(root / "target", "qwen2")
    draft_folder = save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01)
    folders = drafter_folders(root, load_model(folder, dtype="float32"), TINY_VOCAB)
    target = load_model(folder, dtype=dtype, device=device, quant="none")
    draft = load_model(draft_folder, dtype=dtype, device=device, quant="none")
    return Engine(target, draft, draft_path=folders)


def on_device(engine: Engine) -> str:
    return engine.target.model.device.type


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_greedy_output_equals_plain_decoding_on_the_device(device_engine, method, options):
    drafted = 0
    for prompt in PROMPTS[:2]:
        plain = device_engine.complete(prompt, greedy(TOKENS), SpecConfig("none")).token_ids
        result = device_engine.complete(prompt, greedy(TOKENS),
                                        SpecConfig(method, num_draft_tokens=4, options=options))
        assert result.token_ids == plain, f"{method} {options} diverged on {on_device(device_engine)}: {prompt!r}"
        drafted += result.stats.drafted_tokens
    assert method == "none" or drafted > 0, "nothing was drafted: the check says nothing about speculation"


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_batched_requests_decode_as_each_alone_on_the_device(device_engine, method, options):
    spec = SpecConfig(method, num_draft_tokens=3, options=options)
    requests = [(prompt, greedy(TOKENS), spec) for prompt in PROMPTS]
    alone = [device_engine.complete(*request).token_ids for request in requests]
    batched, shapes = run_batched(device_engine, requests)
    assert batched == alone, f"{method} {options} batched differs on {on_device(device_engine)}"
    assert any(shape[0] > 1 for shape in shapes), "no forward was shared: the check says nothing about batches"


@pytest.mark.parametrize(("method", "options"), CONFIGS, ids=IDS)
def test_the_prefix_cache_on_the_device(device_engine, method, options):
    """A chat's second turn whose first turn and answer come from the prefix cache decodes as read whole."""
    spec = SpecConfig(method, num_draft_tokens=3, options=options, guard=False)
    first_turn = device_engine.encode(PROMPTS[0])

    def decoded(engine: Engine, ids: list[int]) -> tuple[list[int], int]:
        seq = started(engine, ids, greedy(12), spec)
        while seq.generated < 12:
            engine.step(seq)
        engine.finish(seq)
        return seq.tokens[seq.prompt_len:][:12], seq.stats.cached_prompt_tokens

    def fresh(prefix_cache_bytes: int = 0) -> Engine:
        return Engine(device_engine.target, device_engine.draft, draft_path=device_engine.resources.draft_path,
                      prefix_cache_bytes=prefix_cache_bytes)

    cached, uncached = fresh(2**24), fresh()
    answer = decoded(cached, first_turn)[0]
    assert decoded(uncached, first_turn)[0] == answer
    second_turn = first_turn + answer + device_engine.encode(PROMPTS[1], raw=True)
    reused, whole = decoded(cached, second_turn), decoded(uncached, second_turn)
    assert reused[1] == len(first_turn) + len(answer) - 1 and whole[1] == 0
    assert reused[0] == whole[0], f"{method} {options} on {on_device(device_engine)}"


DISTRIBUTION_SETUPS = [pytest.param(("cpu", "float32", "draft"), id="cpu-float32-draft")] + [
    pytest.param(("cuda", dtype, method), id=f"cuda-{dtype}-{method}", marks=CUDA)
    for dtype in ("float32", "bfloat16") for method in ("draft", "ngram", "mtp", "eagle3", "dflash", "recycle")]


@pytest.fixture(scope="module")
def small_vocab_folders(tmp_path_factory):
    """An 8-token target shipping MTP, a noisy draft model, and the drafters with weights of their own."""
    root = tmp_path_factory.mktemp("device-vocab8")
    add_mtp_layers(save_tiny_model(root / "t", "qwen2", scale=0.6, vocab_size=VOCAB), "mimo", follow=1.0)
    save_tiny_model(root / "d", "qwen2", scale=0.6, noise=0.2, vocab_size=VOCAB)
    return root, drafter_folders(root, load_model(root / "t", dtype="float32"), VOCAB)


@pytest.mark.usefixtures("single_thread")
@pytest.mark.parametrize("setup", DISTRIBUTION_SETUPS)
def test_sampled_output_follows_the_target_distribution_on_the_device(small_vocab_folders, setup):
    device, dtype, method = setup
    root, folders = small_vocab_folders
    target = load_model(root / "t", dtype=dtype, device=device, quant="none")
    draft = load_model(root / "d", dtype=dtype, device=device, quant="none")
    engine = Engine(target, draft, draft_path=folders)
    # Against the law of this very model, in its dtype on its device.
    assert_follows_the_target(engine, SETTINGS["temperature"], SpecConfig(method, num_draft_tokens=2, adaptive=False))


@pytest.mark.parametrize("setup", SETUPS[1:])
def test_a_hybrid_target_speculates_on_the_device(tmp_path, setup):
    """Qwen 3.5's recurrent states roll back on the device as on the CPU: MTP and n-gram chains, n-gram trees."""
    device, dtype = setup
    add_hybrid_mtp(save_tiny_model(tmp_path / "t", "qwen3_5", scale=0.3), follow=1.0)
    engine = Engine(load_model(tmp_path / "t", dtype=dtype, device=device, quant="none"))
    for method, options in (("mtp", {}), ("ngram", {}), ("ngram", {"ngram_branches": 3})):
        for prompt in PROMPTS[:2]:
            plain = engine.complete(prompt, greedy(TOKENS), SpecConfig("none")).token_ids
            result = engine.complete(prompt, greedy(TOKENS), SpecConfig(method, num_draft_tokens=3, options=options))
            assert result.token_ids == plain, f"{method} {options} diverged on a hybrid target on {device}"
