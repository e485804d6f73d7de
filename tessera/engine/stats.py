"""Engine counters, read by benchmarks and the server's metrics."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float        # fraction of KV blocks referenced by live sequences
    num_kv_blocks: int
    num_preemptions: int         # since start
    prefix_cache_queries: int    # prompt tokens looked up in the prefix cache, since start
    prefix_cache_hits: int       # of those, tokens served from cached blocks

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
