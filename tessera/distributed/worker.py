"""A non-driver rank: build this rank's shard of the model, then run whatever the driver
broadcasts (cache allocation, forwards) until it says shut down."""
from __future__ import annotations

import logging
import os
import sys
import threading
import time

import torch

from tessera.config import EngineConfig
from tessera.distributed.channel import Command, StepChannel
from tessera.distributed.launcher import RankInfo, init_rank, launched_rank_info, rank_device
from tessera.engine.pooling_requests import resolve_pooler
from tessera.engine.state_cache import num_state_slots
from tessera.models.registry import get_router
from tessera.ops.attention.kv_quant import kv_cache_torch_dtype
from tessera.ops.registry import OpTarget
from tessera.platform import resolve_weights
from tessera.pooling.model import as_pooling_model
from tessera.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def rank_weights(config: EngineConfig, router) -> tuple[torch.dtype, str | None]:
    """(model dtype, weight format) as the driver resolves them (engine.py), from the same config."""
    return resolve_weights(config.model.dtype, config.model.quantization, config.device,
                           router.implementation == "native", router.stored_matrix_format)


def build_rank_model(config: EngineConfig, rank: int, world_size: int):
    """(router, model with its weights) for one rank: the same on the driver and the others."""
    device = rank_device(config, rank)
    router = get_router(config.model)
    dtype, quant = rank_weights(config, router)
    target = OpTarget(device.type, dtype, tp_size=world_size, tp_rank=rank, quant=quant,
                      kv_cache_dtype=kv_cache_torch_dtype(config.cache.kv_cache_dtype))
    model = router.build_model(target).eval()
    pooler = resolve_pooler(config, router)
    if pooler is not None:  # an embedding model, as on the driver
        model = as_pooling_model(model, pooler, target)
    router.load_weights(model)
    return router, model


def serve_rank(config: EngineConfig, info: RankInfo) -> None:
    """Join the group as `info.rank`, load the shard, and follow the driver's commands
    until SHUTDOWN. Then the caller should leave with `exit_now()`: tearing the group down
    races with the driver closing its rendezvous store (a C++ abort at exit, seen here
    about one run in three), and a rank has nothing left to flush but stdio."""
    init_rank(config, info)
    router, model = build_rank_model(config, info.rank, info.world_size)
    device = rank_device(config, info.rank)
    dtype, _ = rank_weights(config, router)
    runner = ModelRunner(model, config.cache.block_size, device, dtype, sampler=None,
                         num_state_slots=num_state_slots(config.scheduler.max_num_seqs,
                                                         config.cache.enable_prefix_caching))
    lora = config.lora
    if lora.enable_lora:
        runner.enable_lora(lora.max_loras, lora.max_lora_rank)
    channel = StepChannel(device)
    while True:
        msg = channel.recv()
        if msg.command == Command.SHUTDOWN:
            break
        if msg.command == Command.ALLOCATE_KV:
            runner.allocate_kv_cache(msg.arg)
        elif msg.command == Command.RELEASE_KV:
            runner.release_kv_cache()
        elif msg.command == Command.LOAD_LORA:  # the driver's checked adapter, as it holds it
            runner.load_lora(msg.arg, msg.lora)
        elif msg.command == Command.COPY_KV_BLOCKS:
            runner.copy_kv_blocks(msg.copies)
        elif msg.command == Command.COPY_STATES:
            runner.fork_states(msg.copies)
        elif msg.command == Command.FORWARD:
            for _ in runner.forward(msg.inputs):  # its LM head joins each pass's all-gather
                pass
        else:
            runner.forward_no_logits(msg.inputs, hidden_read=bool(msg.arg))


def exit_now(code: int = 0) -> None:
    """Leave the process at once (after flushing stdio), skipping interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent() -> None:
    """A spawned rank must not outlive its engine (killed without a chance to say SHUTDOWN)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="tessera-parent-watch", daemon=True).start()


def spawned_rank_main(config: EngineConfig, info: RankInfo, threads: int) -> None:
    """Entry point of a rank the engine spawned on this machine."""
    _exit_with_parent()
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank{info.rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(threads)
    serve_rank(config, info)
    exit_now()


def launched_rank_main(config: EngineConfig) -> None:
    """Entry point of a rank > 0 started from outside (torchrun, one command per node)."""
    serve_rank(config, launched_rank_info(config))
    exit_now()
