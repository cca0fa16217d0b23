"""Replicas benchmark: a shared-prefix workload against ``foretell serve --replicas``, in one run:
1 replica, 2 replicas routed round-robin, 2 replicas with prefix affinity (the default).

The workload: a few documents (standard-library source files) each asked several questions, the
requests in a seeded shuffled order, a few at a time; each prompt is the document then its
question, so requests on the same document share a long prefix. Reported per configuration:
the share of prompt tokens served from a replica's prefix cache (``cached_tokens`` in usage),
time to first token (median and p90), wall time. On a machine whose replicas share its cores
(this 2-core one: one core each) the figures show placement, not scaling.

    python benchmarks/replicas_benchmark.py [--documents 4] [--questions 6] [--concurrency 4]
        [--kv-cache-tokens 65536 2048] [--lines 60]

Each configuration starts ``foretell serve --replicas N --no-calibrate`` (a local Ray instance) on
the embedded model at the default precision (harness/live_server.py), and stops it before the
next.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from edit_benchmark import STDLIB_FILES  # noqa: E402
from load_benchmark import one_request, percentile  # noqa: E402

from harness.live_server import live_server  # noqa: E402

CONFIGURATIONS = [(1, "affinity"), (2, "round-robin"), (2, "affinity")]


def workload(documents: int, questions: int, lines: int, seed: int) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in STDLIB_FILES[:documents]:
        text = "".join((stdlib / name).read_text().splitlines(keepends=True)[:lines])
        for q in range(questions):
            prompts.append(f"Here is {name}:\n\n{text}\n\nQuestion {q + 1}: what does line {q * 7 + 3} do?\n")
    random.Random(seed).shuffle(prompts)
    return prompts


async def run_workload(base: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def bounded(prompt):
            async with limit:
                return await one_request(client, base, "gemma-3-270m", prompt, None, max_tokens)
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        wall = time.perf_counter() - started
    ttft = [r["ttft"] for r in results]
    prompt = sum(r["usage"]["prompt_tokens"] for r in results)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in results)
    return {"share": cached / prompt,
            "ttft_p50": statistics.median(ttft), "ttft_p90": percentile(ttft, 90), "wall": wall,
            "prompt_tokens": prompt / len(results)}


def wait_for_replicas(base: str, replicas: int, timeout: float = 120) -> None:
    """Until every replica has reported to the router (Serve answers once they are running)."""
    deadline = time.monotonic() + timeout
    while httpx.get(base + "/health", timeout=10).json().get("replicas") != replicas:
        if time.monotonic() > deadline:
            raise SystemExit(f"not {replicas} replicas after {timeout:.0f} s")
        time.sleep(1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=4)
    parser.add_argument("--questions", type=int, default=6)
    parser.add_argument("--lines", type=int, default=60, help="lines of each document (default 60)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--kv-cache-tokens", type=int, nargs="+", default=[65536, 2048],
                        help="each replica's KV cache, one table row group per size (default: 65536 2048)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", default="/tmp", help="where each configuration's server log goes")
    args = parser.parse_args()
    prompts = workload(args.documents, args.questions, args.lines, args.seed)
    rows = []
    for kv in args.kv_cache_tokens:
        for replicas, routing in CONFIGURATIONS:
            label = f"{replicas} replica{'s' if replicas > 1 else ''}, {routing}"
            print(f"# {label}, KV cache {kv} tokens: starting", file=sys.stderr, flush=True)
            log_path = Path(args.log_dir) / f"replicas-{replicas}-{routing}-{kv}.log"
            with live_server(None, log_path, "--replicas", str(replicas), "--routing", routing, "--replica-cpus",
                             "1", "--kv-cache-tokens", str(kv), timeout=600) as server:
                wait_for_replicas(server.base, replicas)
                result = asyncio.run(run_workload(server.base, prompts, args.concurrency, args.max_tokens))
            rows.append((kv, label, result))
            print(f"# {label}, KV {kv}: cached share {result['share']:.2f}, TTFT p50 {result['ttft_p50']:.2f} s",
                  file=sys.stderr, flush=True)
    print(f"\n{len(prompts)} requests ({args.documents} documents x {args.questions} questions, "
          f"~{rows[0][2]['prompt_tokens']:.0f} prompt tokens each), {args.concurrency} at a time, "
          f"max_tokens {args.max_tokens}\n")
    print("| KV cache per replica | configuration | prompt tokens from cache | TTFT p50 (s) | TTFT p90 (s) | wall (s) |")
    print("|---|---|---|---|---|---|")
    for kv, label, r in rows:
        print(f"| {kv} | {label} | {r['share']:.0%} | {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {r['wall']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
