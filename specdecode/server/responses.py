"""OpenAI response bodies and streaming chunks for completions and chat completions."""

from __future__ import annotations

import time
import uuid

from specdecode.stats import GenerationStats


class ResponseShape:
    """Builds the bodies for one request, so every chunk of a stream shares its id and timestamp."""

    def __init__(self, chat: bool, model: str):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())

    def _base(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._base("chat.completion.chunk") | {"choices": [choice]}
        choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._base("text_completion") | {"choices": [choice]}

    def usage_chunk(self, stats: GenerationStats) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return self._base(obj) | {"choices": [], "usage": usage(stats), "speculative": speculative(stats)}

    def full(self, text: str, finish_reason: str, stats: GenerationStats) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
            body = self._base("chat.completion") | {"choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
            body = self._base("text_completion") | {"choices": [choice]}
        return body | {"usage": usage(stats), "speculative": speculative(stats)}


def usage(stats: GenerationStats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens}


def speculative(stats: GenerationStats) -> dict:
    return {"method": stats.method, "drafted_tokens": stats.drafted_tokens, "accepted_tokens": stats.accepted_tokens,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "accepted_per_position": list(stats.accepted_per_position),
            "target_forwards": stats.target_forwards}
