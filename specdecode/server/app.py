"""The FastAPI app: OpenAI-compatible routes over the scheduler, with OpenAI's error body for every error."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, fields, replace
from importlib import resources

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from specdecode.config import SamplingParams, SpecConfig
from specdecode.drafters.registry import DRAFTERS
from specdecode.engine.engine import Engine
from specdecode.engine.request import GenerationEvent
from specdecode.errors import SpecDecodeError, quoted
from specdecode.server import DEFAULT_PUBLIC_ROUTES, ROUTE_GROUPS
from specdecode.server.errors import APIKeyGuard, install_error_handlers
from specdecode.server.metrics import ServerMetrics
from specdecode.server.protocol import (
    GENERATION_RESPONSES,
    APIError,
    publish_request_schemas,
    request_body,
    request_models,
)
from specdecode.server.responses import ResponseShape
from specdecode.server.scheduler import Job, QueueFull, RequestTimeout, Scheduler, ShuttingDown

GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")
VIEW = resources.files("specdecode.server") / "view"  # the live view's static files, inside the package
VIEW_FILES = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    spec: SpecConfig
    api_key: str | None = None
    public_routes: tuple[str, ...] = DEFAULT_PUBLIC_ROUTES  # groups of ROUTE_GROUPS that need no API key
    default_max_tokens: int = 256
    max_active: int = 8
    max_queued: int = 64
    request_timeout: float = 600.0
    max_body_bytes: int = 1 << 20
    shutdown_grace: float = 10.0
    batching: str = "auto"  # on, off, or auto: on where the target is batch-invariant (scheduler.py)
    kv_memory: int | None = None  # bytes the active requests' KV caches may hold together; None: no bound
    prefill_chunk: int | None = None  # prompt tokens a chunk reads; None: about one round of steps' time (scheduler)


def create_app(engine: Engine, settings: ServerSettings) -> FastAPI:
    scheduler = Scheduler(engine, settings.max_active, settings.max_queued, settings.batching, settings.kv_memory,
                          settings.prefill_chunk)
    metrics = ServerMetrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.shutdown, settings.shutdown_grace)

    app = FastAPI(title="specdecode", lifespan=lifespan)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.state.drain = lambda: scheduler.shutdown(settings.shutdown_grace)
    known_paths = {"/v1/models", *GENERATION_ROUTES, *(path for paths in ROUTE_GROUPS.values() for path in paths)}

    def count(path: str, status: int) -> None:
        # Unknown paths share one label: a client (or a fuzzer) must not mint a time series per path it tries.
        metrics.requests.labels(path if path in known_paths else "other", str(status)).inc()

    install_error_handlers(app, count)
    if settings.api_key:
        public = frozenset(path for group in settings.public_routes for path in ROUTE_GROUPS[group])
        app.add_middleware(APIKeyGuard, key=settings.api_key, public_paths=public, count=count)
    add_status_routes(app, engine, scheduler, metrics, settings)
    add_generation_routes(app, engine, scheduler, metrics, settings)
    return app


def add_status_routes(app: FastAPI, engine: Engine, scheduler: Scheduler, metrics: ServerMetrics,
                      settings: ServerSettings) -> None:
    """What the server is and how it is doing: health, Prometheus metrics, the live view, the methods it runs and
    the model it serves."""
    weights = {role: m.weights_bytes for role, m in (("target", engine.target), ("draft", engine.draft)) if m}

    @app.get("/health")
    async def health() -> dict:
        active, queued = scheduler.load
        return {"status": "draining" if scheduler.draining else "ok", "active": active, "queued": queued}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text exposition format"}})
    async def prometheus() -> Response:
        head = engine.drafter_weights_bytes()
        body = metrics.render(*scheduler.load, weights | ({"drafter": head} if head else {}),
                              engine.drafter_cache_bytes(), scheduler.kv_bytes, settings.kv_memory,
                              engine.prefix_cache)
        return Response(body, media_type="text/plain; version=0.0.4")

    @app.get("/", include_in_schema=False)
    async def live_view() -> Response:
        return Response(VIEW.joinpath("index.html").read_bytes(), media_type="text/html; charset=utf-8")

    @app.get("/view/{name}", include_in_schema=False)
    async def view_file(name: str) -> Response:
        if name not in VIEW_FILES:
            raise APIError(404, f"no route GET /view/{name}", code="not_found")
        return Response(VIEW.joinpath(name).read_bytes(), media_type=VIEW_FILES[name])

    @app.get("/v1/specdecode/options")
    async def drafting_options() -> dict:
        """What the live view offers: the methods this server can run, each with its own options."""
        return {"default": {"method": settings.spec.method, "num_draft_tokens": settings.spec.num_draft_tokens},
                "methods": runnable_methods(engine)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "specdecode"}]}


def add_generation_routes(app: FastAPI, engine: Engine, scheduler: Scheduler, metrics: ServerMetrics,
                          settings: ServerSettings) -> None:
    """The two OpenAI generation routes, and their request schemas as this server runs them."""
    completion_request, chat_request = request_models(settings.model_name, engine.target.config.vocab_size,
                                                      engine.context_limit)
    default_spec = engine.check_spec(settings.spec)  # a request without a method: the server's own

    @app.post("/v1/completions", openapi_extra=request_body(completion_request), responses=GENERATION_RESPONSES)
    async def completions(request: Request):
        return await serve_generation(request, completion_request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=request_body(chat_request), responses=GENERATION_RESPONSES)
    async def chat_completions(request: Request):
        return await serve_generation(request, chat_request, chat=True)

    async def serve_generation(request: Request, schema, chat: bool):
        body = await read_body(request, schema, settings.max_body_bytes)
        job = build_job(engine, settings, default_spec, body, chat)
        try:
            scheduler.check_fits(job, exact=False)
        except SpecDecodeError as error:
            raise APIError(400, str(error), param=error.param) from None
        try:
            scheduler.submit(job)
        except QueueFull as error:
            raise APIError(429, f"server busy: {error}; retry shortly", "rate_limit_error",
                           headers={"Retry-After": "1"}) from None
        except ShuttingDown as error:
            raise APIError(503, str(error), "server_error", headers={"Retry-After": "5"}) from None
        shape = ResponseShape(chat, settings.model_name, engine.target.tokenizer)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            stream = stream_events(job, shape, include_usage, metrics, request.url.path)
            return StreamingResponse(stream, media_type="text/event-stream")
        return await collect(job, shape, metrics, request)

    runnable = {}  # each method this server runs -> every name a request may give it
    members = {}  # ... and the drafters whose options it takes (itself, or those `auto` stands for here)
    for method in runnable_methods(engine):
        cls = DRAFTERS[method["name"]]
        runnable[cls.name] = sorted({cls.name, *cls.aliases, *([cls.vllm_method] if cls.vllm_method else [])})
        members[cls.name] = list(engine.check_spec(SpecConfig(cls.name)).methods)
    publish_request_schemas(app, [completion_request, chat_request], runnable, members, list(default_spec.methods),
                            engine.target.config.vocab_size)


class DrainingServer(uvicorn.Server):
    """uvicorn runs the lifespan shutdown only after every connection has closed (or been cut at
    timeout_graceful_shutdown), so the scheduler's drain would never reach an open stream. Drain first: in-flight
    requests finish within the grace period or end with an error event and [DONE]; new ones get 503."""

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.config.app.state.drain)
        await super().shutdown(sockets)


async def read_body(request: Request, schema, limit: int):
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    try:
        raw = await request.body()
    except ClientDisconnect:
        # The client hung up mid-body: no one reads the answer; 499 (nginx's "client closed request") closes the
        # books, as for a client that leaves while its answer is generated.
        raise APIError(499, "the client closed the connection before its body arrived", code="client_closed") from None
    if len(raw) > limit:
        raise APIError(413, f"request body over {limit} bytes", code="request_too_large")
    try:
        # Parsed and validated in one pass by pydantic's JSON parser: invalid UTF-8, lone surrogates and
        # nesting deeper than its recursion limit are malformed JSON, not a crash.
        return schema.model_validate_json(raw)
    except ValidationError as error:
        errors = error.errors()
        if errors[0]["type"] == "json_invalid":
            message = errors[0]["msg"]
            hint = " (a \\ud800-\\udfff escape must be half of a surrogate pair)" if "escape" in message else ""
            raise APIError(400, f"malformed JSON body: {message}{hint}") from None
        # A value that fits no member of a union fails once per member: the deepest failure is the telling one
        # (a list item of the wrong type, rather than "not a string").
        deepest = max(errors, key=lambda e: len(e["loc"]))
        param = ".".join(str(p) for p in deepest["loc"] if not _union_member(p)) or None
        raise APIError(400, f"{param}: {deepest['msg']}" if param else deepest["msg"], param=param) from None


def _union_member(part) -> bool:
    """pydantic names the member of a union a value failed in its error location ('str', 'list[int]',
    'constrained-str'); a request field path (OpenAI's `param`) has field names and indices only."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


def runnable_methods(engine: Engine) -> list[dict]:
    """Every registered method the engine has what it needs for (checked, nothing built), with its options."""
    methods = []
    for name, cls in DRAFTERS.items():
        try:
            engine.check_spec(SpecConfig(name))
        except SpecDecodeError:
            continue
        options = [{"name": item.name, "type": type(item.default).__name__, "default": item.default,
                    "help": item.metadata["help"]} for item in fields(cls.Options)]
        methods.append({"name": name, "options": options})
    return methods


def build_job(engine: Engine, settings: ServerSettings, default_spec: SpecConfig, body, chat: bool) -> Job:
    """The job a request body asks for; `default_spec`: the server's spec as the engine checked it."""
    if body.model and body.model != settings.model_name:
        raise APIError(404, f"model {quoted(body.model)} not found; this server serves {settings.model_name!r}",
                       param="model", code="model_not_found")
    asked = (body.max_completion_tokens if chat else None) or body.max_tokens
    if asked is not None and asked > engine.context_limit:
        raise APIError(400, f"max_tokens {asked} is above the context limit of {engine.context_limit}",
                       param="max_tokens")
    try:
        prompt = [{"role": m.role, "content": m.text()} for m in body.messages] if chat else body.prompt
        prompt_ids = engine.encode(prompt, raw=not chat)
        room = engine.context_limit - len(prompt_ids)
        if asked is not None and asked > room:  # as OpenAI answers: the request cannot be served as asked
            raise SpecDecodeError(f"the prompt's {len(prompt_ids)} tokens and max_tokens {asked} exceed the context "
                                  f"of {engine.context_limit} tokens; ask for at most {room} max_tokens",
                                  "max_tokens")
        # The server's default must not turn a request into an error: it shrinks to the room the prompt leaves.
        max_tokens = asked or min(settings.default_max_tokens, room)
        sampling = SamplingParams(temperature=1.0 if body.temperature is None else body.temperature,
                                  top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                                  min_p=body.min_p or 0.0, max_tokens=max_tokens, seed=_seed(body.seed),
                                  stop=body.stop_strings(), ignore_eos=bool(body.ignore_eos),
                                  logprobs=body.logprobs_asked())
        spec = default_spec  # the server's own, checked once at start
        if body.speculative is not None:  # the request's, checked once here: the worker takes it as it is
            speculative = body.speculative
            overrides = {k: v for k, v in (("method", speculative.method),
                                           ("num_draft_tokens", speculative.num_draft_tokens),
                                           ("verification", speculative.verification)) if v is not None}
            given = speculative.drafter_options()
            spec = engine.check_spec(replace(settings.spec, **overrides, options=dict(settings.spec.options) | given),
                                     given)
    except SpecDecodeError as error:
        raise APIError(400, str(error), param=error.param) from None
    return Job(prompt_ids, sampling, spec, time.monotonic() + settings.request_timeout, asyncio.get_running_loop(),
               reuse_prefix=body.cache_prompt is not False, provenance=bool(body.provenance))


def _seed(asked: int | None) -> int:
    """The request's seed: the client's, else one picked here. Either way the response's `speculative.seed` says which,
    and a request is seeded, so under the coupled rule that seed reproduces the answer whatever was drafted."""
    return asked if asked is not None else random.getrandbits(63)


async def next_event(job: Job) -> GenerationEvent:
    item = await job.events.get()
    if isinstance(item, SpecDecodeError):
        raise APIError(408 if isinstance(item, RequestTimeout) else 503, str(item), "server_error")
    if isinstance(item, Exception):
        raise APIError(500, f"internal error: {item}", "server_error")
    if item is None:
        raise APIError(500, "generation ended without a result", "server_error")
    return item


async def collect(job: Job, shape: ResponseShape, metrics: ServerMetrics, request: Request) -> dict | Response:
    text, logprobs, first_token_at, generated = [], [], None, 0
    trace: dict | None = None
    event = None
    try:
        while True:
            waiter = asyncio.ensure_future(next_event(job))
            while not waiter.done():
                await asyncio.wait({waiter}, timeout=0.5)
                if not waiter.done() and await request.is_disconnected():
                    waiter.cancel()
                    # Nobody reads this answer; 499 (nginx's "client closed request") just closes the books.
                    metrics.requests.labels(request.url.path, "499").inc()
                    return Response(status_code=499)
            event = waiter.result()
            first_token_at = first_token_at or time.monotonic()
            generated += len(event.token_ids)
            text.append(event.text)
            logprobs.extend(event.logprobs or ())
            part = shape.provenance(event.token_ids, event.origins, event.step)
            if part is not None:
                trace = part if trace is None else {key: trace[key] + part[key] for key in trace}
            if event.finish_reason is not None:
                break
    finally:
        job.cancelled.set()  # a no-op when finished; frees the worker's state when the client left
        if event is None or event.finish_reason is None:  # ended early (client gone, an error): still generated
            metrics.generation_tokens.inc(generated)
    metrics.record_generation(event.stats, first_token_at - job.submitted, time.monotonic() - job.submitted)
    metrics.requests.labels(request.url.path, "200").inc()
    return shape.full("".join(text), event.finish_reason, event.stats,
                      logprobs if event.logprobs is not None else None, trace)


async def stream_events(job: Job, shape: ResponseShape, include_usage: bool, metrics: ServerMetrics,
                        path: str) -> AsyncIterator[str]:
    first_token_at, counted, finished, generated = None, False, False, 0
    try:
        first = True
        while True:
            try:
                event = await next_event(job)
            except APIError as error:
                # Headers are gone; the error travels in the stream, then the stream ends as usual.
                metrics.requests.labels(path, str(error.status)).inc()
                counted = True
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            first_token_at = first_token_at or time.monotonic()
            generated += len(event.token_ids)
            # A chunk for every event with text or log-probabilities (tokens whose text is held back still
            # have theirs), the first and the last.
            if event.text or first or event.finish_reason or event.logprobs or event.origins:
                chunk = shape.chunk(event.text, event.finish_reason, first, event.logprobs,
                                    shape.provenance(event.token_ids, event.origins, event.step))
                yield f"data: {json.dumps(chunk)}\n\n"
                first = False
            if event.finish_reason is not None:
                metrics.record_generation(event.stats, first_token_at - job.submitted,
                                          time.monotonic() - job.submitted)
                metrics.requests.labels(path, "200").inc()
                counted = finished = True
                if include_usage:
                    yield f"data: {json.dumps(shape.usage_chunk(event.stats))}\n\n"
                break
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled.set()  # client disconnects land here too (the generator is closed)
        if not counted:  # the client left before the end: 499, nginx's "client closed request", as collect()
            metrics.requests.labels(path, "499").inc()
        if not finished:  # its stats never came: the tokens sent before the end still count as generated
            metrics.generation_tokens.inc(generated)
