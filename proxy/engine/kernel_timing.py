"""Which linear kernel is faster on this CPU, timed once and kept with the calibration.

``--quantize auto`` asks whether FBGEMM's int8 x int8 kernel (``invariant_linear.py``) beats float32
(MKL) on the model's largest product, its output head. The answer depends on the CPU (AVX2,
AVX-512, VNNI, AMX), the torch build and the thread count, never on the run, so it is measured
once per machine and shape and kept under the calibration folder (``int8-kernels.json``).

The product is timed at 1 and 8 rows (a decoding step and a short verify), the median of five
runs each, on random weights of the model's width and up to 32768 output rows: beyond the CPU's
caches both kernels stream their weights, so a slice ranks them as the whole head does.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger("foretell.engine")

TIMED_ROWS = (1, 8)
_MAX_TIMED_OUT = 32768
_FILE = "int8-kernels.json"


# What the CPU has that decides its kernels (torch's own checks, as oneDNN and FBGEMM dispatch).
_FEATURES = (("avx2", "_is_avx2_supported"), ("avx512", "_is_avx512_supported"),
             ("avx512_bf16", "_is_avx512_bf16_supported"), ("vnni", "_is_vnni_supported"),
             ("amx", "_is_amx_tile_supported"))


def cpu_features() -> list[str]:
    """The kernel-relevant features this CPU has, of AVX2, AVX-512, AVX512-BF16, VNNI, AMX."""
    found = []
    for name, check in _FEATURES:
        try:
            if getattr(torch.cpu, check)():
                found.append(name)
        except (AttributeError, RuntimeError):  # another architecture, or an older torch
            pass
    return found


def describe_cpu() -> dict:
    """What /health and the benchmarks name: the CPU's model, its kernel features, torch's threads."""
    from foretell.proxy.engine.calibration_cache import cpu_model

    return {"model": cpu_model(), "features": cpu_features(), "threads": torch.get_num_threads()}


def median_seconds(run, repeats: int = 5, warmup: int = 1) -> float:
    """The median wall time of ``repeats`` calls of ``run()``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def time_kernels(out_features: int, in_features: int) -> dict[str, float]:
    """Seconds for float32 and int8 x int8 products of (out, in) weights, summed over TIMED_ROWS."""
    from foretell.proxy.engine.invariant_linear import Int8DynamicLinear

    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(in_features, min(out_features, _MAX_TIMED_OUT), bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.05)
    integer = Int8DynamicLinear(linear)
    result = {"float32": 0.0, "int8": 0.0}
    with torch.inference_mode():
        for rows in TIMED_ROWS:
            x = torch.randn(rows, in_features, generator=generator)
            result["float32"] += median_seconds(lambda: torch.nn.functional.linear(x, linear.weight))
            result["int8"] += median_seconds(lambda: integer(x))
    return result


def _key(out_features: int, in_features: int) -> str:
    from foretell.proxy.engine.calibration_cache import cpu_model

    features = "+".join(cpu_features()) or "none"
    return (f"{cpu_model()}|{features}|torch {torch.__version__}|threads {torch.get_num_threads()}"
            f"|{out_features}x{in_features}")


def _path() -> Path:
    from foretell.proxy.engine.calibration_cache import calibration_dir

    return calibration_dir() / _FILE


def measured(out_features: int, in_features: int) -> dict[str, float]:
    """This machine's timings for an (out, in) product: from the kept file, else measured now."""
    from foretell.proxy.engine.calibration_cache import write_json

    key, path = _key(out_features, in_features), _path()
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if not isinstance(known, dict):
        known = {}
    entry = known.get(key)
    if not (isinstance(entry, dict) and {"float32", "int8"} <= entry.keys()):
        entry = time_kernels(out_features, in_features)
        known[key] = entry
        try:
            write_json(path, known)
        except OSError as error:  # a read-only cache folder: timed again next start
            log.warning("could not keep the kernel timings at %s: %s", path, error)
        log.info("timed the %dx%d product on this CPU (features: %s): float32 %.2f ms, int8 x int8 "
                 "%.2f ms (rows %s)", out_features, in_features, ", ".join(cpu_features()) or "none",
                 1000 * entry["float32"], 1000 * entry["int8"], "+".join(map(str, TIMED_ROWS)))
    return entry


def int8_beats_float32(out_features: int, in_features: int) -> bool:
    """Whether the int8 x int8 kernel is faster than float32 for an (out, in) product here."""
    timing = measured(out_features, in_features)
    return timing["int8"] < timing["float32"]
