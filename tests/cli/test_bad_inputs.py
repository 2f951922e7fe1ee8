"""Every bad input the Python API and the loaders meet ends in one SpecDecodeError that says what is wrong."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from conftest import save_tiny_model

from specdecode import Engine, SamplingParams, SpecConfig, SpecDecodeError
from specdecode.models.loader import load_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    target = load_model(save_tiny_model(root / "target", "qwen2", scale=0.15), dtype="float32")
    draft = load_model(save_tiny_model(root / "draft", "qwen2", scale=0.15, noise=0.01), dtype="float32")
    return target, draft


@pytest.fixture(scope="module")
def engine(pair):
    return Engine(*pair, SpecConfig("ngram,draft"))


def copy_of(folder, tmp_path, *, without: tuple[str, ...] = ()) -> object:
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(*without))
    return copy


def edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | changes))


@pytest.mark.parametrize("prompt", ["a\ud800b", "\udcff\udcfe bad", [{"role": "user", "content": "x\udfffy"}]],
                         ids=["surrogate", "surrogate-escaped-bytes", "chat"])
@pytest.mark.parametrize("raw", [False, True])
def test_lone_surrogate_is_a_clear_error(engine, prompt, raw):
    with pytest.raises(SpecDecodeError, match="not valid Unicode text.*lone surrogate"):
        engine.complete(prompt, SamplingParams(max_tokens=2), raw=raw)


@pytest.mark.parametrize("prompt, message", [
    (3.5, "not float"), (None, "not NoneType"), ([1.5, 2], "must be integers"), ([True], "must be integers"),
    ([-1], r"in \[0, 272\)"), ([272], r"in \[0, 272\)"), ([{"content": "x"}], "string 'role'"), ([], "empty"),
])
def test_prompt_of_the_wrong_kind_is_a_clear_error(engine, prompt, message):
    with pytest.raises(SpecDecodeError, match=message):
        engine.complete(prompt, SamplingParams(max_tokens=2))


@pytest.mark.parametrize("top_p", [5e-324, 1e-50])
@pytest.mark.parametrize("method", ["none", "ngram,draft", "draft"])
def test_top_p_that_rounds_to_zero_samples_like_greedy(engine, top_p, method):
    greedy = engine.complete("hello hello", SamplingParams(max_tokens=12, ignore_eos=True), SpecConfig(method))
    sampled = engine.complete("hello hello", SamplingParams(temperature=1.0, top_p=top_p, seed=3, max_tokens=12,
                                                            ignore_eos=True), SpecConfig(method))
    assert sampled.token_ids == greedy.token_ids


@pytest.mark.parametrize("fields, message", [
    ({"temperature": "hot"}, "temperature must be a number"), ({"top_k": 1.5}, "top_k must be an int"),
    ({"seed": "1"}, "seed must be an int or None"), ({"stop": [1]}, "stop must be a string or a list"),
    ({"ignore_eos": 1}, "ignore_eos must be a bool"), ({"logprobs": 21}, "between 0 and 20"),
    ({"max_tokens": True}, "max_tokens must be an int"), ({"top_p": float("nan")}, "top_p must be in"),
])
def test_sampling_params_of_the_wrong_type_or_range(fields, message):
    with pytest.raises(SpecDecodeError, match=message):
        SamplingParams(**fields)


def test_spec_config_of_the_wrong_type():
    with pytest.raises(SpecDecodeError, match="SpecConfig takes"):
        SpecConfig(["ngram"])
    with pytest.raises(SpecDecodeError, match="SpecConfig takes"):
        SpecConfig("ngram", num_draft_tokens="3")


@pytest.mark.parametrize("options, message", [
    ({"ngram_branches": 0}, "ngram_branches must be between 1 and 8, got 0"),
    ({"suffix_spec_factor": 0.0}, "suffix_spec_factor must be above 0 and at most 64, got 0.0"),
    ({"draft_p_min": 1.0}, "draft_p_min must be at least 0 and below 1, got 1.0"),
    ({"mtp_draft_vocab": -1}, "mtp_draft_vocab must be at least 0, got -1"),
    ({"dflash_block_size": 1}, "dflash_block_size must be 0"),  # a hole in its bounds, checked by the drafter
    ({"ngram_min": 5}, "need 1 <= ngram_min <= ngram_max"),  # an order between two options
])
def test_a_drafter_option_outside_its_declared_bounds_is_one_clear_error(options, message):
    from specdecode.drafters.registry import all_options, check_options

    method = all_options()[next(iter(options))][0].name  # the drafter that declares the option
    with pytest.raises(SpecDecodeError, match=message):
        check_options(SpecConfig(method, options=options))


@pytest.mark.parametrize("limit", [0, -5, 2.5, "64"])
def test_context_limit_must_be_a_positive_integer(pair, limit):
    with pytest.raises(SpecDecodeError, match="context limit must be a positive number of tokens"):
        Engine(pair[0], context_limit=limit)


@pytest.mark.parametrize("device", ["tpu", "cpu:0", "cuda:x", "", "mps"])
def test_unknown_device_is_a_clear_error(pair, device):
    with pytest.raises(SpecDecodeError, match="unknown device"):
        load_model(pair[0].folder, dtype="float32", device=device)


@pytest.mark.parametrize("changes, message", [
    ({"intermediate_size": 256}, r"mlp.down_proj.weight has shape \[64, 128\] but the config implies \[64, 256\]"),
    ({"num_hidden_layers": 5}, "the config says 5 layers but the weights hold 3"),
    ({"vocab_size": 300}, r"embed_tokens.weight has shape \[272, 64\]"),
    ({"num_key_value_heads": 4}, r"k_proj.bias has shape \[32\] but the config implies \[64\]"),
    ({"hidden_size": 128}, "has shape"),
    ({"num_hidden_layers": 10**9}, "the config says 1000000000 layers"),
])
@pytest.mark.parametrize("quant", ["none", "int8"])
def test_config_sizes_that_do_not_match_the_weights(pair, tmp_path, changes, message, quant):
    folder = copy_of(pair[0].folder, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(SpecDecodeError, match=message):
        load_model(folder, dtype="float32", quant=quant)


@pytest.mark.parametrize("changes, message", [
    ({"hidden_size": -64}, "hidden_size must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"num_attention_heads": 0}, "malformed field|positive integer"),
    ({"intermediate_size": 128.0}, "intermediate_size must be a positive integer"),
    ({"rms_norm_eps": "small"}, "rms_norm_eps must be a positive number"),
    ({"max_position_embeddings": 10**12}, "above the 1048576 positions supported"),
    ({"head_dim": 15}, "head_dim must be even|has shape"),
    ({"rope_scaling": [1]}, "malformed field|rope_scaling"),
    ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling.factor must be a positive number"),
    ({"eos_token_id": "end"}, "eos_token_id must be integers"),
])
def test_malformed_config_values(pair, tmp_path, changes, message):
    folder = copy_of(pair[0].folder, tmp_path)
    edit_config(folder, **changes)
    with pytest.raises(SpecDecodeError, match=message):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize("content, message", [(b"[1, 2]", "must hold a JSON object"),
                                              (b'{"model_type": "\xff"}', "not valid JSON"),
                                              (b"[" * 100_000, "not valid JSON")])
def test_config_json_that_is_not_a_json_object(pair, tmp_path, content, message):
    folder = copy_of(pair[0].folder, tmp_path)
    (folder / "config.json").write_bytes(content)
    with pytest.raises(SpecDecodeError, match=message):
        load_model(folder, dtype="float32")


def test_folder_without_tokenizer_files_is_a_clear_error(pair, tmp_path):
    folder = copy_of(pair[0].folder, tmp_path, without=("tokenizer*", "special_tokens_map.json", "vocab.json",
                                                         "merges.txt", "chat_template*"))
    with pytest.raises(SpecDecodeError, match="has no tokenizer|could not load the tokenizer"):
        load_model(folder, dtype="float32")


@pytest.mark.parametrize("content", [b"garbage{", b'{"version": "1.0", "model": 7}', b"\xff\xfe"])
def test_corrupt_tokenizer_file_is_a_clear_error(pair, tmp_path, content):
    folder = copy_of(pair[0].folder, tmp_path)
    (folder / "tokenizer.json").write_bytes(content)
    with pytest.raises(SpecDecodeError, match="could not load the tokenizer|has no tokenizer"):
        load_model(folder, dtype="float32")


def test_corrupt_generation_config_is_a_clear_error(pair, tmp_path):
    folder = copy_of(pair[0].folder, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(SpecDecodeError, match="eos_token_id must be an integer"):
        load_model(folder, dtype="float32")


def test_quantized_draft_smaller_than_its_target_gives_no_warning(tmp_path, caplog):
    # Quantized layers keep their weights in buffers: the check counts parameters from the config instead.
    target = load_model(save_tiny_model(tmp_path / "t", "qwen2", scale=0.15, num_hidden_layers=4), dtype="float32")
    small = save_tiny_model(tmp_path / "small", "qwen2", scale=0.15, num_hidden_layers=1)
    large = save_tiny_model(tmp_path / "large", "qwen2", scale=0.15, num_hidden_layers=6)
    with caplog.at_level(logging.WARNING):
        Engine(target, load_model(small, dtype="float32", quant="int4"), SpecConfig("draft"))
    assert "not smaller" not in caplog.text
    with caplog.at_level(logging.WARNING):  # the same check does warn for a larger quantized draft
        Engine(target, load_model(large, dtype="float32", quant="int4"), SpecConfig("draft"))
    assert "is not smaller than the target" in caplog.text
