"""OpenAI response bodies and streaming chunks for completions and chat completions."""

from __future__ import annotations

import codecs
import time
import uuid

from specdecode.acceptance.logprobs import TokenLogprob
from specdecode.engine.stats import GenerationStats
from specdecode.models.tokenizer import Tokenizer

# vLLM's floor for a log-probability: -inf (a token the model rules out) is not JSON.
LOGPROB_FLOOR = -9999.0


class ResponseShape:
    """Builds the bodies for one request, so every chunk of a stream shares its id and timestamp (and the
    completions logprobs' text offsets run on from chunk to chunk)."""

    def __init__(self, chat: bool, model: str, tokenizer: Tokenizer):
        self.chat = chat
        self.model = model
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self._text_offset = 0  # characters of output text before the next token
        self._offset_decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False,
              logprobs: list[TokenLogprob] | None = None, provenance: dict | None = None) -> dict:
        """`provenance`: this chunk's tokens and step (`provenance()`), under "specdecode" when the request asked."""
        extra = {} if provenance is None else {"specdecode": provenance}
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs)}
            return self._base("chat.completion.chunk") | {"choices": [choice]} | extra
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs)}
        return self._base("text_completion") | {"choices": [choice]} | extra

    def provenance(self, token_ids: list[int], origins: list | None, step) -> dict | None:
        """Where each token came from (engine/provenance.py): per token its id, exact bytes, kind ("draft",
        "corrected", "bonus", "target"), method and draft position; and the step that made them. None when the
        request did not ask."""
        if origins is None:
            return None
        tokens = [{"id": token, "bytes": list(self.tokenizer.token_bytes(token)),
                   "special": self.tokenizer.is_special(token), "kind": origin.kind, "method": origin.method,
                   "position": origin.position, "step": origin.step} for token, origin in zip(token_ids, origins)]
        steps = [] if step is None else [step.to_dict() | {
            "drafted_bytes": [list(self.tokenizer.token_bytes(token)) for token in step.drafted]}]
        return {"tokens": tokens, "steps": steps}

    def usage_chunk(self, stats: GenerationStats) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._base(obj) | {"choices": [], "usage": usage(stats), "speculative": speculative(stats)}

    def full(self, text: str, finish_reason: str, stats: GenerationStats,
             logprobs: list[TokenLogprob] | None = None, provenance: dict | None = None) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": self.logprobs(logprobs)}
            body = self._base("chat.completion") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs)}
            body = self._base("text_completion") | {"choices": [choice]}
        extra = {} if provenance is None else {"specdecode": provenance}
        return body | {"usage": usage(stats), "speculative": speculative(stats)} | extra

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's logprobs object for the request's next tokens (None when it did not ask).

        Chat: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}. Completions:
        {tokens, token_logprobs, top_logprobs (each the top N and the chosen token, as OpenAI), text_offset}.
        """
        if entries is None:
            return None
        if self.chat:
            return {"content": [self._chat_entry(entry) for entry in entries], "refusal": None}
        tokens = [self._token(entry.token_id)[0] for entry in entries]
        return {"tokens": tokens, "token_logprobs": [_finite(entry.logprob) for entry in entries],
                "top_logprobs": [{self._token(t)[0]: _finite(v) for t, v in entry.top} | {token: _finite(entry.logprob)}
                                 for token, entry in zip(tokens, entries)],
                "text_offset": [self._next_offset(entry.token_id) for entry in entries]}

    def _chat_entry(self, entry: TokenLogprob) -> dict:
        token, raw = self._token(entry.token_id)
        alternatives = []
        for token_id, value in entry.top:
            text, alternative_raw = self._token(token_id)
            alternatives.append({"token": text, "logprob": _finite(value), "bytes": list(alternative_raw)})
        return {"token": token, "logprob": _finite(entry.logprob), "bytes": list(raw), "top_logprobs": alternatives}

    def _token(self, token_id: int) -> tuple[str, bytes]:
        """A token as text (U+FFFD for part of a character) and its exact bytes."""
        raw = self.tokenizer.token_bytes(token_id)
        return raw.decode("utf-8", errors="replace"), raw

    def _next_offset(self, token_id: int) -> int:
        """Where this token's text starts in the output; special tokens add no text."""
        offset = self._text_offset
        if not self.tokenizer.is_special(token_id):
            self._text_offset += len(self._offset_decoder.decode(self.tokenizer.token_bytes(token_id)))
        return offset


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR  # NaN too: it compares False


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_prompt_tokens}}


def speculative(stats: GenerationStats) -> dict:
    return {"method": stats.method, "acceptance": stats.relaxed or "exact", "lossless": stats.lossless,
            "verification": stats.verification, "seed": stats.seed,
            "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "accepted_per_position": list(stats.accepted_per_position),
            "target_forwards": stats.target_forwards, "steps_without_draft": dict(stats.steps_without_draft),
            "guard_shrinks": stats.guard_shrinks, "guard_pauses": stats.guard_pauses}
