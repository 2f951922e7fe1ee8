"""A short streamed request's latency while the server reads a long prompt (issue #63).

    python docs/benchmarks/server_prefill_latency.py --out DIR [--long-tokens 4000,32000] [--lead 2]
        [--short-max-tokens 64] [--long-max-tokens 8] [--url http://HOST:PORT] [-- SERVE_ARGS...]

Starts `specdecode serve` on its defaults (plus SERVE_ARGS; `--request-timeout 3600` unless they set one, so a
32,000-token prompt read whole is not cut off), or measures the server already running at --url. First the
short request alone: a streamed chat request of --short-max-tokens tokens (temperature 0, ignore_eos). Then, for
each long size N: a streamed completion whose raw-text prompt is about N tokens long (a code-like paragraph
repeated, calibrated against the server's own count of one) with --long-max-tokens; --lead seconds later, the
same short request. Every request sends `cache_prompt: false`, so no prompt is taken from an earlier one, and
asks for log-probabilities, so that every step's tokens arrive in a chunk even when their text is held back.

Reported for the short request: time to first token, and the gaps between stream chunks that carry tokens (median,
p90, max; a chunk carries what one step committed, so a gap is the time between two of its steps as the client
sees it: its inter-token latency, a step committing one token or several). For the long request: its prefill time
(from sending it to its first token, as its client sees it), its prompt's tokens, and whether the short request
was answered in full before it. Written as DIR/server_prefill_latency.json and .md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

from bench_files import write_report

PARAGRAPH = ("def merge_sorted(left, right):\n    merged, i, j = [], 0, 0\n"
             "    while i < len(left) and j < len(right):\n"
             "        if left[i] <= right[j]:\n            merged.append(left[i]); i += 1\n        else:\n"
             "            merged.append(right[j]); j += 1\n    return merged + left[i:] + right[j:]\n\n")
SHORT_MESSAGE = "Write a Python function that checks whether a string is a palindrome."
CLIENT_TIMEOUT = 3600.0  # seconds any one request may take before the client gives up


def stream(base: str, path: str, body: dict, times: list[float], answer: dict) -> None:
    """POST `body` with stream: true; every chunk that carries tokens appends its arrival time (perf_counter) to
    `times`; `answer` gets the status, the usage and the time the request was sent."""
    url = urllib.parse.urlsplit(base)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=CLIENT_TIMEOUT)
    answer["sent"] = time.perf_counter()
    try:
        connection.request("POST", path, json.dumps(body | {"stream": True, "stream_options": {"include_usage": True}}),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        answer["status"] = response.status
        if response.status != 200:
            answer["error"] = response.read().decode(errors="replace")[:400]
            return
        for line in response:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                answer["error"] = chunk["error"]["message"][:400]
            if chunk.get("usage"):
                answer["usage"] = chunk["usage"]
            if any(carries_tokens(choice) for choice in chunk["choices"]):
                times.append(time.perf_counter())
        answer["ended"] = time.perf_counter()
    finally:
        connection.close()


def carries_tokens(choice: dict) -> bool:
    """Whether a stream chunk's choice carries tokens: their log-probabilities say so even when their text is held
    back (part of a character, a possible stop string), so each step's tokens make one chunk."""
    logprobs = choice.get("logprobs") or {}
    return bool(logprobs.get("content") or logprobs.get("tokens") or choice.get("text")
                or (choice.get("delta") or {}).get("content"))


def short_request(base: str, max_tokens: int) -> tuple[list[float], dict]:
    body = {"messages": [{"role": "user", "content": SHORT_MESSAGE}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False, "logprobs": True}
    times: list[float] = []
    answer: dict = {}
    stream(base, "/v1/chat/completions", body, times, answer)
    return times, answer


def long_body(prompt: str, max_tokens: int) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
            "logprobs": 0}


def prompt_of(base: str, tokens: int) -> tuple[str, int]:
    """A raw-text prompt of about `tokens` tokens, cut from PARAGRAPH repeated, at the server's own count of one
    paragraph; -> it and the tokens it is estimated to make."""
    times: list[float] = []
    answer: dict = {}
    stream(base, "/v1/completions", long_body(PARAGRAPH, 1), times, answer)
    if "usage" not in answer:
        raise SystemExit(f"the server did not count a prompt: {answer}")
    chars_per_token = len(PARAGRAPH) / answer["usage"]["prompt_tokens"]
    length = max(1, round(tokens * chars_per_token))
    return (PARAGRAPH * (length // len(PARAGRAPH) + 1))[:length], round(length / chars_per_token)


def latencies(times: list[float], sent: float) -> dict:
    """Time to first token and the gaps between token-carrying chunks, in seconds."""
    if not times:
        return {"chunks": 0}
    gaps = [later - earlier for earlier, later in zip(times, times[1:])]
    ordered = sorted(gaps)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))] if ordered else None
    return {"chunks": len(times), "ttft": times[0] - sent, "gap_median": statistics.median(gaps) if gaps else None,
            "gap_p90": p90, "gap_max": max(gaps, default=None), "total": times[-1] - sent}


