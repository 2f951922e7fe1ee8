"""The CUDA path measured on random weights of the default target's shape, in one run; where no GPU is present it
runs what a CPU allows and says what it left out. docs/benchmarks/gpu_check.sh runs tests/engine/test_device.py first.

    python docs/benchmarks/gpu_check.py --out DIR [--device auto] [--shape 1.5b] [--quick]

No weights travel to a GPU machine, so the target is the 1.5B default's shape (Qwen2.5-Coder-1.5B: 28 layers,
hidden 1536, 12 heads / 2 KV heads of 128, MLP 8960, vocabulary 151,936, tied embeddings) with random bf16
weights, written once under --work and loaded like any model. Every number is measured in this run, on one device:

- plain decoding: tokens/s of Engine.complete, 128 tokens after a 64-token prompt;
- the verify forward by rows: a forward of M new rows after a 256-token context, against one row (M = 1 to 64);
- row invariance: the largest difference between a row's logits in a forward of M rows and the same token's
  logits decoded one row at a time (0 means bitwise: speculation cannot change a greedy token), and whether the
  argmax agreed;
- the engine's own share of a decoding step: plain steps timed whole, the target's forwards inside them timed
  between device synchronisations; the rest is Python, sampling and cache bookkeeping;
- batched plain decoding: aggregate tokens/s of Engine.step_many over N requests, N = 1 to 64;
- what `specdecode train eagle3 --device D` runs on this target, phase by phase: the target's features and the
  head's training (its defaults), each in tokens/s.

It writes gpu_check.json and gpu_check.md into --out. Timings synchronise the device before reading the clock.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from bench_files import save_model_folder, write_report

SHAPES = {  # Qwen2 configurations; "1.5b" is the default target's
    "1.5b": {"hidden_size": 1536, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
             "intermediate_size": 8960, "vocab_size": 151936},
    "0.5b": {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
             "intermediate_size": 4864, "vocab_size": 151936},
    "tiny": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "intermediate_size": 512, "vocab_size": 4096},
}
FULL = {"rows": (1, 2, 4, 8, 16, 32, 64), "batches": (1, 2, 4, 8, 16, 32, 64), "tokens": 128, "train_tokens": 20000}
QUICK = {"rows": (1, 2, 4, 8, 16), "batches": (1, 2, 4, 8), "tokens": 32, "train_tokens": 1500}


def write_random(folder: Path, shape: dict) -> Path:
    """A random Qwen2 model of `shape` in bf16 with a byte tokenizer (written once; nothing here decodes text)."""
    if (folder / "config.json").is_file():
        return folder
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "rms_norm_eps": 1e-6,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "tie_word_embeddings": True,
              "eos_token_id": 257, "bos_token_id": 256, "torch_dtype": "bfloat16", **shape}
    hidden, inner, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    head_dim = hidden // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    generator = torch.Generator().manual_seed(0)

    def random(*dims: int) -> torch.Tensor:
        spread = 1.0 / dims[-1] ** 0.5 if len(dims) > 1 else 0.02
        return (torch.randn(dims, generator=generator) * spread).to(torch.bfloat16)

    tensors = {"model.embed_tokens.weight": random(shape["vocab_size"], hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    for i in range(layers):
        prefix = f"model.layers.{i}."
        shapes = {"self_attn.q_proj.weight": (hidden, hidden), "self_attn.q_proj.bias": (hidden,),
                  "self_attn.k_proj.weight": (kv, hidden), "self_attn.k_proj.bias": (kv,),
                  "self_attn.v_proj.weight": (kv, hidden), "self_attn.v_proj.bias": (kv,),
                  "self_attn.o_proj.weight": (hidden, hidden), "mlp.gate_proj.weight": (inner, hidden),
                  "mlp.up_proj.weight": (inner, hidden), "mlp.down_proj.weight": (hidden, inner)}
        tensors.update({prefix + name: random(*dims) for name, dims in shapes.items()})
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            tensors[prefix + norm] = torch.ones(hidden, dtype=torch.bfloat16)
    return save_model_folder(folder, config, tensors)


class Clock:
    """Seconds on the device: the device is synchronised before the clock is read, so queued kernels count."""

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def __call__(self) -> float:
        self.sync()
        return time.perf_counter()


def random_ids(count: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(300, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@torch.inference_mode()
def verify_costs(model, rows_tried, clock: Clock, rounds: int, context: int = 256) -> dict:
    """Median seconds of a forward of M new rows after `context` cached tokens, and the row invariance of its
    logits against the same tokens decoded one row at a time."""
    device, vocab = model.device, model.config.vocab_size
    prompt = torch.tensor([random_ids(context, vocab, 1)], device=device)  # [1, C]
    positions = torch.arange(context, device=device).unsqueeze(0)  # [1, C]
    most = max(rows_tried)
    tokens = torch.tensor([random_ids(most, vocab, 2)], device=device)  # [1, most]
    cache = model.new_cache(context + most)
    model(prompt, positions, cache)
    one_by_one = []  # the reference: each token's logits decoded alone, [V] each
    for i in range(most):
        one_by_one.append(model(tokens[:, i:i + 1], torch.tensor([[context + i]], device=device), cache).logits[0, -1])
    reference = torch.stack(one_by_one).float()  # [most, V]
    results = {}
    for rows in rows_tried:
        times, logits = [], None
        for _ in range(rounds):
            cache.truncate(context)  # back to the context alone
            began = clock()
            logits = model(tokens[:, :rows], torch.arange(context, context + rows, device=device).unsqueeze(0),
                           cache).logits[0].float()  # [rows, V]
            times.append(clock() - began)
        difference = (logits - reference[:rows]).abs().max().item()
        same_argmax = bool(torch.equal(logits.argmax(-1), reference[:rows].argmax(-1)))
        results[rows] = {"seconds": statistics.median(times), "max_logit_difference": difference,
                         "argmax_equal": same_argmax}
    return results


def decoding(engine, tokens: int, clock: Clock) -> dict:
    """Plain decoding through the engine, and the share of its steps spent outside the target's forwards."""
    from specdecode import SamplingParams, SpecConfig

    model = engine.target.model
    forward_seconds = []
    forward = model.forward

    def timed_forward(*args, **kwargs):
        began = clock()
        out = forward(*args, **kwargs)
        forward_seconds.append(clock() - began)
        return out

    # A fixed length (ignore_eos): random weights have no natural end to reach, and no drafting is timed here.
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    prompt = random_ids(64, model.config.vocab_size, 3)
    engine.complete(prompt, SamplingParams(max_tokens=8, ignore_eos=True), SpecConfig("none"))  # warm up
    request = engine.begin(prompt, sampling, SpecConfig("none"))
    engine.prefill(request)
    steps, began = 0, clock()
    while request.generated < tokens:
        engine.step(request)
        steps += 1
    plain_seconds = clock() - began
    engine.finish(request)
    # The same steps again with every target forward timed between synchronisations.
    model.forward = timed_forward  # an instance attribute: nn.Module's call finds it before the class's
    try:
        request = engine.begin(prompt, sampling, SpecConfig("none"))
        engine.prefill(request)
        forward_seconds.clear()
        step_times = []
        while request.generated < tokens:
            began = clock()
            engine.step(request)
            step_times.append(clock() - began)
        engine.finish(request)
    finally:
        del model.forward
    step, forward = statistics.median(step_times), statistics.median(forward_seconds)
    return {"tokens_per_second": steps / plain_seconds, "step_seconds": step, "forward_seconds": forward,
            "engine_share": (step - forward) / step}


