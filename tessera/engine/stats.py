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
    # speculative decoding, since start: sequence steps that verified drafts, the drafts,
    # and how many of them verification accepted (a stop among them may end the output
    # before the last)
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # LoRA: the adapters of running and waiting requests, and how many one step can run
    lora_running: tuple[str, ...] = ()
    lora_waiting: tuple[str, ...] = ()
    max_loras: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0

    @property
    def spec_mean_acceptance_length(self) -> float:
        """Tokens a verifying step produced per sequence on average (accepted drafts + 1)."""
        return 1 + self.spec_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0
