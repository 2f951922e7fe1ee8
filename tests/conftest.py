"""Tiny models built in the test session: random Llama-family configs saved as real Hugging Face folders."""

from __future__ import annotations

import json
import math
import os
import random
import sys
import time
import zlib
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent  # tests/, its folders mirroring the package's
ROOT = TESTS.parent  # the repository
FIXTURES_ROOT = TESTS / "fixtures"  # committed fixtures and the scripts that made them
USER_CACHE = os.environ.get("SPECDECODE_CACHE")  # as the suite found it
TINY_VOCAB = 272  # 256 byte tokens + specials, padded like real checkpoints pad their embedding
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_CONFIGS = {
    "llama": dict(model_type="llama", rope_theta=10000.0, attention_bias=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "mistral": dict(model_type="mistral", rope_theta=10000.0, sliding_window=24),
    "qwen2": dict(model_type="qwen2", rope_theta=1000000.0, use_sliding_window=False),
    "qwen3": dict(model_type="qwen3", rope_theta=1000000.0, head_dim=24, attention_bias=False),
    # Qwen 3.5's hybrid trunk: Gated DeltaNet layers with one gated full-attention layer between them
    "qwen3_5": dict(model_type="qwen3_5_text", head_dim=32, num_hidden_layers=4,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}
# Mixtures of experts, tested in their own files (test_moe.py, test_glm_moe.py, test_moe_contract.py): in bf16 a
# token may route to other experts than in float32, which the dense families' closeness checks do not allow for
MOE_CONFIGS = {
    # Qwen3-MoE: 8 experts of width 32, 2 per token; the second layer kept dense (mlp_only_layers)
    "qwen3_moe": dict(model_type="qwen3_moe", rope_theta=1000000.0, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[1],
                      experts_implementation="eager"),
    # GLM-4.5: biases on q, k and v, q/k norms, rope on half of each head, the first layer dense, 8 experts (2 per
    # token) routed by sigmoid scores with a correction bias, scaled, and one shared expert
    "glm4_moe": dict(model_type="glm4_moe", head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1, use_qk_norm=True,
                     attention_bias=True, routed_scaling_factor=1.5, num_nextn_predict_layers=0,
                     experts_implementation="eager"),
    # Qwen 3.5 MoE: the hybrid trunk's layers, each MLP 8 experts (2 per token) and a gated shared expert
    "qwen3_5_moe": dict(model_type="qwen3_5_moe_text", head_dim=32, num_hidden_layers=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=8, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=48,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                        experts_implementation="eager"),
    # DeepSeek-V3: latent attention (a 32-wide latent and a 16-wide rotary key, so 48 a cached row) with YaRN,
    # 8 experts in 2 groups of which 1 is kept, 2 per token, one shared, the first layer dense
    "deepseek_v3": dict(model_type="deepseek_v3", num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=24, head_dim=16, n_routed_experts=8,
                        num_experts_per_tok=2, n_group=2, topk_group=1, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 128, "mscale": 1.0,
                                         "mscale_all_dim": 1.0},
                        experts_implementation="eager"),
    # GLM-4.7-Flash: the same trunk with a plain q_proj, no groups, the dense layers named per layer
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                          qk_nope_head_dim=24, qk_rope_head_dim=16, v_head_dim=16, n_routed_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                          routed_scaling_factor=1.8, mlp_layer_types=["dense", "sparse", "sparse"],
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                          experts_implementation="eager"),
}


