"""Tokenizer, chat template and an incremental detokenizer that never emits half a character or a stop string."""

from __future__ import annotations

import json
import re
from pathlib import Path

from jinja2 import TemplateError
from tokenizers import decoders

from specdecode.errors import SpecDecodeError
from specdecode.models.model_config import ModelConfig


def _byte_of_char() -> dict[str, int]:
    """Byte-level BPE's printable stand-in for each byte (GPT-2's bytes_to_unicode), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


_BYTE_OF_CHAR = _byte_of_char()
_BYTE_FALLBACK = re.compile(r"<0x[0-9A-Fa-f]{2}>")

# Turn and text terminators that instruct models emit; any of them present in the vocabulary ends generation.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>", "</s>")


class Tokenizer:
    def __init__(self, hf_tokenizer, eos_token_ids: frozenset[int]):
        self.hf = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        decoder = getattr(getattr(hf_tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = isinstance(decoder, decoders.ByteLevel)  # GPT-2 style: one character per byte
        self._special_ids = frozenset(hf_tokenizer.all_special_ids)
        self._bytes: dict[int, bytes] = {}  # token id -> its bytes, filled as logprobs ask

    @classmethod
    def from_folder(cls, folder: Path, config: ModelConfig) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(str(folder))
        except Exception as error:  # noqa: BLE001 - the tokenizers library raises plain Exception on bad files
            raise SpecDecodeError(f"{folder}: could not load the tokenizer ({error})") from None
        vocab = hf.get_vocab()
        if not set(vocab.values()) - set(hf.all_special_ids):
            # From a folder without tokenizer files transformers builds one that knows only special tokens (and
            # encodes every text to nothing) rather than failing.
            raise SpecDecodeError(f"{folder} has no tokenizer: it needs tokenizer.json (or tokenizer.model, or "
                                  "vocab.json with merges.txt) from the model's repository")
        eos = set(config.eos_token_ids)
        generation = folder / "generation_config.json"
        if generation.is_file():
            try:
                listed = json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id")
            except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, RecursionError) as error:
                raise SpecDecodeError(f"{generation} is not a valid generation config ({error})") from None
            listed = listed if isinstance(listed, list) else [listed] if listed is not None else []
            if not all(type(t) is int for t in listed):
                raise SpecDecodeError(f"{generation}: eos_token_id must be an integer or a list of them")
            eos.update(listed)
        if hf.eos_token_id is not None:
            eos.add(hf.eos_token_id)
        eos.update(vocab[t] for t in END_OF_TURN_TOKENS if t in vocab)
        return cls(hf, frozenset(eos))

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    def encode(self, text: str) -> list[int]:
        check_text(text, "the prompt", "prompt")
        return self.hf.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Messages [{"role", "content"}] -> prompt ids ending where the assistant's reply begins."""
        if not self.has_chat_template:
            raise SpecDecodeError("this model has no chat template; pass raw text instead", "messages")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise SpecDecodeError(f"message {index} must be a dict with a string 'role'", "messages")
            for key, value in message.items():
                if isinstance(value, str):
                    check_text(value, f"message {index}'s {key}", f"messages.{index}.{key}")
        try:
            text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except (TemplateError, TypeError, KeyError, ValueError) as error:
            # Templates reject what they cannot render (a role out of turn) by raising from the template itself.
            raise SpecDecodeError(f"the chat template cannot render these messages ({error})", "messages") from None
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (for logprobs): part of a character for some byte-level tokens, a
        special token's own text, nothing for padded embedding rows the tokenizer does not know."""
        if token_id not in self._bytes:
            self._bytes[token_id] = self._piece_bytes(token_id)
        return self._bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """Tokens decode() leaves out of the text (end of turn and the like)."""
        return token_id in self._special_ids

    def _piece_bytes(self, token_id: int) -> bytes:
        piece = self.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return b""
        if token_id in self.hf.added_tokens_decoder:  # added and special tokens are stored as their text
            return piece.encode("utf-8")
        if self._byte_level and all(ch in _BYTE_OF_CHAR for ch in piece):
            return bytes(_BYTE_OF_CHAR[ch] for ch in piece)
        if _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece's byte fallback: <0xE4>
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode("utf-8")  # SentencePiece marks a leading space with U+2581

    def token_strings(self) -> list[str]:
        """Every id's token string, for checking that two models share a vocabulary."""
        return self.hf.convert_ids_to_tokens(list(range(len(self.hf))))


def check_text(text: str, what: str, param: str | None = None) -> None:
    """Text the tokenizer can take, or one clear error. A lone UTF-16 surrogate (\\ud800-\\udfff) is a str
    but not Unicode text: invalid UTF-8 bytes read with Python's surrogateescape, or a JSON escape without its
    pair. The tokenizer would fail on it with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise SpecDecodeError(f"{what} is not valid Unicode text: {text[error.start]!r} at character "
                              f"{error.start} is a lone surrogate (bytes that are not UTF-8, or half of a "
                              "\\ud800-\\udfff pair)", param) from None


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas.

    Decodes a short window (from the last stable boundary) instead of the whole output each step, holds back
    text ending in an incomplete UTF-8 character, and holds back any tail that could still become a stop string.
    """

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the decode window
        self.read_offset = 0  # ids before this are already turned into text
        self.text = ""  # all text decoded so far
        self.emitted = 0  # characters of self.text already handed out
        self.stopped = False
        self.stop_at: int | None = None  # where the visible text ends once a stop string is found
        self.released_stop = False  # the text up to the stop has been handed out
        self.consumed = 0  # ids taken by the last add()

    def add(self, ids: list[int]) -> str:
        """Append ids; return the new text that is safe to show.

        When a stop string completes, sets `stopped` and takes no further ids: `consumed` tells how many of
        these ids were taken, so the caller can end the output at the very token plain decoding would end at.
        """
        self.consumed = 0
        for token in ids:
            if self.stopped:
                break
            self.ids.append(token)
            self.consumed += 1
            window_before = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
            window_now = self.tokenizer.decode(self.ids[self.prefix_offset :])
            if len(window_now) > len(window_before) and not window_now.endswith("\ufffd"):
                self.text += window_now[len(window_before) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
                if self.stop:
                    self._find_stop()
        return self._release(final=False)

    def flush(self) -> str:
        """At the end: whatever is still held back (a partial stop-string candidate) is plain text after all."""
        if not self.stopped and self.read_offset < len(self.ids):
            tail = self.tokenizer.decode(self.ids[self.prefix_offset :])
            self.text += tail[len(self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])) :]
            self.read_offset = len(self.ids)
        return self._release(final=True)

    def _find_stop(self) -> None:
        """Mark the earliest stop string in the text not yet handed out; the visible text ends before it."""
        for stop in self.stop:
            found = self.text.find(stop, max(0, self.emitted - len(stop) + 1))
            if found != -1 and (self.stop_at is None or found < self.stop_at):
                self.stop_at, self.stopped = found, True

    def _release(self, final: bool) -> str:
        if self.released_stop:
            return ""
        cut = len(self.text) if self.stop_at is None else self.stop_at
        if not self.stopped and not final:
            cut -= self._held_back()
        delta = self.text[self.emitted : cut]
        self.emitted = max(self.emitted, cut)
        self.released_stop = self.stopped
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text) - self.emitted), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    @property
    def output_text(self) -> str:
        """The full visible text so far (a stop string and what follows it removed)."""
        return self.text[: self.emitted]
