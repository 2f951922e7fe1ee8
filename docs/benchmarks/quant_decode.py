"""Plain decode speed of the default models in bf16 / int8 / int4, and `draft` with a quantized draft.

Run from the repository root: python docs/benchmarks/quant_decode.py
Decode-only tokens/s (prefill excluded), greedy, 96 new tokens on the first 3 HumanEval prompts.
"""

import json, time
import torch
from specdecode import Engine, SamplingParams, SpecConfig, load_model
qs = [json.loads(l) for l in open("../shared/data/humaneval/humaneval_specbench_format.jsonl")][:3]
prompts = [q["turns"][0] for q in qs]
sp = SamplingParams(max_tokens=96)
def run(engine, spec):
    toks = secs = 0; acc = dr = 0
    for p in prompts:
        r = engine.complete(p, sp, spec); toks += r.stats.new_tokens - 1; secs += r.stats.total_seconds - r.stats.prefill_seconds
        acc += r.stats.accepted_tokens; dr += r.stats.drafted_tokens
    return toks / secs, acc / max(dr, 1)
for name in ["qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct"]:
    for q in ["none", "int8", "int4"]:
        m = load_model(name, quiet=True, quant=q)
        e = Engine(m); e.complete(prompts[0], SamplingParams(max_tokens=4), SpecConfig("none"))
        print(f"{name} {q}: plain decode {run(e, SpecConfig('none'))[0]:.2f} tok/s", flush=True)
        del m, e
target = load_model("qwen2.5-coder-1.5b-instruct", quiet=True)
for dq in ["none", "int8", "int4"]:
    draft = load_model("qwen2.5-coder-0.5b-instruct", quiet=True, quant=dq)
    e = Engine(target, draft); e.complete(prompts[0], SamplingParams(max_tokens=8), SpecConfig("draft"))
    plain, _ = run(e, SpecConfig("none")); spec, acc = run(e, SpecConfig("draft"))
    print(f"bf16 target, draft {dq}: plain {plain:.2f}, draft {spec:.2f} tok/s = {spec/plain:.2f}x, acceptance {acc:.1%}", flush=True)