def under_long_prompt(base: str, size: int, lead: float, short_max_tokens: int, long_max_tokens: int) -> dict:
    """The long request, and the short one sent `lead` seconds after it."""
    prompt, estimated = prompt_of(base, size)
    long_times: list[float] = []
    long_answer: dict = {}
    reader = threading.Thread(target=stream, args=(base, "/v1/completions", long_body(prompt, long_max_tokens),
                                                   long_times, long_answer))
    reader.start()
    time.sleep(lead)
    short_times, short_answer = short_request(base, short_max_tokens)
    reader.join()
    long_first = long_times[0] if long_times else None
    return {"long_tokens_asked": size, "long_prompt_tokens": (long_answer.get("usage") or {}).get("prompt_tokens",
                                                                                                  estimated),
            "long_status": long_answer.get("status"), "long_error": long_answer.get("error"),
            "long_prefill": None if long_first is None else long_first - long_answer["sent"],
            "long_read_before_short_sent": long_first is not None and long_first < short_answer["sent"],
            "short_status": short_answer.get("status"), "short_error": short_answer.get("error"),
            "short_done_before_long_first_token": bool(short_times) and long_first is not None
            and short_answer.get("ended", float("inf")) < long_first,
            "short": latencies(short_times, short_answer["sent"])}


def start_server(serve_args: list[str], out: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    if not any(arg.startswith("--request-timeout") for arg in serve_args):
        serve_args = [*serve_args, "--request-timeout", "3600"]
    log = out / "serve.log"
    with log.open("w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port), *serve_args],
                                  stdout=log_file, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1800):  # loading the default models can take minutes the first time
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=2):
                return server, base
        except OSError:
            if server.poll() is not None:
                raise SystemExit(f"the server exited: see {log}") from None
            time.sleep(1)
    server.terminate()
    raise SystemExit(f"the server did not start in 30 minutes: see {log}")


def seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def report_lines(alone: dict, runs: list[dict], args: argparse.Namespace) -> list[str]:
    lines = [f"# A short streamed request while a long prompt is read (`{args.url or 'specdecode serve'}` "
             f"{' '.join(args.serve_args)})", "",
             f"Short request: a chat message, {args.short_max_tokens} tokens (ignore_eos, temperature 0), sent "
             f"{args.lead:g} s after the long one; the long one asks for {args.long_max_tokens} tokens. Seconds; a "
             "gap is the time between two stream chunks that carry tokens.", "",
             "| long prompt (tokens) | long prefill | short TTFT | gap median | gap p90 | gap max | short done first |",
             "|---:|---:|---:|---:|---:|---:|:---:|",
             f"| none (alone) | - | {seconds(alone.get('ttft'))} | {seconds(alone.get('gap_median'))} | "
             f"{seconds(alone.get('gap_p90'))} | {seconds(alone.get('gap_max'))} | - |"]
    for run in runs:
        short = run["short"]
        note = "" if not run["long_read_before_short_sent"] else " (read before the short one was sent)"
        lines.append(f"| {run['long_prompt_tokens']}{note} | {seconds(run['long_prefill'])} | "
                     f"{seconds(short.get('ttft'))} | {seconds(short.get('gap_median'))} | "
                     f"{seconds(short.get('gap_p90'))} | {seconds(short.get('gap_max'))} | "
                     f"{'yes' if run['short_done_before_long_first_token'] else 'no'} |")
    errors = [f"- {run['long_prompt_tokens']}: long {run['long_status']} {run['long_error'] or ''}, short "
              f"{run['short_status']} {run['short_error'] or ''}" for run in runs
              if run["long_error"] or run["short_error"] or run["long_status"] != 200 or run["short_status"] != 200]
    return lines + ([""] + ["Answers that were not whole:"] + errors if errors else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--long-tokens", default="4000,32000", help="long prompt sizes, comma-separated")
    parser.add_argument("--lead", type=float, default=2.0, help="seconds between the long request and the short")
    parser.add_argument("--short-max-tokens", type=int, default=64)
    parser.add_argument("--long-max-tokens", type=int, default=8)
    parser.add_argument("--url", help="a running server to measure instead of starting one")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("serve_args", nargs="*", help="after --: more `specdecode serve` options")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    server, base = (None, args.url.rstrip("/")) if args.url else start_server(args.serve_args, args.out)
    try:
        short_request(base, 4)  # a warm-up: the first request pays for lazy set-up the others do not
        times, answer = short_request(base, args.short_max_tokens)
        alone = latencies(times, answer["sent"])
        runs = [under_long_prompt(base, int(size), args.lead, args.short_max_tokens, args.long_max_tokens)
                for size in args.long_tokens.split(",")]
    finally:
        if server is not None:
            server.terminate()
            server.wait(timeout=120)
    report = {"url": args.url, "serve_args": args.serve_args, "lead_seconds": args.lead,
              "short_max_tokens": args.short_max_tokens, "long_max_tokens": args.long_max_tokens,
              "short_alone": alone, "under_long_prompts": runs}
    write_report(args.out, "server_prefill_latency", report, report_lines(alone, runs, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
