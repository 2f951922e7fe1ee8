"""Gemma 4 e2b's shape against llama.cpp on the same Q4_K_M GGUF file, in one run; its assistant's cost.

    python docs/benchmarks/gemma_vs_llamacpp.py --llama-bin DIR [--rounds 3] --out DIR

DIR holds llama.cpp's `llama-bench` and `llama-quantize` (hybrid_vs_llamacpp.py says how they were built; the
llama.cpp llama-cpp-python 0.3.36 bundles has the gemma4 architecture).

No Gemma 4 weights can be had offline, so random weights of google/gemma-4-E2B-it's text shape (35 layers of
1536, 8 query heads and 1 KV head of 256 in sliding layers and 512 in full ones, every fifth layer full, the last
20 layers KV-shared with a double-wide MLP, per-layer embeddings of 256, 262,144 tokens) are written as a
float16 GGUF in llama.cpp's gemma4 layout (tests/gguf_gemma4_files.gemma4_header, as its converter writes
one) and quantized by llama.cpp's own `llama-quantize ... Q4_K_M`. Both engines then read that one file with the same
threads, in turns (llamacpp_runs.py: decode after a one-token prompt, and a
prompt's prefill).

Then, on our side:
- greedy speculation against plain decoding: the target as its own draft model (every draft accepted, each
  verify row bitwise its one-row forward) and its random assistant (`mtp`): identical or not;
- the assistant's cost: random weights of google/gemma-4-E2B-it-assistant's shape (4 layers of 256, the
  centroid head over 2048 clusters, top 32) in transformers' layout, in w4a8 as `--draft-quant auto` loads it:
  its seconds per drafted token over a plain decoding step's.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_files import write_report
from llamacpp_runs import alternate_rounds, speed_table

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

LAYERS = 35
E2B = {"model_type": "gemma4_text", "vocab_size": 262144, "hidden_size": 1536, "intermediate_size": 6144,
       "num_hidden_layers": LAYERS, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
       "global_head_dim": 512, "sliding_window": 512, "num_kv_shared_layers": 20, "use_double_wide_mlp": True,
       "hidden_size_per_layer_input": 256, "vocab_size_per_layer_input": 262144, "attention_k_eq_v": False,
       "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
       "tie_word_embeddings": True, "hidden_activation": "gelu_pytorch_tanh",
       "layer_types": ["full_attention" if (i + 1) % 5 == 0 else "sliding_attention" for i in range(LAYERS)],
       "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                           "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                              "rope_theta": 1000000.0}}}
E2B_ASSISTANT = {"hidden_size": 256, "intermediate_size": 2048, "num_hidden_layers": 4, "num_attention_heads": 4,
                 "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512, "num_kv_shared_layers": 4,
                 "layer_types": ["sliding_attention"] * 3 + ["full_attention"], "hidden_size_per_layer_input": 0,
                 "vocab_size_per_layer_input": 0, "use_double_wide_mlp": False, "final_logit_softcapping": None}


def random_f16(shape: tuple[int, ...], rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """Normal(0, scale) as float16, made a block of rows at a time (the per-layer table is 2.3 billion values)."""
    out = np.empty(shape, dtype=np.float16)
    step = max(1, (1 << 24) // max(1, int(np.prod(shape[1:]))))
    for start in range(0, shape[0], step):
        block = rng.standard_normal((min(step, shape[0] - start), *shape[1:]), dtype=np.float32)
        out[start : start + step] = block * scale
    return out


def write_random_gguf(path: Path) -> None:
    """The e2b shape with random weights as a float16 gemma4 GGUF (norms and layer scalars 1, float32), each
    tensor written to a temporary file as it is made, so memory holds one at a time."""
    import gguf
    from gguf_gemma4_files import gemma4_gguf_name, gemma4_header

    from specdecode.models.families import config_from_hf
    from specdecode.models.families.gemma4.tensors import gemma_shapes, gemma_sources

    config = config_from_hf(E2B)
    shapes = gemma_shapes(config)
    needed = sorted({name for names in gemma_sources(config).values() for name in names})
    writer = gguf.GGUFWriter(str(path), "gemma4", use_temp_file=True)
    gemma4_header(writer, E2B)
    rng = np.random.default_rng(0)
    for name in needed:
        shape = shapes[name]
        if len(shape) == 1:
            writer.add_tensor(gemma4_gguf_name(name), np.ones(shape, dtype=np.float32))
        else:
            writer.add_tensor(gemma4_gguf_name(name), random_f16(shape, rng))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def quantized_file(work: Path, bin_dir: Path) -> Path:
    f16, q4 = work / "gemma4-e2b-f16.gguf", work / "gemma4-e2b-Q4_K_M.gguf"
    if not q4.is_file():
        if not f16.is_file():
            write_random_gguf(f16)
        subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(q4), "Q4_K_M", str(torch.get_num_threads())],
                       check=True, stdout=subprocess.DEVNULL)
        f16.unlink()  # 10 GB, no longer needed
    return q4


def write_random_assistant(folder: Path) -> Path:
    """google/gemma-4-E2B-it-assistant's shape, random, in transformers' layout (its own Gemma4AssistantForCausalLM
    writes it)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    if (folder / "config.json").is_file():
        return folder
    text = Gemma4TextConfig(**{**{k: v for k, v in E2B.items() if k != "model_type"}, **E2B_ASSISTANT})
    config = Gemma4AssistantConfig(text_config=text.to_dict(), backbone_hidden_size=E2B["hidden_size"],
                                   use_ordered_embeddings=True, num_centroids=2048, centroid_intermediate_top_k=32)
    torch.manual_seed(0)
    model = Gemma4AssistantForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02) if param.dim() > 1 else param.fill_(1.0)
        model.masked_embedding.token_ordering.copy_(torch.randperm(E2B["vocab_size"]))
    model.to(torch.bfloat16).save_pretrained(str(folder))
    return folder


