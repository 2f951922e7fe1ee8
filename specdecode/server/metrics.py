"""Prometheus metrics for the server, in a registry of its own (several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine.prefix_cache import PrefixCache
from specdecode.engine.stats import GenerationStats

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MEMORY_BUCKETS = tuple(float(1 << shift) for shift in range(20, 36, 2))  # 1 MiB to 16 GiB, by fours


class ServerMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("specdecode_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.prompt_tokens = Counter("specdecode_prompt_tokens", "Prompt tokens processed", registry=self.registry)
        self.cached_prompt_tokens = Counter("specdecode_prompt_tokens_cached",
                                            "Of them, taken from the prefix cache instead of read",
                                            registry=self.registry)
        self.generation_tokens = Counter("specdecode_generation_tokens", "Tokens generated", registry=self.registry)
        self.drafted = Counter("specdecode_spec_drafted_tokens", "Draft tokens proposed", registry=self.registry)
        self.accepted = Counter("specdecode_spec_accepted_tokens", "Draft tokens accepted", registry=self.registry)
        self.accepted_per_position = Counter("specdecode_spec_accepted_per_position",
                                             "Draft tokens accepted at each draft position (0-based)",
                                             ["position"], registry=self.registry)
        self.drafted_per_position = Counter("specdecode_spec_drafted_per_position",
                                            "Draft tokens proposed at each draft position (0-based)",
                                            ["position"], registry=self.registry)
        self.steps_without_draft = Counter("specdecode_spec_steps_without_draft",
                                           "Target forwards that verified no draft, by reason (no_proposal, "
                                           "batch_load, no_room, guard_paused, guard_timing_plain, chooser_plain)",
                                           ["reason"],
                                           registry=self.registry)
        self.time_to_first_token = Histogram("specdecode_time_to_first_token_seconds",
                                             "From request arrival to the first generated token",
                                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.time_per_output_token = Histogram("specdecode_time_per_output_token_seconds",
                                               "Mean time per generated token after the first, per request",
                                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.request_memory = Histogram("specdecode_request_memory_bytes",
                                        "Memory a request held: the target's KV cache and the drafter's state for it",
                                        buckets=MEMORY_BUCKETS, registry=self.registry)
        self.weights = Gauge("specdecode_weights_bytes", "Memory the models' weights hold", ["model"],
                             registry=self.registry)
        self.drafter_caches = Gauge("specdecode_drafter_cache_bytes",
                                    "Memory of the drafters' caches that outlive requests (suffix's responses)",
                                    registry=self.registry)
        self.kv_cache = Gauge("specdecode_kv_cache_bytes", "Memory the active requests' target KV caches hold",
                              registry=self.registry)
        self.kv_budget = Gauge("specdecode_kv_cache_budget_bytes",
                               "The server's budget for those caches (--kv-memory; 0: none)", registry=self.registry)
        self.prefix_cache = Gauge("specdecode_prefix_cache_bytes",
                                  "Memory the prefix cache holds: ended requests' keys and values (--prefix-cache)",
                                  registry=self.registry)
        self.prefix_cache_entries = Gauge("specdecode_prefix_cache_entries", "Prompts the prefix cache holds",
                                          registry=self.registry)
        self.active = Gauge("specdecode_active_requests", "Requests being generated", registry=self.registry)
        self.queued = Gauge("specdecode_queued_requests", "Requests waiting for a slot", registry=self.registry)

    def record_generation(self, stats: GenerationStats, ttft: float, total: float) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.drafted.inc(stats.drafted_tokens)
        self.accepted.inc(stats.accepted_tokens)
        for position, (drafted, accepted) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
            self.drafted_per_position.labels(str(position)).inc(drafted)
            self.accepted_per_position.labels(str(position)).inc(accepted)
        for reason, count in stats.steps_without_draft.items():
            self.steps_without_draft.labels(reason).inc(count)
        self.request_memory.observe(stats.kv_cache_bytes + stats.drafter_request_bytes)
        self.time_to_first_token.observe(ttft)
        if stats.new_tokens > 1:
            self.time_per_output_token.observe((total - ttft) / (stats.new_tokens - 1))

    def render(self, active: int, queued: int, weights: dict[str, int], drafter_caches: int, kv_cache: int,
               kv_budget: int | None, prefix_cache: PrefixCache | None) -> bytes:
        """`weights`: model role -> bytes; `drafter_caches`: bytes of the caches that outlive requests;
        `kv_cache`: bytes of the active requests' target KV caches, `kv_budget` their bound (None: none);
        `prefix_cache`: the engine's (None: it keeps none)."""
        self.prefix_cache.set(0 if prefix_cache is None else prefix_cache.nbytes)
        self.prefix_cache_entries.set(0 if prefix_cache is None else prefix_cache.entries)
        self.kv_cache.set(kv_cache)
        self.kv_budget.set(kv_budget or 0)
        self.active.set(active)
        self.queued.set(queued)
        for role, size in weights.items():
            self.weights.labels(role).set(size)
        self.drafter_caches.set(drafter_caches)
        return generate_latest(self.registry)
