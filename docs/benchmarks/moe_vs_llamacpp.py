"""Plain decoding of a mixture-of-experts shape against llama.cpp on the same Q4_K_M GGUF file, in one run, and what a
verify forward of 1-8 rows costs and touches.

    python docs/benchmarks/moe_vs_llamacpp.py --llama-bin DIR [--shape qwen3-30b-a3b] [--layers 8] [--rounds 3]
        --out DIR

DIR holds llama.cpp's `llama-bench` and `llama-quantize`, built from the sources llama-cpp-python 0.3.36 bundles
(`cmake -S vendor/llama.cpp -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON && cmake --build
build --target llama-bench llama-quantize -j 2`).

No weights of these models can be had offline, and their 30B parameters would not fit twice in this machine's
memory: the file holds random weights at the real widths of --shape (hidden size, heads, experts, expert width,
vocabulary) and its first --layers layers, written as float16 in llama.cpp's own layout for the architecture
(`qwen3moe`; `deepseek2` for GLM-4.7-Flash, latent attention included) tensor by tensor, then quantized by
llama.cpp's own `llama-quantize ... Q4_K_M`. Random weights cost what real ones cost per token and layer; the
routers pick experts as a random router does (evenly), while trained routers favour some experts, so a real model's
verify forwards touch fewer distinct experts than here. Both engines decode from that one file with the same
number of threads, in turns (llamacpp_runs.py), so that drift in the machine's speed falls on both.

Then ours alone: a verify forward of 1, 2, 3, 5 and 8 rows after a 64-token prompt (the median of --rounds
forwards, each over a cache rolled back to the prompt), with the distinct experts its rows touch per sparse layer;
and greedy speculative decoding against plain decoding, the target as its own draft model (random weights give
lookup drafters nothing to draft): identical or not.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from bench_files import write_report
from llamacpp_runs import alternate_rounds, speed_table

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

# Published configs (Qwen/Qwen3-30B-A3B, zai-org/GLM-4.5-Air and zai-org/GLM-4.7-Flash config.json, as
# transformers' defaults for glm4_moe and glm4_moe_lite restate the last two); only the layer count is cut (--layers).
SHAPES = {
    "qwen3-30b-a3b": {"arch": "qwen3moe", "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128,
                      "experts": 128, "used": 8, "expert_width": 768, "vocab": 151936, "layers": 48,
                      "rope_theta": 1e6, "eps": 1e-6},
    "glm-4.5-air": {"arch": "glm4moe", "hidden": 4096, "heads": 96, "kv_heads": 8, "head_dim": 128, "experts": 128,
                    "used": 8, "expert_width": 1408, "dense_width": 10944, "vocab": 151552, "layers": 46,
                    "rope_theta": 1e6, "eps": 1e-5, "scale": 1.0},
    "glm-4.7-flash": {"arch": "deepseek2", "hidden": 2048, "heads": 20, "experts": 64, "used": 4,
                      "expert_width": 1536, "dense_width": 10240, "vocab": 154880, "layers": 47, "q_lora": 768,
                      "kv_lora": 512, "nope": 192, "rope": 64, "v": 256, "scale": 1.8, "rope_theta": 1e6,
                      "eps": 1e-5},
}
F16, F32 = 1, 0  # gguf's GGMLQuantizationType values


def qwen3moe_tensors(shape: dict, layers: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(llama.cpp's name, torch shape, type) of every tensor of a qwen3moe file."""
    hidden, head, experts, width = shape["hidden"], shape["head_dim"], shape["experts"], shape["expert_width"]
    q, kv = shape["heads"] * head, shape["kv_heads"] * head
    tensors = [("token_embd.weight", (shape["vocab"], hidden), F16), ("output_norm.weight", (hidden,), F32),
               ("output.weight", (shape["vocab"], hidden), F16)]
    for i in range(layers):
        tensors += [(f"blk.{i}.{name}.weight", dims, kind) for name, dims, kind in (
            ("attn_norm", (hidden,), F32), ("attn_q", (q, hidden), F16), ("attn_k", (kv, hidden), F16),
            ("attn_v", (kv, hidden), F16), ("attn_output", (hidden, q), F16), ("attn_q_norm", (head,), F32),
            ("attn_k_norm", (head,), F32), ("ffn_norm", (hidden,), F32), ("ffn_gate_inp", (experts, hidden), F32),
            ("ffn_gate_exps", (experts, width, hidden), F16), ("ffn_up_exps", (experts, width, hidden), F16),
            ("ffn_down_exps", (experts, hidden, width), F16))]
    return tensors


