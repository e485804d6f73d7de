"""Prometheus metrics, all prefixed `tessera_`, in a registry of the app's own."""
from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from tessera.engine.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    """Reads the engine's counters at scrape time (no bookkeeping on the hot path)."""

    def __init__(self, stats: Callable[[], EngineStats]):
        self.stats = stats

    def collect(self):
        s = self.stats()
        yield GaugeMetricFamily("tessera_num_requests_running", "Sequences in the running batch",
                                value=s.num_running)
        yield GaugeMetricFamily("tessera_num_requests_waiting", "Sequences waiting to be scheduled",
                                value=s.num_waiting)
        yield GaugeMetricFamily("tessera_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
                                value=s.kv_cache_usage)
        yield CounterMetricFamily("tessera_num_preemptions", "Sequences preempted (recomputed later)",
                                  value=s.num_preemptions)
        yield CounterMetricFamily("tessera_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("tessera_prefix_cache_hits", "Prompt tokens served from the prefix cache",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily("tessera_spec_decode_num_drafts",
                                  "Speculative decoding: sequence steps that verified draft tokens",
                                  value=s.spec_num_drafts)
        yield CounterMetricFamily("tessera_spec_decode_num_draft_tokens",
                                  "Speculative decoding: draft tokens verified", value=s.spec_draft_tokens)
        yield CounterMetricFamily("tessera_spec_decode_num_accepted_tokens",
                                  "Speculative decoding: draft tokens accepted", value=s.spec_accepted_tokens)
        if s.max_loras:  # as vLLM's lora_requests_info: the adapters in labels, a timestamp as value
            info = GaugeMetricFamily("tessera_lora_requests_info", "LoRA adapters of running and waiting requests",
                                     labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
            info.add_metric([str(s.max_loras), ",".join(s.lora_running), ",".join(s.lora_waiting)], time.time())
            yield info


class ServerMetrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tessera_requests", "Finished requests by outcome", ["outcome"], registry=r)
        self.prompt_tokens = Counter("tessera_prompt_tokens", "Prompt tokens of served requests", registry=r)
        self.generation_tokens = Counter("tessera_generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("tessera_time_to_first_token_seconds", "Arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("tessera_inter_token_latency_seconds", "Between consecutive tokens",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("tessera_e2e_request_latency_seconds", "Arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("tessera_request_queue_time_seconds", "Arrival to first scheduled",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(stats))
