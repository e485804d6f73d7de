"""Starting and stopping the tensor-parallel group.

Single machine: the driver (rank 0, the engine's own process) starts ranks 1..N-1 as
subprocesses, picks a free port unless told one, and joins the group last.
Several machines: every process is started by the user (torchrun, or RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT by hand; the CLI reads them into ParallelConfig) and all meet at
rank 0's TCP rendezvous; rank 0 drives, the others serve (`tessera serve` on rank > 0
never opens a port).
Backends: gloo on CPU, NCCL on CUDA. One rank (TP=1) needs no group at all.
"""
from __future__ import annotations

import logging
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from tessera.config import EngineConfig
from tessera.engine.errors import EngineFatalError

logger = logging.getLogger(__name__)


class RankFailedError(EngineFatalError):
    """Another rank died or stopped answering: the engine cannot run another step."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    init_method: str  # tcp://addr:port of rank 0's rendezvous store


def launched_rank_info(config: EngineConfig) -> RankInfo:
    par = config.parallel
    return RankInfo(par.rank, par.tensor_parallel_size, f"tcp://{par.master_addr}:{par.master_port}")


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def rank_device(config: EngineConfig, rank: int) -> torch.device:
    """CPU ranks share the CPU; a CUDA rank uses GPU `local_rank` of its machine (its rank
    when spawned on one machine)."""
    if not config.device.startswith("cuda"):
        return torch.device("cpu")
    local = config.parallel.local_rank
    return torch.device("cuda", rank if local is None else local)


def init_rank(config: EngineConfig, info: RankInfo) -> None:
    device = rank_device(config, info.rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=info.init_method, rank=info.rank,
                            world_size=info.world_size,
                            timeout=timedelta(seconds=config.parallel.timeout_s))


class TensorParallelGroup:
    """The driver's handle on the group: the spawned ranks (if any) and shutdown."""

    def __init__(self, config: EngineConfig):
        par = config.parallel
        self.world_size = par.tensor_parallel_size
        self.processes: list[subprocess.Popen] = []
        self.closed = False
        self.stopping = False  # the driver told the ranks to exit: their exits are expected
        if par.launched:
            if par.rank != 0:
                raise ValueError(f"rank {par.rank} is not the driver; it runs serve_rank()")
            init_rank(config, launched_rank_info(config))
            return
        port = par.master_port or free_port(par.master_addr)
        init_method = f"tcp://{par.master_addr}:{port}"
        threads = max(1, torch.get_num_threads() // self.world_size) if config.device == "cpu" else 1
        # Plain subprocesses running `python -m tessera.distributed.rank_main`, the config
        # pickled over stdin: unlike multiprocessing's spawn, this never re-imports the
        # user's __main__ (scripts need no `if __name__ == "__main__"` guard). Each in a
        # session of its own: a Ctrl-C or a SIGTERM to the server's process group reaches the
        # driver alone, which drains and then stops them (they die with it if it is killed).
        for rank in range(1, self.world_size):
            proc = subprocess.Popen([sys.executable, "-m", "tessera.distributed.rank_main"],
                                    stdin=subprocess.PIPE, start_new_session=True)
            proc.name = f"tensor-parallel rank {rank} (pid {proc.pid})"
            proc.stdin.write(pickle.dumps((config, RankInfo(rank, self.world_size, init_method), threads)))
            proc.stdin.close()
            self.processes.append(proc)
        if config.device == "cpu":
            torch.set_num_threads(threads)  # the ranks share this machine's cores
        logger.info("tensor parallel: %d ranks on %s (%d threads each)", self.world_size,
                    init_method, threads)
        try:
            init_rank(config, RankInfo(0, self.world_size, init_method))
        except Exception:
            self.close()
            raise

    def check_alive(self) -> None:
        """Raise RankFailedError if a spawned rank has exited."""
        for proc in self.processes:
            if proc.poll() is not None:
                raise RankFailedError(f"{proc.name} exited with code {proc.returncode}; "
                                      "the tensor-parallel engine cannot continue")

    def watch(self, on_death: Callable[[RankFailedError], None], interval_s: float = 0.1) -> None:
        """Call `on_death` once, from a daemon thread, when a spawned rank exits unasked.
        A step blocked in a collective may learn of it late (or, if the peer's sockets
        linger, only at the collective's timeout); the requests waiting on it should not."""
        if not self.processes:
            return

        def run() -> None:
            while not (self.closed or self.stopping):
                try:
                    self.check_alive()
                except RankFailedError as dead:
                    if not (self.closed or self.stopping):
                        on_death(dead)
                    return
                time.sleep(interval_s)

        threading.Thread(target=run, name="tessera-rank-watch", daemon=True).start()

    def find_dead_rank(self, wait_s: float = 2.0) -> RankFailedError | None:
        """After a failed collective: the spawned rank that exited, if one does within
        `wait_s` (a killed process may not be reaped yet when its socket closes)."""
        deadline = time.monotonic() + wait_s
        while True:
            try:
                self.check_alive()
            except RankFailedError as dead:
                return dead
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def close(self, timeout: float = 10.0, rank_died: bool = False) -> None:
        """Wait for the ranks to stop (the engine told them, if they could still hear), kill
        those that do not, and tear down the group. `rank_died`: NCCL's group is left as it
        is (destroying it could wait on the collective the dead rank never joined; the
        process is going down anyway)."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        if dist.is_initialized() and not (rank_died and dist.get_backend() == "nccl"):
            dist.destroy_process_group()
