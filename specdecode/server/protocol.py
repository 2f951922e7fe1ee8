"""The HTTP boundary: OpenAI request shapes (validated by pydantic, published in /openapi.json) and the OpenAI error
body."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, create_model
from pydantic.json_schema import models_json_schema

from specdecode.config import MAX_DRAFT_TOKENS, MAX_LOGPROBS, VERIFICATION_RULES
from specdecode.drafters.registry import DRAFTERS, all_options

# Strict types at the HTTP boundary: "stream": "yes" or "max_tokens": "8" is a 400, not a guess. JSON numbers
# still fill float fields whether written 1 or 1.0; NaN and Infinity are refused.
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def _integral(value: Any) -> Any:
    """JSON Schema counts 4.0 as an integer, so an integer field takes it (as 4); 4.5 and "4" stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**bounds: int) -> Any:
    """An integer field within `bounds` (ge, lt, ...) that takes integral JSON numbers; the bounds come before the
    validator, or pydantic leaves them out of the published schema."""
    return Annotated[int, Field(**bounds), BeforeValidator(_integral)]


Int = integer()
NonEmpty = Annotated[str, Field(min_length=1)]


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool | None = False


class _SpeculativeBase(BaseModel):
    model_config = STRICT | ConfigDict(extra="forbid")
    method: str | None = None
    num_draft_tokens: integer(ge=0, le=MAX_DRAFT_TOKENS) | None = None
    verification: Literal[VERIFICATION_RULES] | None = Field(
        default=None, description="how sampled drafts are verified: coupled (the answer is plain decoding's at the "
        "request's seed, token for token), block (a chain jointly) or token (token by token); all lossless; default: "
        "the server's --verification, else the rule for a seeded request (every request has a seed, picked when not "
        "given)")

    def drafter_options(self) -> dict:
        """The drafter options the request sets (the rest keep the server's)."""
        settings = ("method", "num_draft_tokens", "verification")
        return {name: value for name, value in self if name not in settings and value is not None}


def _option_field(item) -> tuple:
    """A drafter option's request field: its type (an integer takes 4.0, as every integer field here) within its
    declared bounds, or null."""
    kind, bounds, help_ = type(item.default), item.metadata["bounds"], item.metadata["help"]
    if kind is int:
        return integer(**bounds) | None, Field(default=None, description=help_)
    return kind | None, Field(default=None, description=help_, **bounds)


# Per-request speculation, overriding the server default (extra body field `speculative`): the method, the draft
# length and every registered drafter's options, by our names (published per method: speculative_schema).
SpeculativeOverride = create_model(
    "SpeculativeOverride", __base__=_SpeculativeBase,
    **{name: _option_field(item) for name, (_, item) in all_options().items()})


class _GenerationRequest(BaseModel):
    # Unknown OpenAI fields (logit_bias, user, ...) are accepted and ignored, as other servers do.
    model_config = STRICT | ConfigDict(extra="allow")
    # Every field may be null, meaning "the default", as OpenAI's own client sends it.
    model: str | None = None
    max_tokens: integer(ge=1) | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: integer(ge=0) | None = 0
    min_p: float | None = Field(default=0.0, ge=0, lt=1)
    seed: integer(ge=0, lt=2**63) | None = None
    stop: NonEmpty | list[NonEmpty] | None = None
    n: Literal[1] | None = Field(default=1, description="one choice per request is served")
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    speculative: SpeculativeOverride | None = None
    ignore_eos: bool | None = False
    provenance: bool | None = Field(
        default=False, description="with each chunk (and the full answer), under \"specdecode\": every token's "
        "id, bytes and origin (an accepted draft with its method and position, the target's bonus or correction) "
        "and the step that made it; the live view at / asks for it")
    cache_prompt: bool | None = Field(default=True, description="take the keys and values of the prompt's "
                                      "beginning from an earlier request when the server kept them (--prefix-cache; "
                                      "llama.cpp's field); false: read the whole prompt")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def token_ids(item: Any, most: int | None = None) -> Any:
    """A prompt's list of token ids, each an `item`; its length (at least one, at most `most`) is published in the
    schema but checked with the prompt (Engine.check_prompt), whose message says what is wrong with it: as a
    validation bound, pydantic would report a failed member of the text-or-ids union instead."""
    bounds = {"minItems": 1} | ({} if most is None else {"maxItems": most})
    return Annotated[list[item], Field(json_schema_extra=bounds)]


class CompletionRequest(_GenerationRequest):
    prompt: NonEmpty | token_ids(Int)
    logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(default=None,
                                 description="log-probabilities of each token and of the N most likely alternatives")

    def logprobs_asked(self) -> int | None:
        return self.logprobs


class ContentPart(BaseModel):
    """One part of OpenAI's list form of message content; only text parts can be served."""

    model_config = STRICT | ConfigDict(extra="allow")
    type: Literal["text"]
    text: str = ""


