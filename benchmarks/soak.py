"""Soak check: mixed traffic against ``foretell serve`` on the embedded model for a long while, with
the server's resident memory sampled every minute.

The traffic, from a few concurrent clients, all on 127.0.0.1: streamed and plain completions
and chats (unicode, stop strings, predictions, prompt lookup, sampled ``n > 1``), clients that
disconnect after the first event, the bad inputs of the probe table (``harness/probes.py``,
but for the two rows that depend on its tiny model and on having no upstream), and
forwarded requests to a stub upstream (``harness/upstream_stub.py``) that answers, fails with
a 500, or dies mid-stream. Every tenth plain stream is checked against the same request not
streamed (greedy: the texts must be equal).

It prints a row per minute (RSS, requests so far, unexpected answers, the draft cache's tokens from
/metrics) and a summary: RSS after the first minute against the last and the peak, and the draft
cache's largest size against its bound (``--draft-cache-tokens``, small by default so that it
fills and evicts within the run). An unexpected answer is a status other than the one
the kind expects, a stream that does not end in ``[DONE]`` (or ends in an error event where none
was due), or a stream whose text differs from the same request's non-streamed text.

    python benchmarks/soak.py [--minutes 30] [--clients 3] [--draft-cache-tokens 4000]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import json
import random
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from edit_benchmark import STDLIB_FILES, copy_prompt, edit  # noqa: E402

from foretell.proxy.engine.model_loader import resolve_model_folder  # noqa: E402
from harness.live_server import live_server  # noqa: E402
from harness.probes import API_KEY, LIMIT, MODEL, PROBES  # noqa: E402
from harness.upstream_stub import StubServer  # noqa: E402

HEADERS = {"authorization": f"Bearer {API_KEY}", "content-type": "application/json"}
# Probe rows whose answer depends on the probe's own server: the tiny model's short context (4,096
# positions; the embedded model takes 32,768, so 5,000 tokens fit), and no upstream (here every
# model not served locally, the empty name included, goes to the stub upstream).
TINY_SERVER_ONLY = {"prompt over the context", "token ids over the context", "unknown model", "empty model"}
UNICODE = ["Grüß dich, naïve café ✓", "日本語のテキスト、続けて", "emoji 🧪🚀 and a ZWJ 👩‍💻", "Ελληνικά και русский"]


def edit_items(max_lines: int = 30) -> list[tuple[str, str]]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    items = []
    for name in STDLIB_FILES:
        before = "".join((stdlib / name).read_text().splitlines(keepends=True)[:max_lines])
        items.append((copy_prompt(name, edit(before)), before))
    return items


def stream_text(events: list[str]) -> tuple[str, bool]:
    """(concatenated text of choice 0, whether an error event came)."""
    text, error = [], False
    for event in events:
        chunk = json.loads(event)
        if "error" in chunk:
            error = True
            continue
        for choice in chunk.get("choices", []):
            if choice.get("index", 0) != 0:
                continue
            if "delta" in choice:  # chat
                text.append(choice["delta"].get("content") or "")
            else:
                text.append(choice.get("text") or "")
    return "".join(text), error


async def read_stream(client: httpx.AsyncClient, path: str, body: dict, disconnect: bool = False):
    """(status, data events); with ``disconnect`` the client hangs up after the first event."""
    events = []
    async with client.stream("POST", path, json=body, headers=HEADERS) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, events
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if disconnect:
                    break
    return 200, events


class Soak:
    def __init__(self, base: str, seed: int):
        self.base = base
        self.random = random.Random(seed)
        self.items = edit_items()
        self.counter = itertools.count()
        self.sent = collections.Counter()
        self.unexpected: list[str] = []

    def problem(self, kind: str, detail: str) -> None:
        self.unexpected.append(f"{kind}: {detail[:300]}")

    async def one(self, client: httpx.AsyncClient) -> None:
        kind = self.random.choice(["stream", "stream", "prediction", "lookup", "chat", "n2", "disconnect",
                                   "bad", "bad", "upstream", "upstream-500", "upstream-dies"])
        self.sent[kind] += 1
        number = next(self.counter)
        prompt, before = self.items[number % len(self.items)]
        unique = f"# request {number}\n"  # a new prompt each time: the prefix cache fills and evicts
        if kind == "stream":
            body = {"model": MODEL, "prompt": unique + self.random.choice(UNICODE), "max_tokens": 24,
                    "temperature": 0, "stream": True, "stop": ["\n\n"]}
            status, events = await read_stream(client, "/v1/completions", body)
            text, error = stream_text(events[:-1])
            if status != 200 or events[-1:] != ["[DONE]"] or error:
                return self.problem(kind, f"status {status}, events {events[-2:]}")
            if number % 10 == 0:
                final = await client.post("/v1/completions", json={**body, "stream": False}, headers=HEADERS)
                if final.status_code != 200 or final.json()["choices"][0]["text"] != text:
                    self.problem(kind, f"stream {text!r} != final {final.text[:200]!r}")
        elif kind == "prediction":
            body = {"model": MODEL, "prompt": unique + prompt, "max_tokens": 48, "temperature": 0, "stream": True,
                    "prediction": {"type": "content", "content": before}}
            status, events = await read_stream(client, "/v1/completions", body)
            if status != 200 or events[-1:] != ["[DONE]"] or stream_text(events[:-1])[1]:
                self.problem(kind, f"status {status}, events {events[-2:]}")
        elif kind == "lookup":  # prompt lookup alone: drafts copied from the prompt
            body = {"model": MODEL, "prompt": unique + prompt, "max_tokens": 48, "temperature": 0, "stream": True,
                    "speculation": {"prompt_lookup": True}}
            status, events = await read_stream(client, "/v1/completions", body)
            if status != 200 or events[-1:] != ["[DONE]"] or stream_text(events[:-1])[1]:
                self.problem(kind, f"status {status}, events {events[-2:]}")
        elif kind in ("chat", "n2"):
            body = {"model": MODEL, "messages": [{"role": "user", "content": unique + self.random.choice(UNICODE)}],
                    "max_tokens": 16, "stop": ["。", "."]}
            if kind == "n2":
                body.update(n=2, temperature=0.8, seed=number)
            answer = await client.post("/v1/chat/completions", json=body, headers=HEADERS)
            if answer.status_code != 200 or len(answer.json()["choices"]) != body.get("n", 1):
                self.problem(kind, f"status {answer.status_code}: {answer.text}")
        elif kind == "disconnect":
            body = {"model": MODEL, "prompt": unique + prompt, "max_tokens": 64, "stream": True,
                    "prediction": {"type": "content", "content": before}}
            status, _ = await read_stream(client, "/v1/completions", body, disconnect=True)
            if status != 200:
                self.problem(kind, f"status {status}")
        elif kind == "bad":
            name, path, body, expected, headers = self.random.choice(
                [probe for probe in PROBES if probe[0] not in TINY_SERVER_ONLY])
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            sent = {**HEADERS, **headers}
            answer = await client.post(path, content=content, headers={k: v for k, v in sent.items() if v is not None})
            if answer.status_code != expected:
                self.problem(kind, f"{name}: status {answer.status_code}, expected {expected}")
        else:  # forwarded to the stub upstream
            model = {"upstream": "gpt-stub", "upstream-500": "gpt-stub-500", "upstream-dies": "die-stream"}[kind]
            body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
            status, events = await read_stream(client, "/v1/chat/completions", body)
            error = stream_text(events[:-1])[1] if events else False
            if kind == "upstream" and (status != 200 or events[-1:] != ["[DONE]"] or error):
                self.problem(kind, f"status {status}, events {events[-2:]}")
            if kind == "upstream-500" and status < 500:
                self.problem(kind, f"status {status}")
            if kind == "upstream-dies" and not (status == 200 and error and events[-1:] == ["[DONE]"]):
                self.problem(kind, f"status {status}, events {events[-2:]}")

    async def client_loop(self, deadline: float) -> None:
        async with httpx.AsyncClient(base_url=self.base, timeout=300) as client:
            while time.monotonic() < deadline:
                try:
                    await self.one(client)
                except httpx.HTTPError as error:
                    self.problem("transport", repr(error))


def draft_cache_tokens(base: str) -> float:
    """The draft cache's size in tokens, from /metrics."""
    metrics = httpx.get(base + "/metrics", headers=HEADERS, timeout=30).text
    line = next(line for line in metrics.splitlines() if line.startswith("foretell_draft_cache_tokens "))
    return float(line.split()[1])