def tiny_hf_config(arch: str, **overrides):
    from transformers import AutoConfig

    base = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                tie_word_embeddings=False, bos_token_id=256, eos_token_id=257)
    spec = {**base, **(TINY_CONFIGS | MOE_CONFIGS)[arch], **overrides}
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def byte_tokenizer():
    """A real byte-level BPE tokenizer with no merges: every byte is a token, plus chat specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>",
                                        eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(folder: Path, arch: str, seed: int = 0, noise: float = 0.0, scale: float = 0.3,
                    **overrides) -> Path:
    """A random model of `arch` saved as config.json + model.safetensors + tokenizer files.

    `noise` perturbs every weight of the seed's model: a noisy copy makes a draft that agrees with the target
    often but not always, which is what exercises acceptance and rollback.
    """
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, scale) if param.dim() > 1 else param.uniform_(0.8, 1.2)
        if noise:
            generator = torch.Generator().manual_seed(seed + 1000)
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * noise)
    model.save_pretrained(str(folder), safe_serialization=True)
    byte_tokenizer().save_pretrained(str(folder))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [257]}))
    return folder


def linear_weight(layer: torch.nn.Module) -> torch.Tensor:
    """A float model's linear weight [N, K] float32, whatever its storage (a layer packed for oneDNN keeps no
    readable `.weight`): read off its outputs on the identity, which is exact."""
    from specdecode.training.from_target import dense_weight

    dtype = layer.packed_weight.dtype if hasattr(layer, "packed_weight") else layer.weight.dtype
    return dense_weight(layer, layer.in_features, dtype, torch.device("cpu"))[0]


@pytest.fixture(scope="module", autouse=True)
def module_cache(request, tmp_path_factory):
    """Module-scoped fixtures are built before any test's own cache (below): tiny models they convert or
    quantize go to a cache of the module's, never the user's (modules marked real_model keep the shared one)."""
    if request.node.get_closest_marker("real_model") is not None:
        yield None
        return
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("module-cache")
        patch.setenv("SPECDECODE_CACHE", str(path))
        yield path


@pytest.fixture(autouse=True)
def cache(request, tmp_path, monkeypatch) -> Path | None:
    """Tiny models' conversions and quantized copies go to a per-test cache, never the user's; real-model tests
    keep the shared one, so the default models are assembled once."""
    if request.node.get_closest_marker("real_model") is not None:
        # The user's cache, where the default models are assembled once (the module's may have replaced it).
        if USER_CACHE is None:
            monkeypatch.delenv("SPECDECODE_CACHE", raising=False)
        else:
            monkeypatch.setenv("SPECDECODE_CACHE", USER_CACHE)
        return None
    path = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(path))
    return path


@pytest.fixture
def frozen_choice_clock(monkeypatch):
    """Per-step choice (`auto`, combine="best") ranks members by measured costs: a clock that never moves makes
    every cost zero, so which member drafts is decided by the estimates of acceptance alone, the same on a busy
    machine as on a quiet one (for tests that compare drafted counts; the choice is test_step_choice.py's)."""
    from specdecode.drafters.combination import CombinationDrafter

    monkeypatch.setattr(CombinationDrafter, "clock", staticmethod(FakeClock()))


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> folder of a tiny random model, built once per session."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: save_tiny_model(root / arch, arch) for arch in TINY_CONFIGS}


@pytest.fixture(scope="session")
def noisy_pair(tmp_path_factory):
    """A tiny float32 target and a noisy copy of it as the draft: they agree often but not always."""
    from specdecode.models.loader import load_model

    root = tmp_path_factory.mktemp("pair")
    target = load_model(save_tiny_model(root / "target", "qwen2", scale=0.15), dtype="float32")
    draft = load_model(save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01), dtype="float32")
    return target, draft


def started(engine, prompt_ids: list[int], sampling=None, spec=None):
    """A request begun and its prompt read whole (first token sampled, drafter started): what a test steps."""
    request = engine.begin(prompt_ids, sampling, spec)
    engine.prefill(request)
    return request


class FakeClock:
    """A clock tests move by hand (the engine's and a chain's timings, scripted)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TickingClock(FakeClock):
    """A clock that moves `tick` seconds each time it is read: every measured interval is a count of reads, so
    estimates built on it (a chain's per-step choice) are the same on a busy machine as on a quiet one."""

    def __init__(self, tick: float = 0.001):
        super().__init__()
        self.tick = tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


@pytest.fixture(scope="module")
def single_thread():
    """One torch thread for modules making thousands of calls on tiny tensors.

    CPU softmax opens an OpenMP region on every call, and on a busy machine waking the second thread costs
    far more than the work (measured: 1.2 s vs 96 s for 10k trials).
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Tree attention mask [1, N, N] from parent indices (-1 = root): a node sees itself and its ancestors."""
    tree = torch.zeros(1, len(parents), len(parents), dtype=torch.bool)
    for node in range(len(parents)):
        ancestor = node
        while ancestor != -1:
            tree[0, node, ancestor] = True
            ancestor = parents[ancestor]
    return tree


class JitterClock:
    """A monotonic clock whose every interval is the real one stretched or shrunk by a random factor
    (log-uniform in [1/25, 25]): what a machine under arbitrary, changing load looks like to code that times
    itself. With SPECDECODE_TEST_CLOCK=jitter the whole suite runs on it (docs/development.md), so a test whose
    assertion depends on measured time fails every run instead of on a busy day."""

    def __init__(self, seed: int) -> None:
        self.real = time.perf_counter
        self.random = random.Random(seed)
        self.last_real = self.real()
        self.now = self.last_real

    def __call__(self) -> float:
        real = self.real()
        self.now += (real - self.last_real) * math.exp(self.random.uniform(-math.log(25), math.log(25)))
        self.last_real = real
        return self.now


@pytest.fixture(autouse=True)
def jitter_clock(request, monkeypatch):
    """Under SPECDECODE_TEST_CLOCK=jitter, every perf_counter the package reads to measure costs (however
    imported) is a JitterClock; otherwise nothing changes. Deadlines (time.monotonic) keep real time: a
    timeout is a test's own subject, and stretching it would only fail tests on purpose."""
    if os.environ.get("SPECDECODE_TEST_CLOCK") != "jitter":
        yield None
        return
    clock = JitterClock(zlib.crc32(request.node.nodeid.encode()))
    real = time.perf_counter
    for name, module in list(sys.modules.items()):
        if name.startswith("specdecode") and getattr(module, "perf_counter", None) is real:
            monkeypatch.setattr(module, "perf_counter", clock)
    monkeypatch.setattr(time, "perf_counter", clock)
    from specdecode.drafters.combination import CombinationDrafter

    monkeypatch.setattr(CombinationDrafter, "clock", staticmethod(clock))
    yield clock
