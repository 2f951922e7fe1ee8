"""`specdecode serve`: load the models, map vLLM / llama.cpp speculative options to ours, run uvicorn."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from specdecode.cli import default_draft_name, load_models, spec_from_args
from specdecode.config import SpecConfig
from specdecode.drafters.base import needs_draft_model
from specdecode.engine import Engine
from specdecode.errors import SpecDecodeError

# vLLM's speculative_config "method" values that have a counterpart here.
VLLM_METHODS = {"draft_model": "draft", "ngram": "ngram"}


def spec_from_vllm(config_json: str, base: SpecConfig) -> tuple[SpecConfig, str | None]:
    """vLLM's --speculative-config JSON -> our SpecConfig and the draft model it names (if any)."""
    try:
        config = json.loads(config_json)
    except json.JSONDecodeError as error:
        raise SpecDecodeError(f"--speculative-config is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise SpecDecodeError("--speculative-config must be a JSON object")
    method = config.get("method", "draft_model" if config.get("model") else None)
    if method not in VLLM_METHODS:
        raise SpecDecodeError(f"--speculative-config method {method!r} is not supported; "
                              f"supported: {', '.join(VLLM_METHODS)}")
    try:
        spec = replace(base, method=VLLM_METHODS[method],
                       num_draft_tokens=int(config.get("num_speculative_tokens", base.num_draft_tokens)),
                       ngram_min=int(config.get("prompt_lookup_min", base.ngram_min)),
                       ngram_max=int(config.get("prompt_lookup_max", base.ngram_max)))
    except (TypeError, ValueError) as error:
        raise SpecDecodeError(f"--speculative-config has a value of the wrong type ({error})") from None
    return spec, config.get("model")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from specdecode.server.app import DrainingServer, ServerSettings, create_app

    draft_name = default_draft_name(args)
    spec = spec_from_args(args, has_draft=draft_name is not None)
    if args.speculative_config:
        spec, named_draft = spec_from_vllm(args.speculative_config, spec)
        draft_name = named_draft or draft_name
    needs_draft = needs_draft_model(spec) or args.allow_draft_override
    target, draft = load_models(args, draft_name if needs_draft else None)
    engine = Engine(target, draft, spec, context_limit=args.context)
    settings = ServerSettings(
        model_name=args.served_model_name or target.name, spec=spec, api_key=args.api_key,
        default_max_tokens=args.max_tokens, max_active=args.max_active, max_queued=args.max_queued,
        request_timeout=args.request_timeout, max_body_bytes=args.max_body_bytes,
        shutdown_grace=args.shutdown_grace)
    print(f"serving {settings.model_name} with {spec.method} (k={spec.num_draft_tokens}) on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    config = uvicorn.Config(create_app(engine, settings), host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.shutdown_grace) + 5)
    DrainingServer(config).run()
    return 0


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", help="model id clients use (default: --model as given)")
    parser.add_argument("--speculative-config", help="vLLM-style JSON, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4}'")
    parser.add_argument("--allow-draft-override", action="store_true",
                        help="load the draft model even when the default method does not use it, so requests "
                        "can ask for it")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    parser.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    parser.add_argument("--max-active", type=int, default=8, help="requests generated concurrently (interleaved)")
    parser.add_argument("--max-queued", type=int, default=64, help="requests waiting beyond those; then 429")
    parser.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    parser.add_argument("--shutdown-grace", type=float, default=10.0,
                        help="seconds in-flight requests get to finish on shutdown")
    parser.add_argument("--log-level", default="warning")
