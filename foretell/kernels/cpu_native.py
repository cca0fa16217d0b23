"""Building and loading foretell's native CPU extensions (``foretell/kernels/*.cpp``).

Each is compiled once per source, torch, Python and CPU (``-march=native``) into the foretell
cache folder (``$FORETELL_CACHE_DIR`` or ``~/.cache/foretell``, under ``native/``);
``scripts/setup.sh`` builds them all (``python -m foretell.kernels.cpu_native``), so no server
start waits for a compiler. Where one cannot be built (no C++ compiler), ``load_native`` returns
None and says why once; its caller keeps the torch operations it replaces.
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

HERE = Path(__file__).parent
# -ffp-contract=off: every multiply and add rounds as written, whichever loop the compiler emits.
CFLAGS = ["-O3", "-march=native", "-ffp-contract=off"]
EXTENSIONS = {  # source stem: what it is, for the messages
    "row_attention": "the native attention loop",
    "int8_rows": "the native int8 row quantization",
    "row_norm": "the native RMSNorm",
    "head_candidates": "the native search of the head's candidates",
}

log = logging.getLogger("foretell.kernels")


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted)


def build_dir(name: str) -> Path:
    source = (HERE / f"{name}.cpp").read_text()
    key = hashlib.sha256("\n".join([source, torch.__version__, sys.version, " ".join(CFLAGS),
                                    _cpu_identity()]).encode()).hexdigest()[:16]
    configured = os.environ.get("FORETELL_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "foretell"
    return base / "native" / f"{name}-{key}"


def _import_built(module_name: str, folder: Path):
    """The already built module, imported without torch's build machinery (~1 s of checks)."""
    built = sorted(folder.glob(f"{module_name}*.so"))
    if not built:
        return None
    loader = importlib.machinery.ExtensionFileLoader(module_name, str(built[0]))
    spec = importlib.util.spec_from_file_location(module_name, built[0], loader=loader)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def load_native(name: str):
    """The compiled extension ``foretell/kernels/<name>.cpp`` (built on first use, ~20 s on two
    cores), or None where it cannot be built; the reason is logged once."""
    what, module_name, folder = EXTENSIONS[name], f"foretell_{name}", build_dir(name)
    try:
        module = _import_built(module_name, folder)
        if module is not None:
            return module
        from torch.utils.cpp_extension import load

        folder.mkdir(parents=True, exist_ok=True)
        print(f"foretell: building {what} (once per CPU and torch; ~20 s)", file=sys.stderr, flush=True)
        start = time.perf_counter()
        module = load(module_name, [str(HERE / f"{name}.cpp")], extra_cflags=CFLAGS,
                      build_directory=str(folder), verbose=False)
        print(f"foretell: built {what} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        return module
    except Exception as error:  # no compiler, no headers: the torch operations serve instead
        log.warning("%s unavailable (%s: %s); torch operations serve instead", what,
                    type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return None


if __name__ == "__main__":  # scripts/setup.sh: build now rather than at the first server start
    logging.basicConfig(level=logging.WARNING)
    sys.exit(0 if all(load_native(name) is not None for name in EXTENSIONS) else 1)
