"""Drafts across requests: sessions of many requests, with and without the suffix draft cache,
side by side in one run.

Workloads (each a session of requests sent one after another, as their users send them):
  agent    32 requests: 16 tool calls in JSON after a fixed tool list (the answers share their
           structure, the prompts do not hold the earlier answers), interleaved with 16 steps
           editing one file one place at a time (the prompt shows the current file; the edit
           requests are also run with the current file as their prediction)
  rag      20 questions over the same five passages (module docstrings of the standard library)
  control  12 unrelated continuations of different files: nothing repeats (the cost of trying)

Modes, each over the whole session, the suffix cache cold at its start:
  plain           no drafts (the reference: every other mode's text must equal it)
  lookup          prompt lookup
  suffix          the suffix draft cache alone
  lookup+suffix   both (the engine picks a source per round)
  pred            the edit requests' prediction with prompt lookup (agent only)
  pred+suffix     the same with the suffix cache (agent only)

Figures per workload and mode: output tokens per second over the session (every prompt is
prefilled once before the modes run, so no mode pays a prefill another did not), target passes
per output token, acceptance of the drafts verified, and the requests whose text equals plain.
Then the cache's own cost: inserting a token and proposing a draft, against a decoding step.

    python benchmarks/draft_cache_benchmark.py [--workloads agent,rag,control] [--dtype float32]
        [--scale 1.0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine  # noqa: E402
from foretell.proxy.engine.draft_cache import DraftCache  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402

STDLIB = Path(sysconfig.get_paths()["stdlib"])
SCOPE = "session"

TOOLS = """You are a coding agent. Answer with exactly one tool call as JSON on one line.
Tools:
  read_file {"path": str}
  search {"query": str, "path": str}
  run_tests {"target": str}
  edit_file {"path": str, "line": int, "text": str}
Example:
Task: find where the parser is defined
Call: {"tool": "search", "arguments": {"query": "def parse", "path": "src/"}}

"""
TASKS = ["open the config loader", "look for the retry helper", "run the unit tests of the cache",
         "show the server's main module", "find every use of the logger", "run the tests in tests/api",
         "open the README", "search for TODO comments in src", "read the setup script",
         "run the integration tests", "find the definition of Scheduler", "open tests/test_cache.py",
         "search for the word deprecated", "read the changelog", "run the tests of the parser",
         "find where the port is chosen"]
EDITS = ["a comment above the first function", "the first docstring shortened", "a blank line removed",
         "a name spelled in full", "an import sorted", "a type hint added", "a constant renamed",
         "a log line added", "a default changed", "an assert added", "a comment fixed", "a line wrapped",
         "a return simplified", "a loop unrolled", "a guard added", "a check removed"]
PASSAGE_MODULES = ["json", "textwrap", "heapq", "bisect", "fnmatch"]
CONTROL_FILES = ["colorsys.py", "shlex.py", "graphlib.py", "glob.py", "keyword.py", "numbers.py",
                 "opcode.py", "queue.py", "sched.py", "stat.py", "token.py", "tabnanny.py"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int
    prediction: str | None = None


def module_doc(name: str) -> str:
    path = STDLIB / f"{name}.py"
    text = (path if path.exists() else STDLIB / name / "__init__.py").read_text()  # a module or a package
    start = text.index('"""') + 3
    return " ".join(text[start:text.index('"""', start)].split())[:420]


def lines_of(name: str, count: int) -> str:
    return "".join((STDLIB / name).read_text().splitlines(keepends=True)[:count])


def agent_session(scale: float) -> list[Request]:
    source = lines_of("bisect.py", 14)
    requests, current = [], source
    for i in range(16):
        requests.append(Request(f"{TOOLS}Task: {TASKS[i]}\nCall: {{\"tool\": \"", int(40 * scale)))
        prompt = f"Here is bisect.py:\n\n{current}\n\nHere is bisect.py again, with {EDITS[i]}:\n\n"
        requests.append(Request(prompt, int(150 * scale), prediction=current))
        current = current.replace("\n\n", f"\n# step {i + 1}\n", 1) if i % 2 == 0 else current
    return requests


def rag_session(scale: float) -> list[Request]:
    passages = "".join(f"[{i + 1}] {module_doc(m)}\n\n" for i, m in enumerate(PASSAGE_MODULES))
    rng = random.Random(0)
    asks = ["What does {m} provide?", "Quote what the passage on {m} says first.",
            "Summarise the {m} passage.", "Which passage describes {m}, and what does it say?"]
    requests = []
    for i in range(20):
        module = PASSAGE_MODULES[rng.randrange(len(PASSAGE_MODULES))]
        question = asks[i % len(asks)].format(m=module)
        requests.append(Request(f"Passages:\n\n{passages}Question: {question}\nAnswer, quoting the passages:",
                                int(60 * scale)))
    return requests


def control_session(scale: float) -> list[Request]:
    return [Request(f"# {name}\n{lines_of(name, 8)}", int(60 * scale)) for name in CONTROL_FILES]


WORKLOADS = {"agent": agent_session, "rag": rag_session, "control": control_session}
MODES = {  # mode -> (prompt lookup, suffix cache, use predictions)
    "plain": (False, False, False), "lookup": (True, False, False), "suffix": (False, True, False),
    "lookup+suffix": (True, True, False), "pred": (True, False, True), "pred+suffix": (True, True, True),
}


