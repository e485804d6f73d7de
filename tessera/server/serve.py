"""`tessera serve`: start the HTTP server at once, load and warm the model in the background
(/health says 503 until then), and drain in-flight requests on SIGTERM."""
from __future__ import annotations

import logging
import os
import sys
import threading
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Callable

import uvicorn

from tessera.engine.engine import Engine
from tessera.server.app import create_app
from tessera.server.async_engine import AsyncEngine
from tessera.server.conversations_store import ConversationStore
from tessera.server.responses_store import ResponseStore
from tessera.server.state import ServerLimits, ServerState

logger = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would end the
    process with -15; a drained, orderly exit is status 0."""

    @contextmanager
    def capture_signals(self):
        with super().capture_signals():
            try:
                yield
            finally:  # before uvicorn's exit handler would re-raise them
                self._captured_signals.clear()


def run_server(make_engine: Callable[[], Engine], *, model_name: str, host: str = "127.0.0.1",
               port: int = 8080, api_key: str | None = None, max_concurrent_requests: int = 128,
               max_input_tokens: int | None = None, drain_timeout_s: float = 30.0,
               tool_call_parser: str | None = None, reasoning_parser: str | None = None,
               allow_runtime_lora_updating: bool = False, payload_limit: int | None = None,
               allowed_local_media_path: str | None = None, max_images_per_prompt: int = 8,
               responses_store_size: int = 1000, prompt_tokens_details: bool = False) -> int:
    state = ServerState(model_name, ServerLimits(max_concurrent_requests=max_concurrent_requests,
                                                 max_input_tokens=max_input_tokens or 0,
                                                 max_body_bytes=payload_limit,
                                                 max_images_per_prompt=max_images_per_prompt), api_key,
                        tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                        allow_runtime_lora_updating=allow_runtime_lora_updating,
                        allowed_local_media_path=Path(allowed_local_media_path).expanduser()
                        if allowed_local_media_path else None,
                        responses=ResponseStore(responses_store_size),
                        conversations=ConversationStore(responses_store_size),
                        prompt_tokens_details=prompt_tokens_details)
    failed: list[BaseException] = []
    server: uvicorn.Server | None = None
    stopping = threading.Event()  # the server is shutting down: a late engine is not attached
    attach_lock = threading.Lock()

    def load() -> None:
        try:
            engine = AsyncEngine(make_engine(), max_concurrent_requests)
            with attach_lock:
                if stopping.is_set():  # loaded just as the server stopped: nothing will serve it
                    engine.engine.close()
                    return
                engine.start()
                state.attach(engine)
            logger.info("ready: serving %s on http://%s:%d (TGI routes and OpenAI /v1)", model_name, host, port)
        except BaseException as exc:  # noqa: BLE001 - reported, then the server exits non-zero
            if isinstance(exc, (ValueError, FileNotFoundError)):  # a setting or a path: its message says it
                logger.error("loading the model failed: %s", exc)
            else:  # a bug: the traceback is what helps
                logger.exception("loading the model failed")
            failed.append(exc)
            if server is not None:
                server.should_exit = True

    loader = threading.Thread(target=load, name="tessera-load", daemon=True)

    @asynccontextmanager
    async def lifespan(app):
        loader.start()
        yield
        with attach_lock:
            stopping.set()
        if state.engine is not None:  # uvicorn has drained the connections by now
            state.engine.shutdown(timeout=drain_timeout_s)

    app = create_app(state, lifespan=lifespan)
    config = uvicorn.Config(app, host=host, port=port, log_level="info",
                            timeout_graceful_shutdown=int(drain_timeout_s))
    server = _Server(config)
    server.run()
    status = 1 if failed else 0
    if loader.is_alive():
        # stopped (SIGTERM, Ctrl-C) while the model loads or warms up: the loader thread is
        # inside torch and the kernels, which the interpreter's exit would tear down under it
        # (std::terminate: an abort, status 134). Nothing has been served; end here.
        logger.info("stopped while the model was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
