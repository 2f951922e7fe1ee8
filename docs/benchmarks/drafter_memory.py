"""What each drafter of the default target keeps in memory: the draft model against an EAGLE-3 head.

Run from the repository root: python docs/benchmarks/drafter_memory.py --draft-head FOLDER [--quant auto]

Weights as the engine holds them (the draft model quantized as `--draft-quant auto` would: w4a8 where the CPU
has the kernel; the head in the target's dtype, without the embedding it shares with the target), and the KV
cache each keeps per token of context (the draft model's every layer against the head's one layer).
"""

from __future__ import annotations

import argparse
import json

from specdecode import Engine, SpecConfig
from specdecode.cli.options import draft_quant
from specdecode.models.formats.default_models import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.models.loader import load_model


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, element_size: int) -> int:
    return 2 * layers * kv_heads * head_dim * element_size  # keys and values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draft-head", required=True, help="an EAGLE-3 head folder for the default target")
    parser.add_argument("--quant", default="auto", help="the target's --quant (default auto)")
    args = parser.parse_args()
    target = load_model(DEFAULT_TARGET, quant=args.quant, quiet=True)
    auto = argparse.Namespace(draft_quant="auto", device="cpu", group_size=32)
    draft = load_model(DEFAULT_DRAFT, quant=draft_quant(auto), quiet=True)
    engine = Engine(target, draft, draft_path=args.draft_head)
    head = engine.drafter(SpecConfig("eagle3")).head
    element = target.model.embed.weight.element_size()
    dc, hc = draft.config, head.config.layer
    report = {
        "target_weights_bytes": target.weights_bytes,
        "draft_model": {"name": draft.name, "quant": draft.quant, "weights_bytes": draft.weights_bytes,
                        "kv_bytes_per_token": kv_bytes_per_token(dc.num_layers, dc.num_kv_heads, dc.head_dim,
                                                                 element)},
        "eagle3_head": {"weights_bytes": engine.drafter_weights_bytes(),
                        "parameters": sum(p.numel() for p in head.parameters()),
                        "draft_vocab": head.config.draft_vocab_size,
                        "kv_bytes_per_token": kv_bytes_per_token(1, hc.num_kv_heads, hc.head_dim, element)},
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