def run_session(engine, tokenizer, requests: list[Request], mode: str, cache_tokens: int):
    lookup, suffix, predictions = MODES[mode]
    engine.draft_cache = DraftCache(max_tokens=cache_tokens) if suffix else None
    outputs, tokens, seconds, passes, drafted, accepted = [], 0, 0.0, 0, 0, 0
    for request in requests:
        started = time.perf_counter()
        result = engine.generate(GenerationRequest(
            prompt_ids=tokenizer(request.prompt)["input_ids"], max_tokens=request.max_tokens,
            prediction=request.prediction if predictions else None, prompt_lookup=lookup,
            draft_cache_scope=SCOPE if suffix else None))
        seconds += time.perf_counter() - started
        outputs.append(result.token_ids)
        tokens += len(result.token_ids)
        passes += result.stats.target_passes
        drafted += result.stats.drafted_tokens
        accepted += result.stats.accepted_tokens
    return outputs, {"tok_s": tokens / seconds, "passes_per_token": passes / max(tokens, 1),
                     "acceptance": accepted / drafted if drafted else None, "tokens": tokens,
                     "seconds": seconds}


def measure_cache_cost(step_seconds: float, fill_tokens: int = 200_000) -> None:
    """Per-token insertion and per-draft proposal at a filled cache, against a decoding step."""
    rng = random.Random(1)
    cache = DraftCache(max_tokens=fill_tokens)
    vocab = 2000  # code-like repetition: a small working vocabulary
    chunk = [rng.randrange(vocab) for _ in range(fill_tokens // 100)]
    started = time.perf_counter()
    for i in range(100):
        source = cache.source(SCOPE, chunk[:16])
        for start in range(0, len(chunk), 8):  # in rounds of 8 tokens, as a request's output grows
            source.observe(chunk[: start + 8], "")
        source.close(completed=True)
        rng.shuffle(chunk)
    insert = (time.perf_counter() - started) / (100 * len(chunk))
    source = cache.source(SCOPE, chunk[:16])
    probes = 2000
    started = time.perf_counter()
    for i in range(probes):
        source.propose(32)
    propose = (time.perf_counter() - started) / probes
    source.close(completed=False)
    # arctic's trees are private to its cache: a benchmark's look inside, for the memory figure.
    memory = sum(scope._global_tree.estimate_memory() for scope in cache._scopes.values())
    print(f"\ncache memory: {memory / 2**20:.0f} MiB for {cache.snapshot()['cached_tokens']} cached tokens "
          f"({memory / cache.snapshot()['cached_tokens']:.0f} bytes a token; random tokens over a "
          f"{vocab}-token vocabulary, which share less than real text)")
    print(f"cache cost at {cache.snapshot()['cached_tokens']} cached tokens: insert "
          f"{insert * 1e6:.2f} us/token, propose {propose * 1e6:.1f} us/draft; a plain decoding step here "
          f"{step_seconds * 1e3:.1f} ms, so one draft and a token a step cost "
          f"{100 * (insert + propose) / step_seconds:.3f}% of it")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="agent,rag,control")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtype", default=os.environ.get("FORETELL_DTYPE", "float32"),
                        help="the model's precision (default float32: plain greedy is the oracle)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies every request's max_tokens")
    parser.add_argument("--cache-tokens", type=int, default=1_000_000)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]
    modes = [m for m in args.modes.split(",") if m]
    for name in workloads:
        if name not in WORKLOADS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    for name in modes:
        if name not in MODES:
            parser.error(f"unknown mode {name!r}; choose from {', '.join(MODES)}")
    if "plain" not in modes:
        modes.insert(0, "plain")

    loaded = load_model(args.model, dtype=args.dtype)
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer)
    engine.calibrate()
    tokenizer = loaded.tokenizer
    table, step_seconds = [], None
    for workload in workloads:
        requests = WORKLOADS[workload](args.scale)
        for request in requests:  # every prompt prefilled (and cached) once before any mode runs
            engine.generate(GenerationRequest(prompt_ids=tokenizer(request.prompt)["input_ids"], max_tokens=1))
        has_predictions = any(r.prediction for r in requests)
        reference = None
        for mode in modes:
            if MODES[mode][2] and not has_predictions:
                continue
            outputs, figures = run_session(engine, tokenizer, requests, mode, args.cache_tokens)
            if mode == "plain":
                reference = outputs
                step_seconds = figures["seconds"] / figures["tokens"] if step_seconds is None else step_seconds
            figures["exact"] = sum(a == b for a, b in zip(outputs, reference))
            plain = table_row(table, workload, "plain")["tok_s"] if mode != "plain" else figures["tok_s"]
            figures["speedup"] = figures["tok_s"] / plain
            table.append({"workload": workload, "mode": mode, "requests": len(requests), **figures})
            log(f"{workload:8s} {mode:14s} {figures['tokens']:5d} tok {figures['tok_s']:6.1f} tok/s "
                f"passes/tok {figures['passes_per_token']:.3f} acceptance {figures['acceptance'] or 0:.2f} "
                f"exact {figures['exact']}/{len(requests)}")
    print(f"\nprecision: {engine.precision}; every session starts with a cold suffix cache\n")
    print("| workload | mode | tok/s | speed-up vs plain | passes/token | acceptance | exact vs plain |")
    print("|---|---|---|---|---|---|---|")
    for row in table:
        acceptance = "-" if row["acceptance"] is None else f"{row['acceptance']:.2f}"
        print(f"| {row['workload']} ({row['requests']} requests) | {row['mode']} | {row['tok_s']:.1f} | "
              f"{row['speedup']:.2f}x | {row['passes_per_token']:.3f} | {acceptance} | "
              f"{row['exact']}/{row['requests']} |")
    if step_seconds:
        measure_cache_cost(step_seconds)
    return 0 if all(row["exact"] == row["requests"] for row in table) else 1


def table_row(table, workload, mode):
    return next(r for r in table if r["workload"] == workload and r["mode"] == mode)


if __name__ == "__main__":
    sys.exit(main())
