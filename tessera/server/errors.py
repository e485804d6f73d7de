"""Errors and their wire shapes: TGI's {"error", "error_type"}, OpenAI's
{"error": {"message", "type", "param", "code"}} and Anthropic's
{"type": "error", "error": {"type", "message"}}."""
from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error with an HTTP status and a TGI error_type; routes render it in their dialect."""

    status = 500
    error_type = "generation"
    openai_type = "InternalServerError"

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    @property
    def tgi_message(self) -> str:
        return self.message


class ValidationFailed(APIError):
    status, error_type, openai_type = 422, "validation", "BadRequestError"

    @property
    def tgi_message(self) -> str:
        return f"Input validation error: {self.message}"


class Overloaded(APIError):
    status, error_type, openai_type = 429, "overloaded", "RateLimitError"


class GenerationFailed(APIError):
    status, error_type, openai_type = 424, "generation", "InternalServerError"

    @property
    def tgi_message(self) -> str:
        return f"Request failed during generation: {self.message}"


class NotFound(APIError):
    status, error_type, openai_type = 404, "validation", "NotFoundError"


class ModelNotFound(NotFound):
    pass


class Unavailable(APIError):
    status, error_type, openai_type = 503, "unhealthy", "ServiceUnavailableError"


class ClientGone(APIError):
    """The client closed the connection before its (non-streaming) reply: nginx's 499,
    answered to nobody, so the request ends without an error traceback in the log."""

    status, error_type, openai_type = 499, "client_closed_request", "ClientClosedRequest"


def tgi_error(exc: APIError) -> JSONResponse:
    return JSONResponse({"error": exc.tgi_message, "error_type": exc.error_type}, status_code=exc.status)


def _openai_status(exc: APIError) -> int:
    # OpenAI answers bad requests with 400 (TGI with 422); engine failures are 500 there.
    return {422: 400, 424: 500}.get(exc.status, exc.status)


def openai_error_body(exc: APIError) -> dict:
    return {"error": {"message": exc.message, "type": exc.openai_type, "param": exc.param,
                      "code": _openai_status(exc)}}


def openai_error(exc: APIError) -> JSONResponse:
    return JSONResponse(openai_error_body(exc), status_code=_openai_status(exc))


# Anthropic's error types, by the status it answers with
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error_body(exc: APIError) -> dict:
    status = _openai_status(exc)
    return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"), "message": exc.message}}


def anthropic_error(exc: APIError) -> JSONResponse:
    return JSONResponse(anthropic_error_body(exc), status_code=_openai_status(exc))