def batched(engine, batches, tokens: int, clock: Clock) -> dict:
    """Aggregate tokens/s of N requests decoded together by Engine.step_many (plain decoding; prefill untimed)."""
    from specdecode import SamplingParams, SpecConfig

    results = {}
    vocab = engine.target.model.config.vocab_size
    for size in batches:
        requests = []
        for i in range(size):
            request = engine.begin(random_ids(64, vocab, 100 + i), SamplingParams(max_tokens=tokens, ignore_eos=True),
                                   SpecConfig("none"))
            engine.prefill(request)
            requests.append(request)
        produced, began = 0, clock()
        while all(r.generated < tokens for r in requests):
            produced += sum(len(event.token_ids) for event in engine.step_many(requests))
        seconds = clock() - began
        for request in requests:
            engine.finish(request)
        results[size] = {"tokens_per_second": produced / seconds}
    return results


def training(loaded, tokens: int, clock: Clock) -> dict:
    """What `specdecode train eagle3 --device D` runs, phase by phase on the loaded target: the target's
    features of `tokens` training tokens (the standard library's code text), then the head's training on them."""
    from specdecode.cli.train import training_texts
    from specdecode.training.eagle3 import feature_layer_ids, train_eagle3
    from specdecode.training.features import check_manifest, extract
    from specdecode.training.loop import TrainSettings

    layer_ids = feature_layer_ids(loaded.config.num_layers)
    with tempfile.TemporaryDirectory() as work:
        manifest = {"target": loaded.name, "quant": loaded.quant, "dtype": str(loaded.model.dtype),
                    "layer_ids": list(layer_ids), "answers": 0, "answer_tokens": 192, "max_len": 768}
        Path(work, "features").mkdir()
        check_manifest(Path(work) / "features", manifest)  # as the command does: it writes the manifest
        began = clock()
        done = extract(loaded, layer_ids, training_texts(0), Path(work) / "features",
                       {"train": tokens, "held_out": 500}, 192, 768, True)
        features = clock() - began
        settings = TrainSettings(draft_vocab=16000, intermediate_size=loaded.config.intermediate_size // 2,
                                 device=str(loaded.model.device))
        began = clock()
        train_eagle3(loaded, Path(work) / "features", Path(work) / "head", settings, True,
                     lambda step, tokens, accuracy: None)
        trained = clock() - began
    return {"tokens": done["train"], "features_seconds": features, "training_seconds": trained,
            "epochs": settings.epochs, "features_tokens_per_second": done["train"] / features,
            "training_tokens_per_second": done["train"] * settings.epochs / trained}  # tokens seen, every epoch


