"""The linear kernels on this CPU, per shape of the embedded model and rows per pass: float32
(MKL), bf16 (oneDNN; only where the CPU runs it natively, else the column says "-"), PyTorch's
int8 weight-only kernel (``aten._weight_int8pack_mm``) and the int8 x int8 layer the engine
runs at ``--quantize int8`` (``Int8DynamicLinear``: FBGEMM, two activation levels, quantization
included), medians of 7 runs in milliseconds, random weights.

    python benchmarks/linear_kernels.py [--rows 1,4,16,64] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from foretell.proxy.engine.invariant_linear import Int8DynamicLinear
from foretell.proxy.engine.kernel_timing import describe_cpu
from foretell.proxy.engine.precision import cpu_has_native_bf16

# (name, out, in) of Gemma 3 270M's products: the head, q/k/v stacked, o, gate/up stacked, down.
SHAPES = (("head", 262144, 640), ("qkv", 1536, 640), ("o", 640, 1024), ("gate+up", 4096, 640),
          ("down", 640, 2048))


def median_ms(run, repeats: int = 7) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = describe_cpu()
    print(f"CPU: {cpu['model']}; kernel features: {', '.join(cpu['features']) or 'none'}; "
          f"torch {torch.__version__}, {cpu['threads']} threads")
    native_bf16 = cpu_has_native_bf16()  # emulated bf16 is many times slower: not worth timing
    print("\n| product | rows | float32 (ms) | bf16 (ms) | int8 weight-only (ms) | int8 x int8 (ms) "
          "| int8 x int8 vs float32 |")
    print("|---|---|---|---|---|---|---|")
    generator = torch.Generator().manual_seed(0)
    for name, out, inp in SHAPES:
        linear = torch.nn.Linear(inp, out, bias=False)
        linear.weight.copy_(torch.randn(out, inp, generator=generator) * 0.05)
        weight = linear.weight.detach()
        scale = weight.abs().amax(dim=1) / 127
        qweight = torch.round(weight / scale[:, None]).to(torch.int8)
        integer = Int8DynamicLinear(linear)
        weight_bf16 = weight.to(torch.bfloat16)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, inp, generator=generator)
            fp32 = median_ms(lambda: torch.nn.functional.linear(x, weight))
            x_bf16 = x.to(torch.bfloat16)  # a bf16 model's rows are bf16 already
            bf16 = (f"{median_ms(lambda: torch.nn.functional.linear(x_bf16, weight_bf16)):.2f}"
                    if native_bf16 else "-")
            weight_only = median_ms(lambda: torch.ops.aten._weight_int8pack_mm(x, qweight, scale))
            int8 = median_ms(lambda: integer(x))
            print(f"| {name} {out}x{inp} | {rows} | {fp32:.2f} | {bf16} | {weight_only:.2f} | {int8:.2f} | "
                  f"{fp32 / int8:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
