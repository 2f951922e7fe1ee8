"""Two-turn chats through OpenAI-compatible servers: how soon the second turn's first token comes when the server
keeps the first turn's keys and values (a prompt cache) and when it reads the whole conversation again.

Run from the repository root against servers already started (about 2 minutes per peer on 2 cores):

    python docs/benchmarks/multi_turn.py --peer NAME=URL[,cache=off][,spec=METHOD] [--peer ...] [--conversations 8]
        [--max-tokens 128] [--out DIR]

Each peer gets MT-bench's first N conversations one at a time (greedy, streamed): turn 1, then turn 2 with turn
1's answer in the messages, as a chat client sends it. `cache=off` sends `"cache_prompt": false` (ours and
llama.cpp's server then read every prompt whole); otherwise the field is `true`. `spec=METHOD` asks our server for
a speculative method per request (a draft model's own prompt read then counts too). Reported per peer: time to first
token of each turn (median and mean), the second turn's prompt tokens and how many came from the cache (ours:
`usage.prompt_tokens_details.cached_tokens`, llama.cpp: `timings.cache_n`). Peers that are the same model
decoding greedily should answer alike: the report counts second-turn answers equal to the first peer's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import urllib.request
from pathlib import Path

from specdecode.bench.datasets import load_questions
from specdecode.bench.openai_peer import stream_chat

DATASET = "../shared/data/mt_bench/question.jsonl"


def cached_tokens(info: dict) -> int | None:
    """Prompt tokens the server says it took from its cache (ours in usage, llama.cpp in timings)."""
    details = (info.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" in details:
        return details["cached_tokens"]
    return (info.get("timings") or {}).get("cache_n")


def served_model(url: str) -> str:
    """The first model id the server lists (ours answers 404 to any other)."""
    with urllib.request.urlopen(f"{url}/v1/models", timeout=30) as response:
        return json.load(response)["data"][0]["id"]


def chat(url: str, model: str, messages: list[dict], max_tokens: int, cache: bool,
         method: str | None) -> tuple[str, dict]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "cache_prompt": cache}
    if method:
        body["speculative"] = {"method": method}
    return stream_chat(f"{url}/v1/chat/completions", body)


def run_peer(url: str, conversations: list[list[str]], max_tokens: int, cache: bool,
             method: str | None) -> list[dict]:
    """-> per conversation: each turn's time to first token, the second turn's prompt and cached tokens, answers."""
    rows, model = [], served_model(url)
    for turns in conversations:
        first_answer, first = chat(url, model, [{"role": "user", "content": turns[0]}], max_tokens, cache, method)
        messages = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first_answer},
                    {"role": "user", "content": turns[1]}]
        second_answer, second = chat(url, model, messages, max_tokens, cache, method)
        rows.append({"ttft_1": first["time_to_first_token"], "ttft_2": second["time_to_first_token"],
                     "prompt_2": (second.get("usage") or {}).get("prompt_tokens"),
                     "cached_2": cached_tokens(second), "answers": [first_answer, second_answer]})
        print(f"  turn 1 {rows[-1]['ttft_1']:.2f} s, turn 2 {rows[-1]['ttft_2']:.2f} s "
              f"({rows[-1]['cached_2']} of {rows[-1]['prompt_2']} prompt tokens cached)", file=sys.stderr)
    return rows


def report(results: dict[str, list[dict]]) -> str:
    reference = next(iter(results.values()))
    lines = ["| peer | TTFT turn 1 p50 / mean (s) | TTFT turn 2 p50 / mean (s) | turn 2 prompt tokens (mean) | "
             "of them cached (mean) | turn 2 answers equal to the first peer's |", "|---|---|---|---|---|---|"]
    for name, rows in results.items():
        ttft = {turn: [row[f"ttft_{turn}"] for row in rows] for turn in (1, 2)}
        prompts = [row["prompt_2"] for row in rows if row["prompt_2"] is not None]
        cached = [row["cached_2"] for row in rows if row["cached_2"] is not None]
        equal = sum(row["answers"][1] == ref["answers"][1] for row, ref in zip(rows, reference))
        lines.append(f"| {name} | {statistics.median(ttft[1]):.2f} / {statistics.mean(ttft[1]):.2f} | "
                     f"{statistics.median(ttft[2]):.2f} / {statistics.mean(ttft[2]):.2f} | "
                     f"{statistics.mean(prompts) if prompts else float('nan'):.0f} | "
                     f"{statistics.mean(cached) if cached else float('nan'):.0f} | {equal}/{len(rows)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", action="append", required=True, help="NAME=URL[,cache=off][,spec=METHOD]")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dataset", default=DATASET)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    conversations = [list(question.turns[:2]) for question in load_questions([args.dataset], limit=args.conversations)]
    results = {}
    for peer in args.peer:
        name, _, rest = peer.partition("=")
        url, *flags = rest.split(",")
        print(f"{name}: {url}", file=sys.stderr)
        method = next((flag.removeprefix("spec=") for flag in flags if flag.startswith("spec=")), None)
        results[name] = run_peer(url.rstrip("/"), conversations, args.max_tokens, "cache=off" not in flags, method)
    table = report(results)
    print(table)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(results, indent=1))
        (args.out / "report.md").write_text(table + "\n")


if __name__ == "__main__":
    main()