def speculation(engine, tokens: int) -> dict:
    """Greedy speculation against plain decoding: the target drafting for itself (chains of 3) and its assistant
    (chains of 3): identical or not, drafts accepted, and the drafter's seconds per drafted token."""
    from specdecode import SamplingParams, SpecConfig

    prompt = [300, 301, 302, 303] * 8
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    plain = engine.complete(prompt, sampling, SpecConfig("none"))
    step = (plain.stats.total_seconds - plain.stats.prefill_seconds) / max(1, len(plain.token_ids) - 1)
    results = {"plain_step_seconds": step}
    for method in ("draft", "mtp"):
        result = engine.complete(prompt, sampling, SpecConfig(method, num_draft_tokens=3, guard=False,
                                                              adaptive=False))
        stats = result.stats
        per_token = stats.draft_seconds / max(1, stats.drafted_tokens)
        results[method] = {"identical": result.token_ids == plain.token_ids, "drafted": stats.drafted_tokens,
                           "accepted": stats.accepted_tokens, "draft_seconds_per_token": per_token,
                           "share_of_a_plain_step": per_token / step}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-bench and llama-quantize")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens of the prefill measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specdecode-gemma4"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from specdecode import Engine, SamplingParams, load_model

    args.work.mkdir(parents=True, exist_ok=True)
    model_file = quantized_file(args.work, args.llama_bin)
    assistant = write_random_assistant(args.work / "gemma4-e2b-assistant")
    threads = torch.get_num_threads()
    began = time.perf_counter()
    loaded = load_model(model_file, dtype="auto", quant="auto")
    load_seconds = time.perf_counter() - began
    engine = Engine(loaded, loaded, draft_path=str(assistant), draft_quant="w4a8")
    engine.complete([300], SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    runs = alternate_rounds(engine, args.llama_bin, model_file, args.rounds, args.tokens, args.prompt)
    spec = speculation(engine, 64)
    result = {"shape": "gemma-4-e2b", "file": model_file.name, "bytes": model_file.stat().st_size, "threads": threads,
              "our_quant": loaded.quant, "load_seconds": load_seconds, "tokens": args.tokens, "prompt": args.prompt,
              "runs": runs, "speculation": spec}
    lines = [(f"# Gemma 4 e2b shape, random weights, {model_file.name} ({model_file.stat().st_size / 2**20:.0f} MiB), "
              f"{threads} threads"), "",
             *speed_table(runs, args.tokens, args.prompt)]
    lines += ["", (f"ours loaded as {loaded.quant} (first load, building the cached copy: {load_seconds:.0f} s); "
                   "greedy speculation against plain decoding, 64 tokens, chains of 3:")]
    for method in ("draft", "mtp"):
        r = spec[method]
        lines.append(f"- {method}: {'identical' if r['identical'] else 'DIFFERS'}, {r['accepted']}/{r['drafted']} "
                     f"drafts accepted, {r['draft_seconds_per_token'] * 1000:.1f} ms a drafted token = "
                     f"{r['share_of_a_plain_step']:.3f} of a plain step ({spec['plain_step_seconds'] * 1000:.1f} ms)")
    write_report(args.out, "gemma4-e2b-vs-llamacpp", result, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
