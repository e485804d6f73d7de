"""Dequantization speed of pre-quantized formats (weights/prequantized.py): one 14336 x 4096
weight (Llama-3-8B's MLP shape), median of 5, 2 threads. Prints markdown table rows."""
import statistics, time, torch
from tessera.weights.prequantized import WeightScheme, _compressed_tensors_weight, _gptq_weight, _awq_weight
from tessera.weights.dequantize import ScaleLayout, dequantize_weight
torch.set_num_threads(2)
rows, cols = 14336, 4096
g = torch.Generator().manual_seed(0)
def words(shape): return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=g)
ct = {"weight_packed": words((rows, cols // 8)), "weight_shape": torch.tensor([rows, cols]),
      "weight_scale": torch.rand(rows, cols // 128, dtype=torch.bfloat16)}
gptq = {"qweight": words((cols // 8, rows)), "qzeros": words((cols // 128, rows // 8)),
        "scales": torch.rand(cols // 128, rows, dtype=torch.float16), "g_idx": torch.arange(cols) // 128}
awq = {"qweight": words((cols, rows // 8)), "qzeros": words((cols // 128, rows // 8)),
       "scales": torch.rand(cols // 128, rows, dtype=torch.float16)}
fp8, fp8_scale = torch.randn(rows, cols).to(torch.float8_e4m3fn), torch.rand(rows // 128, cols // 128)
cases = {
  "compressed-tensors int4 g128 (W4A16)": lambda: _compressed_tensors_weight(
      ct, WeightScheme("pack-quantized", 4, ScaleLayout("group", group_size=128), True)),
  "GPTQ int4 g128 (v1)": lambda: _gptq_weight(gptq, 4, 128, True),
  "AWQ int4 g128": lambda: _awq_weight(awq, 128),
  "fp8 e4m3, 128x128 block scales": lambda: dequantize_weight(fp8, fp8_scale, ScaleLayout("block", block=(128, 128))),
}
for name, fn in cases.items():
    fn()
    times = []
    for _ in range(5):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    m = statistics.median(times)
    print(f"| {name} | {m*1000:.0f} ms | {rows*cols/m/1e6:.0f} |")