def glm4moe_tensors(shape: dict, layers: int, mtp: int = 0) -> list[tuple[str, tuple[int, ...], int]]:
    """(llama.cpp's name, torch shape, type) of every tensor of a glm4moe file (GLM-4.5-Air's layout: q, k and v
    biases, no q/k norms, the first layer dense, one shared expert, the selection bias), and its `mtp` MTP layers
    after the trunk's: a sparse block with the nextn tensors (conversion/glm.py keeps them; the embedding and the
    head are the trunk's)."""
    hidden, head = shape["hidden"], shape["head_dim"]
    q, kv = shape["heads"] * head, shape["kv_heads"] * head
    tensors = [("token_embd.weight", (shape["vocab"], hidden), F16), ("output_norm.weight", (hidden,), F32),
               ("output.weight", (shape["vocab"], hidden), F16)]
    for i in range(layers + mtp):
        block = [("attn_norm.weight", (hidden,), F32), ("attn_q.weight", (q, hidden), F16), ("attn_q.bias", (q,), F32),
                 ("attn_k.weight", (kv, hidden), F16), ("attn_k.bias", (kv,), F32),
                 ("attn_v.weight", (kv, hidden), F16), ("attn_v.bias", (kv,), F32),
                 ("attn_output.weight", (hidden, q), F16), ("post_attention_norm.weight", (hidden,), F32)]
        block += dense_ffn(shape) if i == 0 else sparse_ffn(shape)
        if i >= layers:
            block += [("nextn.eh_proj.weight", (hidden, 2 * hidden), F16), ("nextn.enorm.weight", (hidden,), F32),
                      ("nextn.hnorm.weight", (hidden,), F32), ("nextn.shared_head_norm.weight", (hidden,), F32)]
        tensors += [(f"blk.{i}.{name}", dims, kind) for name, dims, kind in block]
    return tensors


def dense_ffn(shape: dict) -> list[tuple[str, tuple[int, ...], int]]:
    """A leading dense layer's MLP (GLM's files)."""
    hidden, dense = shape["hidden"], shape["dense_width"]
    return [("ffn_gate.weight", (dense, hidden), F16), ("ffn_up.weight", (dense, hidden), F16),
            ("ffn_down.weight", (hidden, dense), F16)]


def sparse_ffn(shape: dict) -> list[tuple[str, tuple[int, ...], int]]:
    """A sparse layer's router, selection bias, experts and one shared expert (GLM's files)."""
    hidden, experts, width = shape["hidden"], shape["experts"], shape["expert_width"]
    return [("ffn_gate_inp.weight", (experts, hidden), F32), ("exp_probs_b.bias", (experts,), F32),
            ("ffn_gate_exps.weight", (experts, width, hidden), F16),
            ("ffn_up_exps.weight", (experts, width, hidden), F16),
            ("ffn_down_exps.weight", (experts, hidden, width), F16),
            ("ffn_gate_shexp.weight", (width, hidden), F16), ("ffn_up_shexp.weight", (width, hidden), F16),
            ("ffn_down_shexp.weight", (hidden, width), F16)]


