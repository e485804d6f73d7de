"""Errors the engine raises that callers treat differently."""
from __future__ import annotations


class EngineFatalError(RuntimeError):
    """The engine cannot run another step (a tensor-parallel rank died, ...): the server
    marks itself unhealthy and answers every request with an error."""
