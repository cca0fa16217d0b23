"""Load benchmark: N concurrent streaming requests over HTTP against ``foretell serve``.

Reports, per concurrency level and with / without prediction: TTFT, TPOT, ITL (p50/p90/p99),
output tokens/s over the whole run, and acceptance. The workload is the edit workload of
``edit_benchmark.py`` (a copy prompt of an edited file, the file before the edit as prediction).

    python benchmarks/load_benchmark.py [--base-url URL] [--concurrency 1 4 8] [--requests 8]

Without ``--base-url`` it starts ``foretell serve`` on the embedded model on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edit_benchmark import STDLIB_FILES, copy_prompt, edit  # noqa: E402


def percentile(values, q):
    if not values:
        return float("nan")
    values = sorted(values)
    index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
    return values[index]


def workload(count: int, max_lines: int):
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    items = []
    for name in STDLIB_FILES:
        lines = (stdlib / name).read_text().splitlines(keepends=True)[:max_lines]
        before = "".join(lines)
        items.append((copy_prompt(name, edit(before)), before))
    return [items[i % len(items)] for i in range(count)]


async def one_request(client, base, model, prompt, prediction, max_tokens):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if prediction is not None:
        body["prediction"] = {"type": "content", "content": prediction}
    started = time.perf_counter()
    arrivals, usage, speculation = [], None, None
    async with client.stream("POST", base + "/v1/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.perf_counter())
            if chunk.get("usage"):
                usage, speculation = chunk["usage"], chunk.get("speculation")
    end = time.perf_counter()
    tokens = usage["completion_tokens"]
    ttft = arrivals[0] - started if arrivals else end - started
    return {
        "ttft": ttft,
        "tpot": (end - started - ttft) / max(tokens - 1, 1),
        "itl": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "tokens": tokens,
        "drafted": speculation["drafted_tokens"] if speculation else 0,
        "accepted": speculation["accepted_tokens"] if speculation else 0,
    }


async def run_level(base, model, items, concurrency, with_prediction, max_tokens):
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def bounded(prompt, prediction):
            async with limit:
                return await one_request(client, base, model, prompt,
                                         prediction if with_prediction else None, max_tokens)
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p, pred) for p, pred in items))
        wall = time.perf_counter() - started
    itl = [gap for r in results for gap in r["itl"]]
    drafted = sum(r["drafted"] for r in results)
    return {
        "concurrency": concurrency, "prediction": with_prediction,
        "ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results], "itl": itl,
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "acceptance": sum(r["accepted"] for r in results) / drafted if drafted else None,
    }


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(max_queue: int):
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "foretell.cli", "serve", "--port", str(port),
                                "--max-queue", str(max_queue)], env=dict(os.environ, HF_HUB_OFFLINE="1"))
    base = f"http://127.0.0.1:{port}"
    while True:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return process, base
        except httpx.TransportError:
            pass
        if process.poll() is not None:
            raise SystemExit("foretell serve exited")
        time.sleep(0.5)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running foretell server (default: start one)")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--requests", type=int, default=8, help="requests per level (default 8)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--max-lines", type=int, default=40, help="lines of each source file")
    args = parser.parse_args()

    process = None
    base = args.base_url
    if base is None:
        process, base = start_server(max_queue=max(args.concurrency) + 1)
    try:
        items = workload(args.requests, args.max_lines)
        print("| concurrency | prediction | TTFT p50/p90/p99 (s) | TPOT p50/p90/p99 (ms) | "
              "ITL p50/p90/p99 (ms) | output tok/s | acceptance |")
        print("|---|---|---|---|---|---|---|")
        for concurrency in args.concurrency:
            for with_prediction in (False, True):
                r = asyncio.run(run_level(base, args.model, items, concurrency, with_prediction,
                                          args.max_tokens))
                pct = lambda xs, scale: "/".join(f"{scale * percentile(xs, q):.{0 if scale > 1 else 2}f}"  # noqa: E731
                                                 for q in (50, 90, 99))
                acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                print(f"| {concurrency} | {'yes' if with_prediction else 'no'} | {pct(r['ttft'], 1)} | "
                      f"{pct(r['tpot'], 1000)} | {pct(r['itl'], 1000)} | {r['tok_s']:.1f} | {acceptance} |",
                      flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
