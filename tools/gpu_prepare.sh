#!/usr/bin/env bash
# Run here (a machine with pip access), before asking for a lent GPU machine: puts under .gpu/
# (git-ignored, carried with `carry: [".gpu"]`) what tools/gpu_run.sh needs there, where
# nothing can be downloaded: Python 3.12 wheels of tessera's dependencies that the GPU
# image may lack, and the llama-3-8b preset folder (config.json + tokenizer; the default
# model's 93 MB package is over the carry limit, so the preset is written here).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")" && touch "$exclude"
grep -qx "/.gpu/" "$exclude" || echo "/.gpu/" >> "$exclude"
rm -rf .gpu && mkdir -p .gpu/whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# resolved together, so pinned pairs (pydantic / pydantic-core) match; pytest and
# pytest-timeout are not carried: the image has them, with the plugins built against them
python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .gpu/whl fastapi uvicorn prometheus-client httpx openai
# peft (+ accelerate, which it imports): the GPU LoRA test; text-generation (TGI's client,
# whose pins transformers 5 cannot meet, as in the README): the GPU server test.
# transformers as installed here (the image's is older than some model folders' configs) and
# the regex it checks for at import (the image's hub, tokenizers and safetensors meet its pins)
transformers=$(python -c 'import transformers; print(transformers.__version__)')
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
    -d .gpu/whl gguf peft accelerate text-generation==0.7.0 "transformers==$transformers" regex
# the GPU image has these already (torch, numpy, ...): carrying them would shadow its builds.
# typing_extensions is carried: the carried anyio and pydantic need 4.16+, which the image
# may not have (pure Python, and torch takes any 4.10+)
rm -f .gpu/whl/{numpy,torch,packaging,idna,certifi,pyyaml,PyYAML,pytest,pluggy,iniconfig}-*.whl
python - <<'PY'
from pathlib import Path
from tessera.bench.presets import write_preset
from tessera.config import ModelConfig
write_preset("llama-3-8b", ModelConfig().cache_dir, Path(".gpu/presets/llama-3-8b"))
PY
du -sh .gpu
