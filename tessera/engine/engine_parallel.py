"""The engine's tensor-parallel group (mixed into tessera.engine.engine.Engine): starting it,
a step that fails with a rank, the listeners told as soon as one dies, and closing it."""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

import torch.distributed as dist

from tessera.config import EngineConfig
from tessera.distributed.channel import Command
from tessera.distributed.launcher import RankFailedError, TensorParallelGroup, rank_device
from tessera.engine.errors import EngineFatalError
from tessera.runner.launched_step import StepResult

logger = logging.getLogger(__name__)
T = TypeVar("T")


class TensorParallelMethods:
    tp_group: TensorParallelGroup | None

    def _start_group(self, config: EngineConfig) -> None:
        """Rank 0 of a tensor-parallel group drives; the group spawns (or meets) the others,
        which build their own shards while this process builds its own."""
        self._fatal: EngineFatalError | None = None
        self._fatal_listeners: list[Callable[[EngineFatalError], None]] = []
        self.tp_group = TensorParallelGroup(config) if config.parallel.tensor_parallel_size > 1 else None
        if self.tp_group is not None:
            self.device = rank_device(config, 0)
            self.tp_group.watch(self._rank_died)

    def _execute(self, scheduled) -> StepResult:
        return self._on_ranks(lambda: self.runner.execute(scheduled))

    def _on_ranks(self, work: Callable[[], T]) -> T:
        """`work()`, which may run collectives with the other ranks (a step, a beam's block
        copies): a rank that died or a collective that failed becomes the engine's fatal
        RankFailedError, raised now and by every later call."""
        if self._fatal is not None:
            raise self._fatal
        if self.tp_group is None:
            return work()
        try:
            self.tp_group.check_alive()
            return work()
        except RankFailedError as exc:
            self._fatal = exc
        except (RuntimeError, dist.DistBackendError) as exc:  # a collective failed or timed out
            # name the rank that died, if it was one of ours
            self._fatal = (self.tp_group.find_dead_rank()
                           or RankFailedError(f"tensor-parallel step failed: {exc}"))
            self._fatal.__cause__ = exc
        logger.error("%s", self._fatal)
        raise self._fatal

    def on_fatal(self, listener: Callable[[EngineFatalError], None]) -> None:
        """Have `listener` called, from the group's watcher thread, as soon as another
        tensor-parallel rank dies: while the engine's own thread may still be blocked in a
        collective (never called without tensor parallelism)."""
        self._fatal_listeners.append(listener)
        if isinstance(self._fatal, RankFailedError):  # (it died before anyone listened)
            listener(self._fatal)

    def _rank_died(self, exc: RankFailedError) -> None:
        if self._fatal is None:
            self._fatal = exc
        logger.error("%s", exc)
        for listener in list(self._fatal_listeners):
            listener(exc)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and leave the group (no-op without TP).
        The engine takes no requests afterwards."""
        group = getattr(self, "tp_group", None)
        if group is None or group.closed:
            return
        runner = getattr(self, "runner", None)
        group.stopping = True
        if runner is not None and self._fatal is None:
            try:
                runner.channel.send(Command.SHUTDOWN)
            except Exception:  # a rank already gone: close() terminates the rest
                pass
        rank_died = isinstance(self._fatal, RankFailedError)
        self._fatal = self._fatal or EngineFatalError("the engine was closed")
        group.close(rank_died=rank_died)
