"""Servers at load: C clients at once, each sending the next prompt as soon as its last answer ends.

For each server and each concurrency: aggregate output tokens per second over the run's wall time, time to first
token and inter-token latency percentiles (gaps between streamed chunks, each chunk's tokens counted), and
requests per second. Every server gets the same prompts in the same order, streamed chat completions with the
same sampling; a server's speculation is whatever it runs (ours can be told per request, `spec=METHOD`).

Prompts are cold by default: every request carries `"cache_prompt": false`, which tells llama.cpp's server and
ours not to reuse the KV of a prompt seen before (vLLM and SGLang ignore the field). The same
prompts go out at each concurrency, and with its cache on llama.cpp answers the second time round in 210-418 ms
against 1165 ms cold (docs/benchmarks, 2026-12-03 at load): a warm run measures its cache, not its scheduling. A peer
written with `cache=on` leaves the server's prompt cache to its own settings. vLLM's and SGLang's prefix caches are
switched off on their command lines only (`--no-enable-prefix-caching`, `--disable-radix-cache`).
"""

from __future__ import annotations

import json
import queue
import threading
import urllib.error
from dataclasses import asdict, dataclass, field
from pathlib import Path
from time import perf_counter

from specdecode.bench.datasets import Question
from specdecode.bench.openai_peer import OpenAIPeer, parse_peer, stream_chat
from specdecode.config import SamplingParams
from specdecode.errors import SpecDecodeError

PERCENTILES = (50, 90, 99)


@dataclass
class LoadTarget:
    """A server to load: its URL, a label, the `speculative` override sent with every request (ours only), and
    whether the server may answer from a prompt cache."""

    url: str
    name: str
    speculative: str | None = None
    prompt_cache: bool = False

    @classmethod
    def parse(cls, text: str) -> LoadTarget:
        """'openai=URL[,name=LABEL][,spec=METHOD][,cache=on|off]'."""
        url, name = parse_peer(text)
        fields = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        cache = fields.get("cache", "off")
        if cache not in ("on", "off"):
            raise SpecDecodeError(f"--peer {text!r}: cache= takes on or off, not {cache!r}")
        return cls(url, name, fields.get("spec"), cache == "on")


@dataclass
class LoadResult:
    server: str
    concurrency: int
    requests: int
    failed: int
    output_tokens: int
    seconds: float
    tokens_per_second: float
    requests_per_second: float
    ttft_ms: dict[str, float] = field(default_factory=dict)  # "p50" -> milliseconds
    itl_ms: dict[str, float] = field(default_factory=dict)
    prompt_cache: bool = False  # the server was let answer from its prompt cache (a peer's cache=on)


def percentiles(values: list[float]) -> dict[str, float]:
    """Nearest-rank percentiles, in milliseconds."""
    if not values:
        return {}
    ordered = sorted(values)
    return {f"p{p}": 1000 * ordered[min(len(ordered) - 1, max(0, round(p / 100 * len(ordered)) - 1))]
            for p in PERCENTILES}


def one_request(url: str, body: dict) -> tuple[int, float, list[float]]:
    """Stream one chat completion -> (output tokens, time to first token, inter-token gaps in seconds). A chunk
    carrying several tokens (a speculative step) counts as that many gaps of equal share."""
    _, info = stream_chat(f"{url}/v1/chat/completions", body)
    arrivals, tokens = info["chunk_arrivals"], info["completion_tokens"]
    if not arrivals:
        return tokens, 0.0, []
    span = arrivals[-1] - arrivals[0]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # Spread the streamed span over the tokens after the first: chunks may hold several tokens.
    per_token = [span / (tokens - 1)] * (tokens - 1) if tokens > 1 and len(gaps) < tokens - 1 else gaps
    return tokens, info["time_to_first_token"], per_token


def run_load(target: LoadTarget, model: str, prompts: list[str], sampling: SamplingParams,
             concurrency: int) -> LoadResult:
    """`concurrency` clients share the prompts (each takes the next when its answer ends) until all are sent."""
    work: queue.Queue[str] = queue.Queue()
    for prompt in prompts:
        work.put(prompt)
    lock = threading.Lock()
    done: list[tuple[int, float, list[float]]] = []
    failures: list[str] = []

    def client() -> None:
        while True:
            try:
                prompt = work.get_nowait()
            except queue.Empty:
                return
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": sampling.max_tokens,
                    "temperature": sampling.temperature, "cache_prompt": target.prompt_cache}
            if sampling.seed is not None:
                body["seed"] = sampling.seed
            if target.speculative:
                body["speculative"] = {"method": target.speculative}
            try:
                result = one_request(target.url, body)
            except (SpecDecodeError, urllib.error.URLError, OSError, json.JSONDecodeError) as error:
                with lock:
                    failures.append(str(error))
                continue
            with lock:
                done.append(result)

    began = perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = perf_counter() - began
    tokens = sum(count for count, _, _ in done)
    return LoadResult(target.name, concurrency, len(done), len(failures), tokens, seconds, tokens / seconds,
                      len(done) / seconds, percentiles([ttft for _, ttft, _ in done]),
                      percentiles([gap for _, _, gaps in done for gap in gaps]), target.prompt_cache)


def run_load_bench(targets: list[str], questions: list[Question], sampling: SamplingParams,
                   concurrencies: list[int], out: Path | None) -> list[LoadResult]:
    """Every server at every concurrency, in that order; a table on stdout, results.json and report.md in `out`."""
    prompts = [question.turns[0] for question in questions]
    results = []
    for target in [LoadTarget.parse(text) for text in targets]:  # every --peer read before any load
        model = OpenAIPeer(target.url, target.name).model  # also checks the server answers, before any load
        for concurrency in concurrencies:
            result = run_load(target, model, prompts, sampling, concurrency)
            print(format_row(result), flush=True)
            results.append(result)
    if out is not None:
        (out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
        (out / "report.md").write_text(report(results, sampling, len(prompts)))
    return results


HEADER = "| server | clients | tokens/s | requests/s | TTFT p50 / p90 ms | ITL p50 / p90 / p99 ms | failed |"


def format_row(r: LoadResult) -> str:
    ttft = " / ".join(f"{r.ttft_ms.get(f'p{p}', 0):.0f}" for p in (50, 90))
    itl = " / ".join(f"{r.itl_ms.get(f'p{p}', 0):.0f}" for p in PERCENTILES)
    return (f"| {r.server} | {r.concurrency} | {r.tokens_per_second:.1f} | {r.requests_per_second:.2f} | {ttft} | "
            f"{itl} | {r.failed} |")


def report(results: list[LoadResult], sampling: SamplingParams, prompts: int) -> str:
    cached = sorted({r.server for r in results if r.prompt_cache})
    caches = f"prompts cold (`cache_prompt: false`) except to {', '.join(cached)}" if cached else "prompts cold " \
        "(`cache_prompt: false`, which llama.cpp's server and ours honour)"
    lines = ["# Servers at load", "",
             f"{prompts} prompts (first turns), max_tokens {sampling.max_tokens}, temperature "
             f"{sampling.temperature}; each client sends its next prompt when its answer ends; {caches}.", "",
             HEADER, "|---|---|---|---|---|---|---|"]
    return "\n".join(lines + [format_row(r) for r in results]) + "\n"
