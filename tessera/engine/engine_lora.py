"""The engine's LoRA adapter calls (mixed into tessera.engine.engine.Engine, whose
`loras` registry they use: None unless --enable-lora)."""
from __future__ import annotations

from tessera.engine.request_checks import RequestError
from tessera.lora.adapter import LoRAAdapter, LoRAAdapterError
from tessera.lora.registry import LoRARegistry
from tessera.lora.request import LoRARequest


class LoRAMethods:
    loras: LoRARegistry | None

    def add_lora(self, request: LoRARequest) -> LoRAAdapter:
        """Load an adapter (a no-op when that name is loaded from that folder); any thread."""
        return self._require_lora().add(request)

    def remove_lora(self, name: str) -> bool:
        """Unload the adapter `name` (requests already running with it finish with it)."""
        return self._require_lora().remove(name)

    def list_loras(self) -> list[LoRAAdapter]:
        return [] if self.loras is None else self.loras.adapters()

    def _require_lora(self) -> LoRARegistry:
        if self.loras is None:
            raise RequestError("LoRA adapters are not enabled: start with --enable-lora "
                               "(LLM(..., enable_lora=True))")
        return self.loras

    def _resolve_lora(self, request: LoRARequest | str | None) -> LoRAAdapter | None:
        if request is None:
            return None
        try:
            return self._require_lora().resolve(request)
        except LoRAAdapterError as exc:
            raise RequestError(str(exc)) from exc
