"""`specdecode serve`: load the models, map vLLM / llama.cpp speculative options to ours, run uvicorn."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from specdecode.cli.options import add_model_args, add_spec_args, default_draft_name, load_models, spec_from_args
from specdecode.config import SpecConfig
from specdecode.drafters import needs_draft_model
from specdecode.drafters.registry import DRAFTERS, all_options, check_options
from specdecode.engine import Engine
from specdecode.errors import SpecDecodeError


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
        spec = replace(base, method=methods[method], options=options,
                       num_draft_tokens=int(config.get("num_speculative_tokens", base.num_draft_tokens)))
        check_options(spec)
    except (TypeError, ValueError) as error:
        raise SpecDecodeError(f"--speculative-config has a value of the wrong type ({error})") from None
    return spec, config.get("model")


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
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes")
    serve.add_argument("--max-tokens", type=int, default=256, help="default max_tokens of a request")
    serve.add_argument("--max-active", type=int, default=8, help="requests generated concurrently (interleaved)")
    serve.add_argument("--max-queued", type=int, default=64, help="requests waiting beyond those; then 429")
    serve.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take")
    serve.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    serve.add_argument("--shutdown-grace", type=float, default=10.0,
                       help="seconds in-flight requests get to finish on shutdown")
    serve.add_argument("--log-level", default="warning")
    serve.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
