"""Row-invariant attention over a paged KV pool on the CPU: a native loop (``row_attention.cpp``)
with a pure-torch reference.

Why: the batch-invariant attention as torch operations (``proxy/engine/invariant_attention.py``)
cost ~330 us a layer for one decoding row of the embedded model (a gather, pads, two batched
products, masks, per-chunk sums: mostly per-operation overhead), a sixth of a plain int8 step on
a 2-core CPU; with this loop the attention takes ~110 us a layer, Python included
(``benchmarks/step_parts.py --torch-attention`` beside the default, docs/benchmarks.md). Each
(head, query row) reads only its own visible keys, in slot order, with a fixed summation order,
so a row's bits do not depend on the pass it is in.

The extension is compiled once per source, torch, Python and CPU (``-march=native``) into the
foretell cache folder (``$FORETELL_CACHE_DIR`` or ``~/.cache/foretell``, under ``native/``);
``scripts/setup.sh`` builds it (``python -m foretell.kernels.row_attention``). Where it cannot be
built (no C++ compiler), ``native_row_attention()`` returns None and says why once; the engine
then keeps the torch operations.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import sys
import time
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("row_attention.cpp")
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
HEAD_SIZE_STEP = 16  # the loop takes head sizes in whole vectors of 16 floats

log = logging.getLogger("foretell.kernels")


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted)


def build_dir() -> Path:
    key = hashlib.sha256("\n".join([SOURCE.read_text(), torch.__version__, sys.version, " ".join(CFLAGS),
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    configured = os.environ.get("FORETELL_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "foretell"
    return base / "native" / f"row_attention-{key}"


def _import_built(folder: Path):
    """The already built module, imported without torch's build machinery (~1 s of checks)."""
    built = sorted(folder.glob("foretell_row_attention*.so"))
    if not built:
        return None
    loader = importlib.machinery.ExtensionFileLoader("foretell_row_attention", str(built[0]))
    spec = importlib.util.spec_from_file_location("foretell_row_attention", built[0], loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def native_module():
    """The compiled extension (built on first use, ~25 s on two cores), or None where it cannot
    be built; the reason is logged once."""
    folder = build_dir()
    try:
        module = _import_built(folder)
        if module is not None:
            return module
        from torch.utils.cpp_extension import load

        folder.mkdir(parents=True, exist_ok=True)
        print("foretell: building the native attention loop (once per CPU and torch; ~25 s)",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        module = load("foretell_row_attention", [str(SOURCE)], extra_cflags=CFLAGS,
                      build_directory=str(folder), verbose=False)
        print(f"foretell: built the native attention loop in {time.perf_counter() - start:.0f} s",
              file=sys.stderr, flush=True)
        return module
    except Exception as error:  # no compiler, no headers: the torch operations serve instead
        log.warning("native attention loop unavailable (%s: %s); attention runs as torch operations",
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return None


def native_row_attention():
    """The launcher if the extension is available, else None."""
    return row_attention if native_module() is not None else None


def row_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                  visible: torch.Tensor, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """query [heads, q, d]; keys, values [kv_heads, pool slots, d] (the whole pool of one layer);
    slots [n] the pool slots of the keys in position order; visible [q, n] bool.
    Returns out [q, heads, d] (written in place when given). float32 on the CPU."""
    heads, rows, d = query.shape
    kv_heads, _, kd = keys.shape
    n = slots.shape[0]
    assert keys.shape == values.shape and kd == d, f"keys {tuple(keys.shape)}, values {tuple(values.shape)}, d {d}"
    assert heads % kv_heads == 0, f"{heads} heads over {kv_heads} KV heads"
    assert visible.shape == (rows, n) and visible.dtype == torch.bool, f"visible {tuple(visible.shape)}"
    assert d % HEAD_SIZE_STEP == 0, f"head size {d} is not a multiple of {HEAD_SIZE_STEP}"
    assert query.dtype == keys.dtype == values.dtype == torch.float32, "float32 only"
    assert all(t.stride(-1) == 1 for t in (query, keys, values, visible)), "last dimensions must be contiguous"
    if out is None:
        out = query.new_empty(rows, heads, d)
    assert out.shape == (rows, heads, d) and out.stride(-1) == 1 and out.dtype == torch.float32
    native_module().row_attention(query, keys, values, slots.to(torch.int64).contiguous(), visible, float(scale), out)
    return out


def row_attention_reference(query, keys, values, slots, visible, scale) -> torch.Tensor:
    """The same attention in float64 torch operations: softmax over each row's visible keys."""
    heads = query.shape[0]
    k = keys.index_select(1, slots).double()  # [kv, n, d]
    v = values.index_select(1, slots).double()
    group = heads // keys.shape[0]
    k, v = k.repeat_interleave(group, dim=0), v.repeat_interleave(group, dim=0)  # [heads, n, d]
    scores = torch.bmm(query.double() * scale, k.transpose(1, 2)).masked_fill(~visible, float("-inf"))
    return torch.bmm(torch.softmax(scores, dim=-1), v).transpose(0, 1)  # [q, heads, d]


if __name__ == "__main__":  # scripts/setup.sh: build now rather than at the first server start
    logging.basicConfig(level=logging.WARNING)
    sys.exit(0 if native_module() is not None else 1)
