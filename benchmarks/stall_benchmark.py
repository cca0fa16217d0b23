"""Does a request with a huge prediction stall the streams already running?

A ``foretell serve`` on the embedded model (started here on a free port). Stream A decodes
plainly (no prediction, no lookup) and its chunks' arrival times are kept. Once A has produced
``--warm-chunks`` chunks, request B arrives: the largest prediction the server allows
(``max_prediction_chars``, 1 MiB by default: a standard-library file repeated), a few output
tokens, not streamed. Tokenising B's prediction and diffing it against B's output for the usage
figures are the slow parts. Printed per run: A's median gap between chunks (one pass), its
largest gap while B was in flight and elsewhere, and B's latency.

    python benchmarks/stall_benchmark.py [--runs 3] [--baseline-ref REF]

``--baseline-ref`` runs the same against a git worktree of REF too, alternating runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
from load_benchmark import assemble_baseline, remove_baseline, start_server  # noqa: E402

from foretell.proxy.options import MAX_PREDICTION_CHARS as PREDICTION_CHARS  # noqa: E402  (the server's limit)


def huge_prediction() -> str:
    text = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").read_text()
    return (text * (PREDICTION_CHARS // len(text) + 1))[:PREDICTION_CHARS]


async def stream_a(client, base, model, arrivals: list[float], started: asyncio.Event, warm: int, tokens: int):
    body = {"model": model, "prompt": "Once upon a time, in a city by the sea,", "max_tokens": tokens,
            "temperature": 0, "stream": True}
    async with client.stream("POST", base + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                if json.loads(line[6:])["choices"][0].get("text"):
                    arrivals.append(time.perf_counter())
                    if len(arrivals) == warm:
                        started.set()


async def request_b(client, base, model, prediction: str) -> tuple[float, float, dict]:
    body = {"model": model, "messages": [{"role": "user", "content": "Repeat the file."}],
            "max_tokens": 8, "temperature": 0, "prediction": {"type": "content", "content": prediction}}
    sent = time.perf_counter()
    response = await client.post(base + "/v1/chat/completions", json=body)
    response.raise_for_status()
    return sent, time.perf_counter(), response.json()["usage"]


async def one_run(base: str, prediction: str, warm: int, tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600) as client:
        model = (await client.get(base + "/v1/models")).json()["data"][0]["id"]
        arrivals, started = [], asyncio.Event()
        a = asyncio.create_task(stream_a(client, base, model, arrivals, started, warm, tokens))
        await started.wait()
        sent, done, usage = await request_b(client, base, model, prediction)
        await a
    gaps = [(t1 - t0, t1) for t0, t1 in zip(arrivals, arrivals[1:])]
    during = [gap for gap, end in gaps if sent <= end <= done + 0.5]  # a gap ending while B ran
    outside = [gap for gap, end in gaps if not sent <= end <= done + 0.5]
    return {"median gap ms": 1000 * statistics.median(g for g, _ in gaps),
            "largest gap while B ran ms": 1000 * max(during, default=0.0),
            "largest gap otherwise ms": 1000 * max(outside, default=0.0),
            "B latency s": done - sent,
            "B accepted prediction tokens": usage["completion_tokens_details"]["accepted_prediction_tokens"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs per tree, each on a fresh server")
    parser.add_argument("--warm-chunks", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=160, help="stream A's output tokens")
    parser.add_argument("--baseline-ref", help="also run a git worktree of this commit")
    args = parser.parse_args()
    prediction = huge_prediction()
    trees = [("this tree", None)]
    site = assemble_baseline(args.baseline_ref) if args.baseline_ref else None
    if site is not None:
        trees.append((args.baseline_ref, site))
    rows = []
    try:
        for run in range(1, args.runs + 1):
            for name, tree in trees:
                process, base = start_server(max_queue=16, baseline_dir=tree)
                try:
                    figures = asyncio.run(one_run(base, prediction, args.warm_chunks, args.tokens))
                finally:
                    process.terminate()
                    process.wait()
                rows.append((name, run, figures))
                print(f"{name} run {run}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                        for k, v in figures.items()), file=sys.stderr, flush=True)
    finally:
        if site is not None:
            remove_baseline(site)
    keys = list(rows[0][2])
    print("\n| tree | run | " + " | ".join(keys) + " |\n|" + "---|" * (len(keys) + 2))
    for name, run, figures in rows:
        print(f"| {name} | {run} | " + " | ".join(f"{figures[k]:.2f}" if isinstance(figures[k], float)
                                                  else str(figures[k]) for k in keys) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