def deepseek2_tensors(shape: dict, layers: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(llama.cpp's name, torch shape, type) of every tensor of a deepseek2 file (GLM-4.7-Flash's layout: the
    first layer dense, kv_b split into attn_k_b [nh, C, nope] and attn_v_b [nh, v, C])."""
    hidden, heads = shape["hidden"], shape["heads"]
    nope, rope, v, latent, q_lora = shape["nope"], shape["rope"], shape["v"], shape["kv_lora"], shape["q_lora"]
    tensors = [("token_embd.weight", (shape["vocab"], hidden), F16), ("output_norm.weight", (hidden,), F32),
               ("output.weight", (shape["vocab"], hidden), F16)]
    for i in range(layers):
        block = [("attn_norm.weight", (hidden,), F32), ("attn_q_a.weight", (q_lora, hidden), F16),
                 ("attn_q_a_norm.weight", (q_lora,), F32), ("attn_q_b.weight", (heads * (nope + rope), q_lora), F16),
                 ("attn_kv_a_mqa.weight", (latent + rope, hidden), F16), ("attn_kv_a_norm.weight", (latent,), F32),
                 ("attn_k_b.weight", (heads, latent, nope), F16), ("attn_v_b.weight", (heads, v, latent), F16),
                 ("attn_output.weight", (hidden, heads * v), F16), ("ffn_norm.weight", (hidden,), F32)]
        block += dense_ffn(shape) if i == 0 else sparse_ffn(shape)
        tensors += [(f"blk.{i}.{name}", dims, kind) for name, dims, kind in block]
    return tensors


def add_metadata(writer, shape: dict, layers: int) -> None:
    """The keys llama.cpp's converter writes for the architecture (conversion/qwen.py, glm.py, deepseek.py)."""
    writer.add_context_length(4096)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(layers)
    writer.add_head_count(shape["heads"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_expert_count(shape["experts"])
    writer.add_expert_used_count(shape["used"])
    writer.add_expert_feed_forward_length(shape["expert_width"])
    if shape["arch"] == "qwen3moe":
        writer.add_feed_forward_length(6144)
        writer.add_head_count_kv(shape["kv_heads"])
        writer.add_key_length(shape["head_dim"])
        writer.add_value_length(shape["head_dim"])
        return
    import gguf

    writer.add_feed_forward_length(shape["dense_width"])
    writer.add_leading_dense_block_count(1)
    writer.add_expert_shared_count(1)
    writer.add_expert_weights_scale(shape["scale"])
    writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(1)
    writer.add_expert_group_used_count(1)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if shape["arch"] == "glm4moe":  # conversion/glm.py: half of each head rotated
        writer.add_head_count_kv(shape["kv_heads"])
        writer.add_key_length(shape["head_dim"])
        writer.add_value_length(shape["head_dim"])
        writer.add_rope_dimension_count(shape["head_dim"] // 2)
        return
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(shape["rope"])
    writer.add_q_lora_rank(shape["q_lora"])
    writer.add_kv_lora_rank(shape["kv_lora"])
    writer.add_key_length(shape["kv_lora"] + shape["rope"])
    writer.add_value_length(shape["kv_lora"])
    writer.add_key_length_mla(shape["nope"] + shape["rope"])
    writer.add_value_length_mla(shape["v"])


def write_random_gguf(path: Path, shape: dict, layers: int, mtp: int = 0) -> None:
    """A float16 file of random weights, written a tensor at a time (a whole 30B-wide layer's experts in float32
    would be 2.4 GB): N(0, 1/columns) matrices, norms near 1, the selection bias near 0; `mtp` MTP layers after
    the trunk's (glm4moe only)."""
    import gguf
    from gguf_files import add_vocabulary

    if mtp:
        tensors = glm4moe_tensors(shape, layers, mtp)
    else:
        tensors = {"qwen3moe": qwen3moe_tensors, "glm4moe": glm4moe_tensors, "deepseek2": deepseek2_tensors}[
            shape["arch"]](shape, layers)
    writer = gguf.GGUFWriter(str(path), shape["arch"])
    add_metadata(writer, shape, layers + mtp)
    if mtp:
        writer.add_nextn_predict_layers(mtp)
    add_vocabulary(writer, shape["vocab"], "qwen2")
    for name, dims, kind in tensors:
        dtype = np.dtype(np.float16 if kind == F16 else np.float32)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize,
                               raw_dtype=gguf.GGMLQuantizationType(kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    for name, dims, kind in tensors:
        if len(dims) == 1:
            data = (rng.random(dims, dtype=np.float32) * 0.1 + (0.95 if name.endswith("norm.weight") else 0.0))
        else:
            data = rng.standard_normal(dims, dtype=np.float32) * np.float32(dims[-1] ** -0.5)
        writer.write_tensor_data(data.astype(np.float16) if kind == F16 else data)
    writer.close()


def quantized_file(shape_name: str, layers: int, work: Path, bin_dir: Path, mtp: int = 0) -> Path:
    """The random float16 file, then llama-quantize's Q4_K_M of it (each made once; the float16 one removed)."""
    work.mkdir(parents=True, exist_ok=True)
    stem = f"{shape_name}-{layers}l{f'-mtp{mtp}' if mtp else ''}"
    f16, q4 = work / f"{stem}-f16.gguf", work / f"{stem}-Q4_K_M.gguf"
    if not q4.is_file():
        if not f16.is_file():
            write_random_gguf(f16, SHAPES[shape_name], layers, mtp)
        subprocess.run([str(bin_dir / "llama-quantize"), str(f16), str(q4), "Q4_K_M", str(torch.get_num_threads())],
                       check=True, stdout=subprocess.DEVNULL)
        f16.unlink()
    return q4


def verify_costs(model, rounds: int) -> dict:
    """rows -> (median seconds of a forward of that many rows after a 64-token prompt, mean distinct experts its
    rows touch per sparse layer, as the blocks count them while they run: ExpertTally)."""
    from specdecode.models.decoder.moe import ExpertTally

    tally = ExpertTally.of(model)
    prompt = torch.randint(0, model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))  # [1, 64]
    results = {}
    for rows in (1, 2, 3, 5, 8):
        cache = model.new_cache(64 + rows)
        with torch.inference_mode():
            model(prompt, torch.arange(64).unsqueeze(0), cache)
            seconds, experts = [], []
            for round_ in range(rounds + 1):  # the first forward of each width is a warm-up
                seeded = torch.Generator().manual_seed(round_)
                tokens = torch.randint(0, model.config.vocab_size, (1, rows), generator=seeded)  # [1, rows]
                positions = torch.arange(64, 64 + rows).unsqueeze(0)  # [1, rows]
                began = time.perf_counter()
                model(tokens, positions, cache)
                if round_:
                    seconds.append(time.perf_counter() - began)
                    experts.append(tally.last())
                cache.truncate(64)
        results[rows] = (statistics.median(seconds), statistics.mean(experts))
        print(f"verify {rows} rows: {results[rows][0] * 1000:.1f} ms, {results[rows][1]:.1f} experts a layer",
              flush=True)
    return results


def speculation_identical(engine, tokens: int) -> dict:
    """Greedy speculative decoding (the target drafting for itself, chains of 3) against plain decoding."""
    from specdecode import SamplingParams, SpecConfig

    prompt = [300, 301, 302, 303] * 8
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    plain = engine.complete(prompt, sampling, SpecConfig("none")).token_ids
    result = engine.complete(prompt, sampling, SpecConfig("draft", num_draft_tokens=3, guard=False, adaptive=False))
    return {"identical": result.token_ids == plain, "drafted": result.stats.drafted_tokens,
            "accepted": result.stats.accepted_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-bin", type=Path, required=True, help="folder with llama-bench and llama-quantize")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--layers", type=int, default=8, help="how many of the shape's layers the file holds")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens of the prefill measurement")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=Path("/tmp/specdecode-moe"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from specdecode import Engine, SamplingParams, load_model

    model_file = quantized_file(args.shape, args.layers, args.work, args.llama_bin)
    threads = torch.get_num_threads()
    loaded = load_model(model_file, dtype="auto", quant="auto")
    engine = Engine(loaded, loaded)  # the target as its own draft model (speculation_identical)
    engine.complete([300], SamplingParams(max_tokens=8, ignore_eos=True))  # warm up
    runs = alternate_rounds(engine, args.llama_bin, model_file, args.rounds, args.tokens, args.prompt)
    costs = verify_costs(loaded.model, args.rounds)
    identity = speculation_identical(engine, 32)
    size = model_file.stat().st_size
    result = {"shape": args.shape, "layers": args.layers, "of_layers": SHAPES[args.shape]["layers"],
              "file": model_file.name, "bytes": size, "threads": threads, "our_quant": loaded.quant,
              "tokens": args.tokens, "prompt": args.prompt, "runs": runs,
              "verify": {rows: {"seconds": s, "experts_per_layer": e} for rows, (s, e) in costs.items()},
              "speculation": identity}
    one_row = costs[1][0]
    lines = [(f"# {args.shape} widths, {args.layers} of {SHAPES[args.shape]['layers']} layers, random weights, "
              f"{model_file.name} ({size / 2**20:.0f} MiB), {threads} threads"), "",
             *speed_table(runs, args.tokens, args.prompt), "",
             "| verify rows | ms (ours) | x one row | distinct experts a sparse layer |", "|---:|---:|---:|---:|",
             *[f"| {rows} | {s * 1000:.1f} | {s / one_row:.2f} | {e:.1f} |" for rows, (s, e) in costs.items()], "",
             (f"ours loaded as {loaded.quant}; greedy speculation (the target as its own draft, chains of 3) against "
             f"plain decoding, 32 tokens: {'identical' if identity['identical'] else 'DIFFERS'} "
             f"({identity['accepted']}/{identity['drafted']} drafts accepted)")]
    write_report(args.out, f"moe-vs-llamacpp-{args.shape}", result, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