async def soak(server, minutes: float, clients: int, seed: int, cache_bound: int) -> int:
    runner = Soak(server.base, seed)
    started = time.monotonic()
    deadline = started + 60 * minutes
    tasks = [asyncio.create_task(runner.client_loop(deadline)) for _ in range(clients)]
    samples, cache_sizes = [], []
    print("| minute | RSS (MiB) | requests so far | unexpected so far | draft cache tokens |")
    print("|---|---|---|---|---|")
    minute = 0
    while not all(task.done() for task in tasks):
        await asyncio.sleep(1)
        ended = all(task.done() for task in tasks)
        if time.monotonic() - started >= 60 * (minute + 1) or ended:
            minute += 1
            samples.append(server.status("VmRSS") / 1024)  # kB -> MiB
            cache_sizes.append(await asyncio.to_thread(draft_cache_tokens, server.base))
            label = "end" if ended else minute  # the clients' last requests outlast the deadline
            print(f"| {label} | {samples[-1]:.0f} | {sum(runner.sent.values())} | {len(runner.unexpected)} | "
                  f"{cache_sizes[-1]:.0f} |", flush=True)
    await asyncio.gather(*tasks)
    print()
    print("requests by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(runner.sent.items())))
    print(f"RSS after minute 1: {samples[0]:.0f} MiB; last: {samples[-1]:.0f} MiB; "
          f"peak sample: {max(samples):.0f} MiB; growth after minute 1: {samples[-1] - samples[0]:+.0f} MiB")
    print(f"draft cache: at most {max(cache_sizes):.0f} tokens sampled, bound {cache_bound}")
    if max(cache_sizes) > cache_bound:
        runner.problem("draft cache", f"{max(cache_sizes):.0f} tokens, over its bound of {cache_bound}")
    print(f"unexpected answers: {len(runner.unexpected)}")
    for line in runner.unexpected[:20]:
        print("  " + line)
    return 1 if runner.unexpected else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--clients", type=int, default=3, help="concurrent clients (default 3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--draft-cache-tokens", type=int, default=4000,
                        help="the server's draft cache bound, small so that it fills (default 4000)")
    args = parser.parse_args()
    _, folder = resolve_model_folder(None)
    with StubServer(log_level="critical") as stub, tempfile.TemporaryDirectory() as work:
        log = Path(work) / "server.log"
        with live_server(folder, log, "--served-model-name", MODEL, "--api-key", API_KEY,
                         "--max-body-bytes", str(LIMIT), "--max-prediction-chars", "5000",
                         "--draft-cache-tokens", str(args.draft_cache_tokens),
                         env={"FORETELL_UPSTREAM_BASE_URL": stub.base_url}) as server:
            print(f"foretell serve on {server.base} (pid {server.process.pid}), stub upstream on {stub.base_url}; "
                  f"{args.minutes:g} minutes, {args.clients} clients", flush=True)
            code = asyncio.run(soak(server, args.minutes, args.clients, args.seed, args.draft_cache_tokens))
            tracebacks = server.log().count("Traceback")
            print(f"tracebacks in the server log: {tracebacks}")
    return code or (1 if tracebacks else 0)


if __name__ == "__main__":
    sys.exit(main())
