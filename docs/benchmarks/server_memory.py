"""The server's resident memory at start, under long requests, and idle afterwards (issue #48).

    python docs/benchmarks/server_memory.py [--requests 8] [--max-tokens 32000] [--seconds 60] --out DIR
        [-- SERVE_ARGS...]

Starts `specdecode serve` with its defaults (plus SERVE_ARGS), reads the KV budget it prints, and samples the
server process's resident memory (VmRSS, every 0.2 s). Then N clients each stream one chat request asking for
`--max-tokens` tokens at once, for `--seconds`, and hang up (as a client that has read enough does); the server
is then left idle for 15 s. Reported: memory at start, its peak under the requests, memory idle afterwards, the
tokens each request streamed, and what the server answered (200, or its refusal with the reason).
"""

from __future__ import annotations

import argparse
import http.client
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from bench_files import write_report


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def resident_gib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return 0.0


class Sampler(threading.Thread):
    """The process's resident memory every 0.2 s; peak() since the last mark()."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.wait(0.2):
            self.samples.append((time.monotonic(), resident_gib(self.pid)))

    def peak(self, since: float) -> float:
        return max((gib for at, gib in self.samples if at >= since), default=0.0)


def stream_for(port: int, model: str, max_tokens: int, seconds: float, index: int, results: list) -> None:
    """One client: a streamed chat request read for `seconds`, then the connection dropped."""
    body = json.dumps({"model": model, "stream": True, "max_tokens": max_tokens, "messages": [
        {"role": "user", "content": f"Write a very long story about lighthouse number {index}, chapter by chapter."}]})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=seconds + 600)
    began, chunks = time.monotonic(), 0
    try:
        connection.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            results[index] = {"status": response.status, "answer": response.read().decode()[:300]}
            return
        while time.monotonic() - began < seconds:
            line = response.readline()
            if not line:
                break
            chunks += line.startswith(b"data: {")
        results[index] = {"status": 200, "chunks": chunks, "seconds": time.monotonic() - began}
    finally:
        connection.close()  # hang up: the server must let the request go


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32000)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("serve_args", nargs="*", help="after --: more `specdecode serve` options")
    args = parser.parse_args()
    port = free_port()
    log = args.out / "serve.log"
    args.out.mkdir(parents=True, exist_ok=True)
    with log.open("w") as log_file:
        server = subprocess.Popen([sys.executable, "-m", "specdecode.cli", "serve", "--port", str(port),
                                   *args.serve_args], stdout=log_file, stderr=subprocess.STDOUT)
    try:
        for _ in range(1800):  # loading the default models can take minutes the first time
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as answer:
                    model = json.load(answer)["data"][0]["id"]
                break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"the server exited: see {log}")
                time.sleep(1)
        sampler = Sampler(server.pid)
        sampler.start()
        time.sleep(5)
        start = resident_gib(server.pid)
        began = time.monotonic()
        results: list = [None] * args.requests
        clients = [threading.Thread(target=stream_for, args=(port, model, args.max_tokens, args.seconds, i, results))
                   for i in range(args.requests)]
        for client in clients:
            client.start()
        for client in clients:
            client.join()
        under_load = sampler.peak(began)
        time.sleep(15)
        idle = resident_gib(server.pid)
        sampler.stop.set()
    finally:
        server.terminate()
        server.wait(timeout=60)
    budget = [line for line in log.read_text().splitlines() if "KV" in line or "kv" in line]
    report = {"requests": args.requests, "max_tokens": args.max_tokens, "seconds": args.seconds,
              "serve_args": args.serve_args, "resident_gib": {"start": start, "peak_under_requests": under_load,
                                                               "idle_after": idle},
              "budget_lines": budget, "results": results}
    lines = [(f"# Server memory: {args.requests} streamed requests of max_tokens {args.max_tokens}, read for "
             f"{args.seconds:.0f} s, then dropped"), "", *[f"    {line}" for line in budget], "",
             "| when | resident GiB |", "|---|---:|", f"| at start, idle | {start:.2f} |",
             f"| peak under the requests | {under_load:.2f} |", f"| idle 15 s after they were dropped | {idle:.2f} |",
             "", "| request | status | chunks streamed |", "|---:|---:|---:|"]
    lines += [f"| {i} | {r['status']} | {r.get('chunks', r.get('answer', ''))} |" for i, r in enumerate(results)]
    write_report(args.out, "server_memory", report, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
