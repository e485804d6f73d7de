"""vLLM's runtime adapter routes, mounted only with --allow-runtime-lora-updating (they
read folders on the server's disk): POST /v1/load_lora_adapter {"lora_name", "lora_path"}
and POST /v1/unload_lora_adapter {"lora_name"}. Loaded adapters are served at once under
their name (`model` on OpenAI routes, `adapter_id` on TGI's); requests already running
with an unloaded adapter finish with it."""
from __future__ import annotations

import asyncio
import itertools

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tessera.engine.engine import RequestError
from tessera.lora.adapter import LoRAAdapterError
from tessera.lora.request import LoRARequest
from tessera.server.errors import ModelNotFound, ValidationFailed
from tessera.server.state import ServerState

router = APIRouter(prefix="/v1")
_ids = itertools.count(1_000_000)  # LoRARequest ids for runtime loads (ours ignore them)


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # accepted as vLLM does; the name decides


def _state(request: Request) -> ServerState:
    return request.app.state.tessera


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request, body: LoadLoRAAdapterRequest) -> PlainTextResponse:
    state = _state(request)
    name = body.lora_name
    if not name or not body.lora_path:
        raise ValidationFailed("both `lora_name` and `lora_path` must be given", param="lora_name")
    if name == state.model_name or name in state.lora_names():
        raise ValidationFailed(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
    try:  # reading the folder takes a while: not on the event loop
        await asyncio.to_thread(state.engine.engine.add_lora, LoRARequest(name, next(_ids), body.lora_path))
    except (LoRAAdapterError, RequestError) as exc:
        raise ValidationFailed(str(exc), param="lora_path") from exc
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request, body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
    state = _state(request)
    try:
        removed = state.engine.engine.remove_lora(body.lora_name)
    except RequestError as exc:  # LoRA is not enabled
        raise ValidationFailed(str(exc), param="lora_name") from exc
    if not removed:
        raise ModelNotFound(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
