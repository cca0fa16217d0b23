"""Load benchmark: N concurrent streaming requests over HTTP against ``foretell serve``.

Reports, per concurrency level and workload (plain, edit with prediction, a mix of both): TTFT
and TPOT (p50/p99), aggregate output tokens/s over the level's wall time, acceptance, and the
server's peak RSS. The workload is the edit workload of ``edit_benchmark.py`` (a copy prompt of
an edited file, the file before the edit as prediction); each request's prompt starts with a
unique line, so the prefix cache does not help and the table measures batching alone. A second
table measures the prefix cache: TTFT of a ~1000-token prompt sent once, then again with another
instruction after the same file.

With ``--baseline-ref REF`` the same levels also run, side by side in one run, against the engine
of an earlier commit (started from a git worktree of REF), e.g. the single-request engine.

    python benchmarks/load_benchmark.py [--concurrency 1 2 4 8 16] [--requests 16]
        [--max-tokens 120] [--baseline-ref deef6c3]

Without ``--base-url`` it starts ``foretell serve`` on the embedded model on a free port.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
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
        "usage": usage,
    }


MODES = ("plain", "edit", "mix")


async def run_level(base, model, items, concurrency, mode, max_tokens, tag):
    """All ``items`` at most ``concurrency`` at a time; ``mode`` picks which carry a prediction."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def bounded(index, prompt, prediction):
            use = mode == "edit" or (mode == "mix" and index % 2 == 1)
            async with limit:  # a unique first line: no prefix is shared between requests
                return await one_request(client, base, model, f"# request {tag}-{index}\n" + prompt,
                                         prediction if use else None, max_tokens)
        started = time.perf_counter()
        results = await asyncio.gather(*(bounded(i, p, pred) for i, (p, pred) in enumerate(items)))
        wall = time.perf_counter() - started
    drafted = sum(r["drafted"] for r in results)
    return {
        "ttft": [r["ttft"] for r in results], "tpot": [r["tpot"] for r in results],
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "acceptance": sum(r["accepted"] for r in results) / drafted if drafted else None,
    }


async def prefix_cache_ttft(base, model, instructions=("Here is", "Now write")):
    """TTFT of a ~1000-token file prompt sent uncached, then with the same file cached."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = "".join((stdlib / "textwrap.py").read_text().splitlines(keepends=True)[:110])
    marker = f"# {time.time_ns()}\n"  # a prefix this server has never seen
    times = []
    async with httpx.AsyncClient() as client:
        for instruction in instructions:
            prompt = marker + text + f"\n\n{instruction} textwrap.py again:\n\n"
            times.append((await one_request(client, base, model, prompt, None, 2))["ttft"])
    return times


def peak_rss_mib(process) -> float | None:
    """The server's peak resident memory (VmHWM), when we started it."""
    if process is None:
        return None
    for line in Path(f"/proc/{process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(max_queue: int, max_running: int | None = None, baseline_dir: str | None = None):
    """``foretell serve`` on a free port; from ``baseline_dir`` (an assembled package folder of an
    earlier commit) instead of the installed package when given."""
    port = free_port()
    args = ["serve", "--port", str(port), "--max-queue", str(max_queue)]
    if baseline_dir is None:
        command = [sys.executable, "-m", "foretell.cli", *args]
        if max_running is not None:
            command += ["--max-running", str(max_running)]
    else:  # bypass the editable install's finder so that the old package is imported
        launcher = ("import sys; sys.meta_path = [f for f in sys.meta_path if 'editable' not in "
                    f"type(f).__module__.lower()]; sys.path.insert(0, {baseline_dir!r}); "
                    "import foretell.cli; sys.exit(foretell.cli.main(sys.argv[1:]))")
        command = [sys.executable, "-c", launcher, *args]
    process = subprocess.Popen(command, env=dict(os.environ, HF_HUB_OFFLINE="1"))
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


def assemble_baseline(ref: str) -> str:
    """A git worktree of ``ref`` and a folder whose ``foretell`` package maps its layout
    (foretell/, proxy/, sdk/ as in pyproject's package-dir, and kernels/ where a commit before
    foretell/kernels/ has it at the top)."""
    root = Path(tempfile.mkdtemp(prefix="foretell-baseline-"))
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "add", "--detach", "-f", str(root / "tree"), ref],
                   check=True, capture_output=True)
    package = root / "site" / "foretell"
    package.mkdir(parents=True)
    for entry in (root / "tree" / "foretell").iterdir():  # its modules and subpackages (cli/)
        if entry.suffix == ".py" or (entry.is_dir() and entry.name != "__pycache__"):
            (package / entry.name).symlink_to(entry)
    for name in ("proxy", "sdk", "kernels"):
        if (root / "tree" / name).is_dir() and not (package / name).exists():
            (package / name).symlink_to(root / "tree" / name)
    return str(root / "site")


def remove_baseline(site: str) -> None:
    """Drop the worktree ``assemble_baseline`` made (and its registration in the repository)."""
    repo = Path(__file__).resolve().parents[1]
    subprocess.run(["git", "-C", str(repo), "worktree", "remove", "--force", str(Path(site).parent / "tree")],
                   capture_output=True)


def fmt(values, scale: float, digits: int) -> str:
    return "/".join(f"{scale * percentile(values, q):.{digits}f}" for q in (50, 99))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", help="a running foretell server (default: start one)")
    parser.add_argument("--model", default="gemma-3-270m")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--requests", type=int, default=16, help="requests per level (default 16)")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--max-lines", type=int, default=40, help="lines of each source file")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--baseline-ref", help="also run the engine of this git commit, side by side")
    args = parser.parse_args()

    servers = {}  # name -> (process or None, base url)
    baseline = None
    try:
        if args.base_url:
            servers["foretell"] = (None, args.base_url)
        else:
            servers["foretell"] = start_server(args.requests + 1, max(args.concurrency))
        if args.baseline_ref:
            baseline = assemble_baseline(args.baseline_ref)
            servers[f"baseline {args.baseline_ref}"] = start_server(args.requests + 1, baseline_dir=baseline)
        items = workload(args.requests, args.max_lines)
        print("| concurrency | workload | server | TTFT p50/p99 (s) | TPOT p50/p99 (ms) | "
              "output tok/s | acceptance |")
        print("|---|---|---|---|---|---|---|")
        for concurrency in args.concurrency:
            for mode in args.modes:
                for name, (_, base) in servers.items():  # side by side, one after the other
                    r = asyncio.run(run_level(base, args.model, items, concurrency, mode,
                                              args.max_tokens, f"{name}-{concurrency}-{mode}"))
                    acceptance = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
                    print(f"| {concurrency} | {mode} | {name} | {fmt(r['ttft'], 1, 2)} | "
                          f"{fmt(r['tpot'], 1000, 0)} | {r['tok_s']:.1f} | {acceptance} |", flush=True)
        print()
        print("| server | TTFT uncached (s) | TTFT with the file cached (s) | ratio | peak RSS (MiB) |")
        print("|---|---|---|---|---|")
        for name, (process, base) in servers.items():
            uncached, cached = asyncio.run(prefix_cache_ttft(base, args.model))
            rss = peak_rss_mib(process)
            print(f"| {name} | {uncached:.2f} | {cached:.2f} | {cached / uncached:.2f} | "
                  f"{'-' if rss is None else f'{rss:.0f}'} |", flush=True)
    finally:
        for process, _ in servers.values():
            if process is not None:
                process.terminate()
                process.wait(timeout=30)
        if baseline is not None:
            remove_baseline(baseline)
    return 0


if __name__ == "__main__":
    sys.exit(main())
