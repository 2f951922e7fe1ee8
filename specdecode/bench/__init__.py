"""`specdecode bench`: Spec-Bench-style measurement of methods and peers on the same prompts, in one run."""
