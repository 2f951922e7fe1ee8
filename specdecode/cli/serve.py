"""`specdecode serve`: load the models, map vLLM / llama.cpp speculative options to ours, run uvicorn."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from dataclasses import replace

from specdecode.cli.options import add_model_args, add_spec_args, build_engine, spec_from_args
from specdecode.config import SpecConfig
from specdecode.drafters import needs_draft_files
from specdecode.drafters.registry import DRAFTERS, all_options, resolve_spec, with_serve_defaults
from specdecode.engine.prefill_pace import MIN_CHUNK_SECONDS
from specdecode.errors import SpecDecodeError
from specdecode.server import DEFAULT_PUBLIC_ROUTES, ROUTE_GROUPS

MAX_SECONDS = 1e7  # about four months; asyncio's timers overflow on far larger values


def spec_from_vllm(config_json: str, base: SpecConfig) -> tuple[SpecConfig, str | None]:
    """vLLM's --speculative-config JSON -> our SpecConfig and the draft model it names (if any).

    Methods and option keys map through the names each drafter declares (its `vllm_method`, and `vllm=` on
    its options); num_speculative_tokens is the draft length.
    """
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as error:
        raise SpecDecodeError(f"--speculative-config is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise SpecDecodeError("--speculative-config must be a JSON object")
    methods = {cls.vllm_method or name: name for name, cls in DRAFTERS.items() if name != "none"}
    method = config.get("method", "draft_model" if config.get("model") else None)
    if method not in methods:
        raise SpecDecodeError(f"--speculative-config method {method!r} is not supported; "
                              f"supported: {', '.join(methods)}")
    options = dict(base.options)
    for name, (_, item) in all_options().items():
        if item.metadata["vllm"] in config:
            options[name] = config[item.metadata["vllm"]]
    try:
        spec = resolve_spec(replace(base, method=methods[method], options=options,
                                    num_draft_tokens=int(config.get("num_speculative_tokens", base.num_draft_tokens))))
    except (TypeError, ValueError) as error:
        raise SpecDecodeError(f"--speculative-config has a value of the wrong type ({error})") from None
    return spec, config.get("model")


SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """'2G', '512M', '1.5G' or a number of bytes -> bytes (units are powers of 1024; a trailing B or iB is
    allowed)."""
    cleaned = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = cleaned[-1:] if cleaned[-1:] in SIZE_UNITS else ""
    try:
        size = float(cleaned[: len(cleaned) - len(unit)]) * SIZE_UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2G, 512M or a number of bytes)") from None
    if not 1 <= size < float(1 << 60):  # NaN fails too
        raise argparse.ArgumentTypeError(f"a size must be at least one byte, got {text!r}")
    return int(size)


def parse_prefill_chunk(text: str) -> int | None:
    """'auto' (chunks sized by measured times) -> None, or a number of tokens of at least 1."""
    if text.strip().lower() == "auto":
        return None
    try:
        tokens = int(text)
    except ValueError:
        tokens = 0
    if tokens < 1:
        raise argparse.ArgumentTypeError(f"auto or a number of tokens of at least 1, not {text!r} "
                                         "(prompts are always read in chunks, so a cancelled request stops within one)")
    return tokens


def parse_size_or_off(text: str) -> int:
    """A size as parse_size reads it, or 0 / off for none -> bytes."""
    return 0 if text.strip().lower() in ("0", "off") else parse_size(text)


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server with speculative decoding")
    add_model_args(serve)
    add_spec_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", help="model id clients use (default: --model as given)")
    serve.add_argument("--speculative-config", help="vLLM-style JSON, e.g. "
                       "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}'")
    serve.add_argument("--allow-draft-override", action="store_true",
                       help="load the draft model even when the default method does not use it, so requests "
                       "can ask for it")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but --public-routes")
    serve.add_argument("--public-routes", default=",".join(DEFAULT_PUBLIC_ROUTES),
                       help=f"with --api-key: route groups that answer without the key, comma-separated, from "
                       f"{', '.join(ROUTE_GROUPS)}, or none (default {','.join(DEFAULT_PUBLIC_ROUTES)}: the key "
                       "guards /v1, as in vLLM; keep /metrics from the network or name it out of this list)")
    serve.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    serve.add_argument("--max-active", type=int, default=8,
                       help="requests generated concurrently (batched or interleaved, see --batching)")
    serve.add_argument("--batching", choices=("auto", "on", "off"), default="auto",
                       help="verify every active request's drafts in one target forward per step (on), or step "
                       "them one at a time (off); auto: on where the target is batch-invariant (w4a8, or bf16/fp32 "
                       "on a CPU), so each output is bitwise what it would be alone; another target batched "
                       "may differ at near-ties of its top two logits")
    serve.add_argument("--kv-memory", type=parse_size,
                       help="memory the active requests' KV caches may hold together, e.g. 2G or 512M; a request "
                       "that would not fit waits in the queue, one that never could is refused (default: 60%% of the "
                       "memory available once the models are loaded, less the prefix cache; printed at start)")
    serve.add_argument("--prefix-cache", type=parse_size_or_off, default="512M",
                       help="memory for ended requests' KV caches: a prompt that begins as an earlier one did (a "
                       "chat's next turn, a shared system prompt) reads only what is new; least recently used "
                       "out first; a request's cache_prompt: false reads all of it (default 512M; 0 or off: "
                       "none)")
    serve.add_argument("--prefill-chunk", type=parse_prefill_chunk, default=None, metavar="auto|N",
                       help="read each prompt this many tokens at a time, one chunk between two rounds of the "
                       "other requests' steps, checking cancellations, timeouts, new requests and shutdown between "
                       "chunks; auto (the default) sizes each chunk to take about as long as a round of steps, at "
                       f"least {MIN_CHUNK_SECONDS:g} s, so a decoding request's next token waits at most a round "
                       f"plus one chunk while prompts are read (about twice its step, or its step plus "
                       f"{MIN_CHUNK_SECONDS:g} s)")
    serve.add_argument("--max-queued", type=int, default=64, help="requests waiting beyond those; then 429")
    serve.add_argument("--request-timeout", type=float, default=600.0,
                       help="seconds a request may take, waiting included, checked between prompt chunks and steps "
                       "(default 600)")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    serve.add_argument("--shutdown-grace", type=float, default=10.0,
                       help="seconds in-flight requests get to finish on shutdown")
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from specdecode.engine.memory import default_kv_budget
    from specdecode.server.app import DrainingServer, ServerSettings, create_app

    public_routes = check_serve_args(args)
    # vLLM's --speculative-config names the method itself: auto is only the default without it.
    spec = spec_from_args(args, default="none" if args.speculative_config else "auto")
    if args.speculative_config:
        spec, named_draft = spec_from_vllm(args.speculative_config, spec)
        if named_draft is not None:  # vLLM's "model": a draft model, or the folder of an EAGLE-3 head
            if needs_draft_files(spec):
                args.draft_head = named_draft
            else:
                args.draft_model = named_draft
    spec = resolve_spec(with_serve_defaults(spec))
    listening = listening_socket(args.host, args.port)  # before minutes of loading, not after
    with listening:
        engine = build_engine(args, [spec], load_draft_anyway=args.allow_draft_override,
                              prefix_cache_bytes=args.prefix_cache)
        spec = engine.spec  # auto as the members it found
        kv_memory = args.kv_memory if args.kv_memory is not None else default_kv_budget(args.prefix_cache)
        settings = ServerSettings(
            model_name=args.served_model_name or engine.target.name, spec=spec, api_key=args.api_key,
            public_routes=public_routes, default_max_tokens=args.max_tokens, max_active=args.max_active,
            max_queued=args.max_queued, request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
            shutdown_grace=args.shutdown_grace, batching=args.batching, kv_memory=kv_memory,
            prefill_chunk=args.prefill_chunk)
        port = listening.getsockname()[1]
        lossy = f", LOSSY relaxed acceptance {spec.relaxed}" if spec.relaxed else ""
        print(f"serving {settings.model_name} with {spec.method} (k={spec.num_draft_tokens}{lossy}) on "
              f"http://{args.host}:{port}/v1", file=sys.stderr)
        print(f"KV cache budget for active requests: {budget_line(kv_memory, args.kv_memory is None)}",
              file=sys.stderr)
        config = uvicorn.Config(create_app(engine, settings), host=args.host, port=port, log_level=args.log_level,
                                timeout_graceful_shutdown=int(args.shutdown_grace) + 5)
        DrainingServer(config).run(sockets=[listening])
    return 0


def budget_line(kv_memory: int | None, derived: bool) -> str:
    if kv_memory is None:
        return "no bound (this machine does not say how much memory is available; set --kv-memory)"
    why = " (60% of the memory available after loading, less the prefix cache; --kv-memory to change)"
    return f"{kv_memory / 2**30:.2f} GiB" + (why if derived else "")


def check_serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The server's own flags checked before any model loads; -> the public route groups."""
    from uvicorn.config import LOG_LEVELS

    for name in ("max_tokens", "max_active", "max_queued", "max_body_bytes"):
        if getattr(args, name) < 1:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.request_timeout <= MAX_SECONDS:  # NaN fails both comparisons
        raise SpecDecodeError(f"--request-timeout must be in (0, {MAX_SECONDS:g}] seconds, got {args.request_timeout}")
    if not 0 <= args.shutdown_grace <= MAX_SECONDS:
        raise SpecDecodeError(f"--shutdown-grace must be in [0, {MAX_SECONDS:g}] seconds, got {args.shutdown_grace}")
    if args.log_level not in LOG_LEVELS:
        raise SpecDecodeError(f"unknown --log-level {args.log_level!r}; choose one of {', '.join(LOG_LEVELS)}")
    groups = tuple(g.strip() for g in args.public_routes.split(",") if g.strip() and g.strip() != "none")
    unknown = [g for g in groups if g not in ROUTE_GROUPS]
    if unknown:
        raise SpecDecodeError(f"unknown route group {unknown[0]!r} in --public-routes; choose from "
                              f"{', '.join(ROUTE_GROUPS)}, or none")
    return groups


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port for uvicorn to serve on, or one clear error (a port in use, a bad host)."""
    if not 0 <= port <= 65535:
        raise SpecDecodeError(f"--port must be between 0 and 65535, got {port}")
    try:
        family, kind, protocol, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                                flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as error:
        raise SpecDecodeError(f"cannot listen on {host}:{port}: unknown host ({error})") from None
    listening = socket.socket(family, kind, protocol)
    try:
        listening.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: restart over TIME_WAIT
        listening.bind(address)
    except OSError as error:
        listening.close()
        raise SpecDecodeError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None
    listening.set_inheritable(True)
    return listening
