"""Any OpenAI-compatible server as a peer (ours, llama.cpp's llama-server, vLLM): streamed chat completions.

Prompts go one at a time with streaming, so time to first token and the streaming rate are measured the same
way for every server. Speculative stats the server reports (llama-server's `timings`, our `speculative`) are
kept per question.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from time import perf_counter

from specdecode.bench.runner import MethodSpec, TurnOutput, TurnRunner
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError

log = logging.getLogger(__name__)
TIMEOUT_SECONDS = 600


def parse_peer(text: str) -> tuple[str, str]:
    """'openai=http://127.0.0.1:8080[,name=llama.cpp]' -> (url, name)."""
    fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
    url = fields.get("openai", "").rstrip("/")
    if not url.startswith(("http://", "https://")):
        raise SpecDecodeError(f"bad peer {text!r}; expected openai=http://HOST:PORT[,name=LABEL]")
    return url, fields.get("name", url.split("//", 1)[1])


class OpenAIPeer:
    def __init__(self, url: str, name: str, model: str | None = None):
        self.url, self.name = url, name
        self.model = model or self._first_model()

    @classmethod
    def connect(cls, text: str) -> OpenAIPeer | None:
        """A peer from its --peer text; an unreachable one is reported and skipped so the rest still runs."""
        url, name = parse_peer(text)
        try:
            return cls(url, name)
        except SpecDecodeError as error:
            log.warning("%s; skipping this peer", error)
            return None

    def _first_model(self) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=10) as response:
                models = json.load(response).get("data") or [{}]
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as error:
            raise SpecDecodeError(f"peer {self.name} at {self.url} is unreachable ({error})") from None
        return models[0].get("id", "default")

    def methods(self) -> list[MethodSpec]:
        # A server's own plain decoding is not measurable from outside: compare it with ours.
        return [MethodSpec(f"openai:{self.name}", "openai", "none")]

    def turn_runner(self, sampling: SamplingParams) -> TurnRunner:
        def run_turn(messages: list[dict]) -> TurnOutput:
            body = {"model": self.model, "messages": messages, "max_tokens": sampling.max_tokens,
                    "temperature": sampling.temperature, "top_p": sampling.top_p, "stream": True,
                    "stream_options": {"include_usage": True}}
            # The same request as ours; top_k, min_p and ignore_eos are extensions llama-server and vLLM read.
            optional = {"seed": sampling.seed, "stop": list(sampling.stop) or None, "top_k": sampling.top_k or None,
                        "min_p": sampling.min_p or None, "ignore_eos": sampling.ignore_eos or None}
            body.update({key: value for key, value in optional.items() if value is not None})
            text, info = stream_chat(f"{self.url}/v1/chat/completions", body)
            del info["chunk_arrivals"]  # the load bench's; results.json keeps per-question numbers only
            # The API returns text, not ids: count tokens as the server reports them.
            return TurnOutput(text, info["completion_tokens"], None, None, info)

        return run_turn


def stream_chat(url: str, body: dict) -> tuple[str, dict]:
    """POST a streaming chat request; return the text and what was measured or reported about it."""
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    started = perf_counter()
    arrivals: list[float] = []  # when each chunk with content came
    pieces, info = [], {}
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_SECONDS) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:  # a server that fails mid-stream says so in the stream
                    raise SpecDecodeError(f"request to {url} failed mid-stream: {chunk['error']}")
                for choice in chunk.get("choices") or []:
                    delta = (choice.get("delta") or {}).get("content")
                    if delta:
                        arrivals.append(perf_counter())
                        pieces.append(delta)
                if chunk.get("usage"):
                    info["usage"] = chunk["usage"]
                    info["completion_tokens"] = chunk["usage"].get("completion_tokens", len(arrivals))
                for key in ("timings", "speculative"):
                    if key in chunk:
                        info[key] = chunk[key]
    except (urllib.error.URLError, OSError, json.JSONDecodeError) as error:
        raise SpecDecodeError(f"request to {url} failed ({error})") from None
    info.setdefault("completion_tokens", len(arrivals))
    first, last = (arrivals[0], arrivals[-1]) if arrivals else (None, None)
    info["time_to_first_token"] = (first - started) if first else None
    info["streaming_tokens_per_second"] = ((info["completion_tokens"] - 1) / (last - first)
                                           if first and last and last > first else None)
    info["chunk_arrivals"] = [t - started for t in arrivals]  # seconds after the request was sent
    return "".join(pieces), info
