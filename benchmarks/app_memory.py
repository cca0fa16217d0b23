"""What an app built and closed inside one process leaves behind: the app ``foretell serve``
builds (``create_app``, the embedded model in float32 unless ``--dtype``), served by a real uvicorn
on 127.0.0.1, one completion asked of it, then closed; ``--cycles`` times in one process. Prints
the process's anonymous resident memory after each close (after a collection and
``malloc_trim``), and whether the closed app's model is still alive. The test suite builds dozens
of such apps per worker process, so a leak here is what its workers grow by.

    python benchmarks/app_memory.py [--cycles 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import sys
import weakref
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.serving, run from anywhere

import httpx  # noqa: E402

from foretell.proxy.engine.model_loader import resolve_model_folder  # noqa: E402
from tests.serving import serve, tiny_app  # noqa: E402


def anonymous_gib() -> float:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("RssAnon"))
    return kib / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=3, help="apps built and closed in turn (default 3)")
    parser.add_argument("--dtype", default="float32", help="the app's --dtype (default float32)")
    args = parser.parse_args()
    folder = resolve_model_folder(None)[1]
    print(f"before any app: {anonymous_gib():.2f} GiB anonymous")
    for cycle in range(1, args.cycles + 1):
        app = tiny_app(folder, served_model_name="embedded", dtype=args.dtype)
        with serve(app, "memory") as served:
            answer = httpx.post(served.base + "/v1/completions", timeout=120,
                                json={"model": "embedded", "prompt": "def f(", "max_tokens": 8})
            answer.raise_for_status()
            model = weakref.ref(app.state.foretell.local.loaded.model)
        del app, served
        print(f"after app {cycle} closed: {anonymous_gib():.2f} GiB anonymous, "
              f"its model {'still alive' if model() is not None else 'freed'}")


if __name__ == "__main__":
    main()