class ChatMessage(BaseModel):
    model_config = STRICT | ConfigDict(extra="allow")  # name, tool_call_id, ...: accepted, not used
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None  # a string, or OpenAI's list of {"type": "text", "text"} parts

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_GenerationRequest):
    # top_logprobs above 0 needs logprobs true (logprobs_asked), as OpenAI's API: said in the schema too.
    model_config = _GenerationRequest.model_config | ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}}, "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: integer(ge=1) | None = None
    logprobs: bool | None = Field(default=False, description="log-probability of each emitted token")
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(default=None,
                                     description="with logprobs: the N most likely alternatives at each token")

    def logprobs_asked(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


def request_models(model_name: str, vocab_size: int, context_limit: int) -> tuple[type[BaseModel], type[BaseModel]]:
    """The completion and chat request models of one server, as tight as what it serves: token ids and top_k
    within its vocabulary, max_tokens within its context, and (in the published schema; another name is a 404,
    as OpenAI answers) its model's name."""
    budget = integer(ge=1, le=context_limit) | None
    model = Annotated[str | None, Field(json_schema_extra={"enum": [model_name, None]})]
    ids = token_ids(integer(ge=0, lt=vocab_size), max(1, context_limit - 1))
    top_k = (integer(ge=0, le=vocab_size) | None, 0)  # more than the vocabulary is a mistake, not "all of it"
    completion = create_model("CompletionRequest", __base__=CompletionRequest, model=(model, None),
                              max_tokens=(budget, None), prompt=(NonEmpty | ids, ...), top_k=top_k)
    chat = create_model("ChatCompletionRequest", __base__=ChatCompletionRequest, model=(model, None),
                        max_tokens=(budget, None), max_completion_tokens=(budget, None), top_k=top_k)
    return completion, chat


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body, the answer to every request that does not succeed."""

    error: ErrorDetail


_ERRORS = {400: "a malformed or unservable request", 401: "a missing or wrong API key (--api-key)",
           404: "another model's name", 408: "the request ran past --request-timeout",
           413: "a body over --max-body-bytes", 429: "every place taken; retry after Retry-After seconds",
           500: "a bug, reported in the server's log", 503: "the server is shutting down"}
# What a generation route answers: the result (JSON, or server-sent events with "stream": true) or an error body.
GENERATION_RESPONSES: dict[int | str, dict] = {
    200: {"description": "the completion; with stream: true, server-sent events (data: chunks, then [DONE])",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **{status: {"model": ErrorBody, "description": why} for status, why in _ERRORS.items()}}


class APIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def request_body(model: type[BaseModel]) -> dict:
    """The OpenAPI requestBody of a route that reads `model` from its JSON body by hand (to answer every
    mistake in OpenAI's error body), which FastAPI cannot see by itself."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def publish_request_schemas(app: FastAPI, models: list[type[BaseModel]], methods: dict[str, list[str]],
                            members: dict[str, list[str]], default: list[str], vocab_size: int) -> None:
    """Add `models` (and the models they use) to /openapi.json's components, where request_body points.
    `methods`: each method this server can run (name -> the names it answers to), for `speculative`'s schema;
    `members`: each one's drafters, whose options a request naming it may set; `default`: those of a request
    without a method (the server's default); `vocab_size`: the target's, the bound of options within it."""
    generate = app.openapi

    def openapi() -> dict:
        schema = generate()  # FastAPI's, built once and cached on the app
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        if models[0].__name__ not in components:
            _, definitions = models_json_schema([(model, "validation") for model in models],
                                                ref_template="#/components/schemas/{model}")
            definitions = definitions["$defs"]
            definitions["SpeculativeOverride"] = speculative_schema(definitions["SpeculativeOverride"], methods,
                                                                    members, default, vocab_size)
            components.update(definitions)
        return schema

    app.openapi = openapi


def speculative_schema(override: dict, methods: dict[str, list[str]], members: dict[str, list[str]],
                       default: list[str], vocab_size: int) -> dict:
    """SpeculativeOverride's schema as the server checks it (drafters/registry.py), one variant per method this
    server can run, each with that method's options only (an option of another method is a 400; `auto` takes
    those of the drafters it stands for here), one without a method (the default's options), and one for a
    combination of methods ("ngram,draft"), published with the method and draft length only: the server also
    takes its members' options, which a schema cannot tie to the names in a string."""
    declared = {}  # drafter -> its options
    for item, (cls, _) in all_options().items():
        declared.setdefault(cls.name, []).append(item)

    def options_of(drafters: list[str]) -> list[str]:
        return [item for drafter in drafters for item in declared.get(drafter, [])]

    properties = override["properties"]
    for name, (_, item) in all_options().items():
        if item.metadata["within_vocab"]:  # as the drafter checks it: more than the vocabulary is a 400
            number = next(kind for kind in properties[name]["anyOf"] if kind.get("type") != "null")
            number["maximum"] = vocab_size

    def variant(method_schema: dict, option_names: list[str], required: bool) -> dict:
        chosen = {"method": method_schema, "num_draft_tokens": properties["num_draft_tokens"],
                  "verification": properties["verification"], **{n: properties[n] for n in option_names}}
        return {"type": "object", "additionalProperties": False, "properties": chosen,
                **({"required": ["method"]} if required else {})}

    variants = [variant({"enum": names}, options_of(members[name]), True) for name, names in methods.items()]
    variants.append(variant({"type": "null"}, options_of(default), False))
    # A combination's members draft: plain decoding ('none') drafts nothing and is refused in one (registry.py).
    pattern = "|".join(sorted(name for name in methods if DRAFTERS[name].caps.drafts))
    variants.append(variant({"type": "string", "pattern": f"^({pattern})(,({pattern}))+$"}, [], True))
    return {"title": "SpeculativeOverride", "oneOf": variants,
            "description": "speculation for this request instead of the server's: a method this server runs with "
                           "its own options, the default's options without a method, or a combination of methods"}