def markdown(report: dict) -> list[str]:
    lines = [f"# GPU check: {report['device_name']}, {report['shape']} shape, bf16, random weights", "",
             f"torch {report['torch']}; {report['when']}", ""]
    lines += [f"- skipped: {reason}" for reason in report["skipped"]]
    plain = report["decoding"]
    lines += ["", (f"plain decoding: {plain['tokens_per_second']:.1f} tokens/s; a step "
                   f"{plain['step_seconds'] * 1e3:.2f} ms, its forward {plain['forward_seconds'] * 1e3:.2f} ms, the "
                   f"engine's own share {plain['engine_share']:.1%}"),
              "", "| rows | verify forward ms | x one row | max logit difference vs one row at a time | same argmax |",
              "|---:|---:|---:|---:|:---:|"]
    one = report["verify"][1]["seconds"]
    for rows, row in report["verify"].items():
        lines.append(f"| {rows} | {row['seconds'] * 1e3:.2f} | {row['seconds'] / one:.2f} | "
                     f"{row['max_logit_difference']:.3g} | {'yes' if row['argmax_equal'] else 'NO'} |")
    lines += ["", "| requests | batched tokens/s |", "|---:|---:|"]
    lines += [f"| {size} | {row['tokens_per_second']:.1f} |" for size, row in report["batched"].items()]
    if "training" in report:
        train = report["training"]
        lines += ["", (f"train eagle3 ({train['tokens']} tokens, {train['epochs']} epochs): features "
                       f"{train['features_tokens_per_second']:.0f} tokens/s, head training "
                       f"{train['training_tokens_per_second']:.0f} tokens/s")]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="auto", help="cuda, cpu, or auto: cuda where present")
    parser.add_argument("--shape", choices=list(SHAPES), default=None,
                        help="default: 1.5b on a GPU, tiny on a CPU (the 1.5B shape in bf16 decodes slowly there)")
    parser.add_argument("--quick", action="store_true", help="fewer sizes and tokens (the default on a CPU)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--no-train", action="store_true")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "specdecode-gpu-check")
    args = parser.parse_args()
    from specdecode import Engine, load_model

    on_gpu = torch.cuda.is_available()
    device = ("cuda" if on_gpu else "cpu") if args.device == "auto" else args.device
    skipped = [] if device == "cuda" else [
        (f"CUDA ({'none present' if not on_gpu else 'not asked for'}): every number below is the CPU's, "
        "not a GPU's, and none of the goals (overhead under 15% on an H200, training 50x the CPU) is judged by it")]
    shape = args.shape or ("1.5b" if device == "cuda" else "tiny")
    sizes = QUICK if (args.quick or device != "cuda") else FULL
    folder = write_random(args.work / shape, SHAPES[shape])
    loaded = load_model(folder, dtype="bfloat16", device=device, quant="none", quiet=True)
    clock = Clock(loaded.model.device)
    report = {"device": device, "shape": shape, "torch": torch.__version__, "skipped": skipped,
              "device_name": torch.cuda.get_device_name() if device == "cuda" else f"CPU, {torch.get_num_threads()} "
              "threads", "when": time.strftime("%Y-%m-%d %H:%M")}
    print(f"{report['device_name']}: {shape} shape", flush=True)
    report["verify"] = verify_costs(loaded.model, sizes["rows"], clock, args.rounds)
    engine = Engine(loaded)
    report["decoding"] = decoding(engine, sizes["tokens"], clock)
    report["batched"] = batched(engine, sizes["batches"], sizes["tokens"], clock)
    if args.no_train:
        skipped.append("training (--no-train)")
    else:
        report["training"] = training(loaded, sizes["train_tokens"], clock)
    write_report(args.out, "gpu_check", report, markdown(report))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
