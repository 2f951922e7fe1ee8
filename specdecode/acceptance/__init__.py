"""The acceptance math: pure functions of tensors (greedy, rejection sampling, trees, sampling
transforms, relaxed rules), in the papers' notation. Knows no drafter, engine or model."""
