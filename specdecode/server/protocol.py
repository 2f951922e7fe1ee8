"""The HTTP boundary: OpenAI request shapes (validated by pydantic) and the OpenAI error body."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from specdecode.drafters.registry import all_options


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SpeculativeBase(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    method: str | None = None
    num_draft_tokens: int | None = None

    def drafter_options(self) -> dict:
        """The drafter options the request sets (the rest keep the server's)."""
        return {name: value for name, value in self if name not in ("method", "num_draft_tokens") and value is not None}


# Per-request speculation, overriding the server default (extra body field `speculative`): the method, the draft
# length and every registered drafter's options, by our names.
SpeculativeOverride = create_model(
    "SpeculativeOverride", __base__=_SpeculativeBase,
    **{name: (type(item.default) | None, Field(default=None, description=item.metadata["help"]))
       for name, (_, item) in all_options().items()})


class _GenerationRequest(BaseModel):
    # Unknown OpenAI fields (logit_bias, user, ...) are accepted and ignored, as other servers do.
    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    # None means "the default", as OpenAI's own client sends it.
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0, lt=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOverride | None = None
    ignore_eos: bool = False

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None  # a string, or OpenAI's list of {"type": "text", "text"} parts

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(part.get("type") != "text" for part in self.content):
            raise ValueError("only text content parts are supported")
        return "".join(str(part.get("text", "")) for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
