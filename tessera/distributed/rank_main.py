"""`python -m tessera.distributed.rank_main`: a rank the engine started on this machine.
Reads (EngineConfig, RankInfo, threads) pickled on stdin from its parent engine."""
from __future__ import annotations

import pickle
import sys

from tessera.distributed.worker import spawned_rank_main

if __name__ == "__main__":
    config, info, threads = pickle.load(sys.stdin.buffer)
    spawned_rank_main(config, info, threads)
