"""Prometheus metrics, named in the style of vLLM's (``spec_decode_*`` for speculation).

Each app gets its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
MAX_TRACKED_POSITION = 128


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("foretell_requests", "HTTP requests answered",
                                ["endpoint", "status"], registry=r)
        self.request_success = Counter("foretell_request_success", "Generations finished",
                                       ["model", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("foretell_prompt_tokens", "Prompt tokens processed",
                                     ["model"], registry=r)
        self.generation_tokens = Counter("foretell_generation_tokens", "Tokens generated",
                                         ["model"], registry=r)
        self.time_to_first_token = Histogram("foretell_time_to_first_token_seconds",
                                             "Time from request to first token", ["model"],
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("foretell_inter_token_latency_seconds",
                                             "Time between delivered tokens (a round's time "
                                             "spread over its tokens)", ["model"],
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e_latency = Histogram("foretell_e2e_request_latency_seconds",
                                     "Time from request to last token", ["model"],
                                     buckets=LATENCY_BUCKETS, registry=r)
        self.queue_length = Gauge("foretell_num_requests_waiting", "Requests waiting for the engine",
                                  registry=r)
        self.running = Gauge("foretell_num_requests_running", "Sequences in the engine's batch",
                             registry=r)
        # The same load signals under the names vLLM exports, so that routers written for vLLM
        # pods (the Gateway API Inference Extension's endpoint picker, vLLM's production-stack
        # router) can balance foretell pods alike.
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting for the engine",
                                  ["model_name"], registry=r)
        self.vllm_running = Gauge("vllm:num_requests_running", "Sequences in the engine's batch",
                                  ["model_name"], registry=r)
        self.vllm_kv_cache_usage = Gauge("vllm:kv_cache_usage_perc",
                                         "Fraction of the KV cache in use or cached (1 = full)",
                                         ["model_name"], registry=r)
        self.kernel_fallback = Gauge("foretell_kernel_fallback",
                                     "1 when the kernel's Triton version failed its start-up check and "
                                     "its torch reference runs instead, else 0", ["kernel"], registry=r)
        self.kv_cache_usage = Gauge("foretell_kv_cache_usage_perc",
                                    "Fraction of the KV cache's full-attention blocks in use or cached",
                                    registry=r)
        self.draft_cache_tokens = Gauge("foretell_draft_cache_tokens",
                                        "Output tokens of earlier requests held by the suffix draft cache "
                                        "(all tenant scopes)", registry=r)
        self.draft_cache_requests = Gauge("foretell_draft_cache_requests",
                                          "Earlier requests whose outputs the suffix draft cache holds",
                                          registry=r)
        self.draft_cache_scopes = Gauge("foretell_draft_cache_scopes",
                                        "Tenant scopes with outputs in the suffix draft cache", registry=r)
        # vLLM's pair: the hit rate is hits / queries (prompt tokens found in the prefix cache).
        self.prefix_cache_queries = Counter("foretell_prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache", ["model"],
                                            registry=r)
        self.prefix_cache_hits = Counter("foretell_prefix_cache_hits",
                                         "Prompt tokens whose KV came from the prefix cache", ["model"],
                                         registry=r)
        self.accepted_prediction_tokens = Counter(
            "foretell_accepted_prediction_tokens", "Prediction tokens the output kept (OpenAI's usage "
            "figure)", ["model"], registry=r)
        self.rejected_prediction_tokens = Counter(
            "foretell_rejected_prediction_tokens", "Prediction tokens the output did not keep", ["model"],
            registry=r)
        self.target_passes = Counter("foretell_spec_decode_num_target_passes",
                                     "Target forward passes after prefill", ["model"], registry=r)
        self.drafts = Counter("foretell_spec_decode_num_drafts", "Rounds that verified a draft",
                              ["model", "source"], registry=r)
        self.draft_tokens = Counter("foretell_spec_decode_num_draft_tokens", "Draft tokens verified",
                                    ["model", "source"], registry=r)
        self.accepted_tokens = Counter("foretell_spec_decode_num_accepted_tokens",
                                       "Draft tokens accepted", ["model", "source"], registry=r)
        self.accepted_per_position = Counter(
            "foretell_spec_decode_num_accepted_tokens_per_pos",
            f"Accepted draft tokens by position in the draft (positions >= {MAX_TRACKED_POSITION} "
            "are counted at the last)", ["model", "position"], registry=r)
        self.drafted_per_position = Counter(
            "foretell_spec_decode_num_draft_tokens_per_pos", "Draft tokens by position in the draft",
            ["model", "position"], registry=r)

    def record_generation(self, model: str, stats, finish_reason: str) -> None:
        """A finished generation's figures: ``model`` is the local model's served name, or the
        upstream's name for a request it verified remotely."""
        self.request_success.labels(model, finish_reason).inc()
        self.accepted_prediction_tokens.labels(model).inc(stats.accepted_prediction_tokens)
        self.rejected_prediction_tokens.labels(model).inc(stats.rejected_prediction_tokens)
        self.prompt_tokens.labels(model).inc(stats.prompt_tokens)
        self.prefix_cache_queries.labels(model).inc(stats.prompt_tokens)
        self.prefix_cache_hits.labels(model).inc(stats.cached_tokens)
        self.generation_tokens.labels(model).inc(stats.completion_tokens)
        self.target_passes.labels(model).inc(stats.target_passes)
        for name, source in stats.per_source.items():
            self.drafts.labels(model, name).inc(source.rounds)
            self.draft_tokens.labels(model, name).inc(source.drafted)
            self.accepted_tokens.labels(model, name).inc(source.accepted)
        for counter, counts in ((self.drafted_per_position, stats.drafted_by_position),
                                (self.accepted_per_position, stats.accepted_by_position)):
            for position, count in enumerate(counts):
                label = str(min(position, MAX_TRACKED_POSITION - 1))  # a bounded label set
                counter.labels(model, label).inc(count)

    def record_kernels(self, kernels: dict) -> None:
        """The engine's kernel choice (``Kernels.describe()``): one gauge per kernel, 1 where its
        torch reference replaced a failed Triton kernel."""
        for name in kernels["triton"] + list(kernels["fallback"]):
            self.kernel_fallback.labels(kernel=name).set(1 if name in kernels["fallback"] else 0)

    def record_load(self, model: str, waiting: int, running: int, kv_cache_usage: float) -> None:
        """The engine's queue, batch and KV cache now, under foretell's names and vLLM's."""
        self.queue_length.set(waiting)
        self.running.set(running)
        self.kv_cache_usage.set(kv_cache_usage)
        self.vllm_waiting.labels(model).set(waiting)
        self.vllm_running.labels(model).set(running)
        self.vllm_kv_cache_usage.labels(model).set(kv_cache_usage)

    def record_cache(self, cache, draft_cache=None) -> None:
        self.kv_cache_usage.set(cache.usage())
        if draft_cache is not None:
            sizes = draft_cache.snapshot()
            self.draft_cache_tokens.set(sizes["cached_tokens"])
            self.draft_cache_requests.set(sizes["cached_requests"])
            self.draft_cache_scopes.set(sizes["scopes"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
