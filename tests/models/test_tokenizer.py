"""Streaming detokenization: deltas add up to the full text, never show half a character or a stop string.

The conftest byte tokenizer makes every UTF-8 byte its own token, so multi-byte characters always arrive split.
"""

from __future__ import annotations

import pytest
from conftest import byte_tokenizer

from specdecode.models.loader import load_model
from specdecode.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Grüße, café! 世界 says 🙂👍🏽 — done."


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(byte_tokenizer(), frozenset())


def ids_of(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.hf.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feeds `ids` `chunk` at a time, then flushes; returns every delta (the flush's last)."""
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.flush()]


def test_byte_tokenizer_splits_every_multibyte_character(tokenizer):
    assert len(ids_of(tokenizer, TEXT)) == len(TEXT.encode("utf-8")) > len(TEXT)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5])
def test_streamed_deltas_concatenate_to_the_full_decode(tokenizer, chunk):
    ids = ids_of(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids, chunk)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert detok.output_text == TEXT
    assert not detok.stopped


def test_no_delta_ever_contains_a_replacement_character(tokenizer):
    ids = ids_of(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = stream(detok, ids)
    assert all("\ufffd" not in delta for delta in deltas)
    # A 4-byte emoji is held back for three tokens, then released whole.
    emoji = ids_of(tokenizer, "🙂")
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add([token]) for token in emoji] == ["", "", "", "🙂"]


def test_special_tokens_are_not_shown(tokenizer):
    end = tokenizer.hf.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids_of(tokenizer, "hi") + [end]) == "hi"
    assert detok.flush() == ""


def test_stop_string_cuts_the_text_before_it(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    deltas = stream(detok, ids_of(tokenizer, "keep this STOP not this"), chunk=4)
    assert "".join(deltas) == "keep this "
    assert detok.stopped
    assert detok.output_text == "keep this "
    assert detok.add(ids_of(tokenizer, "more")) == ""  # nothing after a stop


def test_stop_string_split_across_add_calls_is_caught_and_never_shown(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("<END>",))
    deltas = [detok.add(ids_of(tokenizer, piece)) for piece in ("answer <", "E", "N", "D> trailing")]
    assert deltas == ["answer ", "", "", ""]
    assert detok.stopped
    assert detok.flush() == ""


def test_multibyte_stop_string_split_into_byte_tokens_is_caught(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("世界",))
    deltas = stream(detok, ids_of(tokenizer, "hello 世界 more"))
    assert "".join(deltas) == "hello "
    assert detok.stopped
    assert all("\ufffd" not in delta for delta in deltas)


def test_earliest_of_several_stop_strings_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("beta", "alpha"))
    deltas = stream(detok, ids_of(tokenizer, "x alpha y beta"), chunk=20)
    assert "".join(deltas) == "x "


def test_partial_stop_candidate_is_held_then_released_by_flush(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    assert detok.add(ids_of(tokenizer, "almost ST")) == "almost "
    assert detok.flush() == "ST"
    assert not detok.stopped
    assert detok.output_text == "almost ST"


def test_candidate_that_turns_out_not_to_be_a_stop_is_released(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=("STOP",))
    assert detok.add(ids_of(tokenizer, "a ST")) == "a "
    assert detok.add(ids_of(tokenizer, "ART")) == "START"
    assert not detok.stopped


def test_flush_emits_a_character_cut_off_at_the_end(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    cut = ids_of(tokenizer, "ok é")[:-1]  # the last byte of é never arrives
    assert detok.add(cut) == "ok "
    assert detok.flush() == "\ufffd"  # shown as what it is once nothing more can come


def test_eos_ids_include_end_of_turn_tokens(tiny_models):
    loaded = load_model(tiny_models["qwen2"], dtype="float32")
    vocab = loaded.tokenizer.hf.get_vocab()
    assert vocab["<|im_end|>"] in loaded.tokenizer.eos_token_ids
    assert vocab["<|endoftext|>"] in loaded.tokenizer.eos_token_ids
    assert 257 in loaded.tokenizer.eos_token_ids  # from config.json and generation_config.json
    assert vocab["<|im_start|>"] not in loaded.tokenizer.eos_token_ids
