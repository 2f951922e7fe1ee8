"""Where a drafted token's cost goes: the draft's weight bytes against the target's, and their one-row forwards.

    python docs/benchmarks/draft_cost.py

The default pair (target w4a8 from its GGUF, draft w4a8), the embedding left out of the bytes (it is indexed, not
read). Each forward is one new row after a 64-token prompt, the median of 60, three rounds.
"""

import time

import torch

from specdecode import load_model
from specdecode.models.loader import module_bytes


def one_row(model, rounds: int = 60) -> float:
    """Median seconds of a one-row forward after a 64-token prompt (after 10 unmeasured ones)."""
    cache = model.new_cache(400)
    times = []
    with torch.inference_mode():
        model(torch.tensor([list(range(300, 364))]), torch.arange(64).unsqueeze(0), cache)
        for position in range(64, 74 + rounds):
            began = time.perf_counter()
            model(torch.tensor([[400]]), torch.tensor([[position]]), cache)
            if position >= 74:
                times.append(time.perf_counter() - began)
    return sorted(times)[len(times) // 2]


def main() -> None:
    target = load_model("qwen2.5-coder-1.5b-instruct", quiet=True)
    draft = load_model("qwen2.5-coder-0.5b-instruct", quant="w4a8", quiet=True)
    target_bytes = module_bytes(target.model) - target.model.embed.weight.nbytes
    draft_bytes = module_bytes(draft.model) - draft.model.embed.weight.nbytes
    print(f"weights read per token (embedding excluded): target {target_bytes / 1e6:.0f} MB, draft "
          f"{draft_bytes / 1e6:.0f} MB, ratio {draft_bytes / target_bytes:.3f}")
    for _ in range(3):
        target_seconds, draft_seconds = one_row(target.model), one_row(draft.model)
        print(f"one-row forward: target {target_seconds * 1e3:.2f} ms, draft {draft_seconds * 1e3:.2f} ms, ratio "
              f"{draft_seconds / target_seconds:.3f}")


if __name__ == "__main__":
    main()
