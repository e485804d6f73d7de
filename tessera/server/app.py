"""The FastAPI app: TGI and OpenAI routes on one port, health, metrics, auth and errors."""
from __future__ import annotations

import hmac

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

from tessera.server import (anthropic_messages, conversations, embeddings, lora_routes, openai_completions,
                            openai_responses, openai_routes, scores, tgi, tokenize_routes)
from tessera.server.errors import APIError, Unavailable, ValidationFailed, anthropic_error, openai_error, tgi_error
from tessera.server.state import ServerState


# routes that generate text: an embedding model refuses them (it has no LM head)
GENERATIVE_PATHS = ("/generate", "/generate_stream", "/v1/chat/completions", "/v1/completions", "/v1/responses",
                    "/v1/messages")


def _is_openai(request: Request) -> bool:
    # /v1/* and the vLLM routes outside it (tokenize_routes.py says which, per request)
    return request.url.path.startswith("/v1/") or getattr(request.state, "openai_errors", False)


def _render(request: Request, exc: APIError) -> JSONResponse:
    if request.url.path.startswith("/v1/messages"):  # Anthropic's routes
        return anthropic_error(exc)
    return openai_error(exc) if _is_openai(request) else tgi_error(exc)


def _describe(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "; ".join(parts) or "invalid request body"


class _Guard:
    """API key, body size and readiness checks, as plain ASGI middleware: Starlette's
    `@app.middleware("http")` wraps `receive`, which hides client disconnects from
    `request.is_disconnected()` (and non-streaming requests would then never abort)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request = Request(scope)
        error = self._check(request)
        if error is not None:
            return await _render(request, error)(scope, receive, send)
        if self.state.pooling and scope["path"] == "/" and request.method == "POST":
            # TEI's root route: clients such as InferenceClient.feature_extraction (or, for a
            # classifier, text_classification) post there
            path = "/predict" if self.state.pooler.task == "classify" else "/embed"
            scope = {**scope, "path": path, "raw_path": path.encode()}
        if "content-length" not in request.headers and request.method in ("POST", "PUT", "PATCH"):
            # a chunked body has no length to check up front: count it as it comes
            messages = []
            size, limit = 0, self._body_limit()
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                size += len(message.get("body", b""))
                if size > limit:
                    return await _render(request, self._too_large(f"more than {limit}", limit))(scope, receive, send)
                messages.append(message)
                if not message.get("more_body"):
                    break

            async def replay():  # the body read above, then the client's later messages (disconnect)
                return messages.pop(0) if messages else await receive()

            return await self.app(scope, replay, send)
        await self.app(scope, receive, send)

    def _body_limit(self) -> int:
        return self.state.limits.max_body_bytes or 2_000_000  # unset until the model is known

    @staticmethod
    def _too_large(size: str, limit: int) -> APIError:
        err = ValidationFailed(f"request body of {size} bytes exceeds the limit of {limit} bytes "
                               "(tessera serve --payload-limit)")
        err.status = 413
        return err

    def _check(self, request: Request) -> APIError | None:
        state = self.state
        path = request.url.path
        if state.api_key and path != "/health":
            # OpenAI's clients send "Authorization: Bearer KEY", Anthropic's "x-api-key: KEY"
            given = request.headers.get("authorization", "")
            if not (hmac.compare_digest(given.encode(), f"Bearer {state.api_key}".encode())
                    or hmac.compare_digest(request.headers.get("x-api-key", "").encode(), state.api_key.encode())):
                err = APIError("invalid or missing API key")
                err.status, err.error_type, err.openai_type = 401, "authentication", "AuthenticationError"
                return err
        length = request.headers.get("content-length")
        limit = self._body_limit()
        if length is not None and length.isdigit() and int(length) > limit:
            return self._too_large(length, limit)
        if not state.ready and path not in ("/health", "/metrics"):
            return Unavailable("the model is still loading")
        if state.pooling and path in GENERATIVE_PATHS:
            return ValidationFailed("this server serves an embedding model, which generates no text: "
                                    "POST /v1/embeddings (OpenAI) or /embed (TEI)")
        return None


def create_app(state: ServerState, lifespan=None) -> FastAPI:
    app = FastAPI(title="tessera", version="0.1.0", lifespan=lifespan)
    app.state.tessera = state

    def count_refusal(exc: APIError) -> None:
        """A request refused before it reached the engine counts as a validation error (the
        engine's own refusals are counted where they are raised, tracking.run_request)."""
        if isinstance(exc, ValidationFailed) and not getattr(exc, "counted", False):
            state.metrics.requests.labels(outcome="validation_error").inc()

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        count_refusal(exc)
        return _render(request, exc)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        # a bug: still the route's error body, not a bare text 500 (the traceback is logged)
        return _render(request, APIError(f"internal error: {type(exc).__name__}: {exc}"))

    @app.exception_handler(HTTPException)
    async def route_error(request: Request, exc: HTTPException) -> Response:
        # no such route or method: Anthropic's clients read their own error shape (the
        # others get FastAPI's {"detail"}, as vLLM and TGI answer)
        if not request.url.path.startswith("/v1/messages"):
            return await http_exception_handler(request, exc)
        error = APIError(str(exc.detail))
        error.status = exc.status_code
        return anthropic_error(error)

    @app.exception_handler(RequestValidationError)
    async def body_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        refusal = ValidationFailed(_describe(exc))
        count_refusal(refusal)
        return _render(request, refusal)

    app.add_middleware(_Guard, state=state)

    @app.get("/health")
    async def health() -> Response:
        if state.ready and state.engine is not None and state.engine.is_healthy():
            return JSONResponse({})
        return JSONResponse({"error": "unhealthy", "error_type": "healthcheck"}, status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(tgi.router)
    app.include_router(tokenize_routes.router)
    app.include_router(openai_routes.router)
    app.include_router(openai_completions.router)
    app.include_router(openai_responses.router)
    app.include_router(conversations.router)
    app.include_router(anthropic_messages.router)
    app.include_router(embeddings.router)
    app.include_router(scores.router)
    if state.allow_runtime_lora_updating:
        app.include_router(lora_routes.router)
    return app
