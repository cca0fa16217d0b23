"""Structured output's cost: the same requests free and under a JSON grammar, side by side.

Workload: JSON documents (service configurations of ~40-60 lines, pretty-printed, built
deterministically); each prompt shows one and asks for it again with one value changed, the
document before the change as the prediction (an agent re-emitting a JSON file). Modes, each on
every document, alternating so the machine's drift falls on all:

  free+pred      no grammar, the prediction (prompt lookup as its fallback, the default)
  json+pred      response_format json_object: any JSON object, the prediction
  schema+pred    response_format json_schema: the document's own schema (types, required keys)
  free           no grammar, no drafts
  schema         the schema, no drafts

Figures: output tokens/s (prefill included), target passes per token, output tokens and how
many outputs ended by themselves (a free answer may run on past the document to max_tokens,
which a grammar's closing brace ends), and the grammar's own
cost: masks computed per step and their time, and how long each step waited for them after its
pass (the masks are computed on a worker thread while the pass runs: only the wait is on the
critical path). Medians over documents; ratios to the free mode with the same drafts.

    python benchmarks/structured_benchmark.py [--docs 4] [--rounds 2] [--max-tokens 400]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine  # noqa: E402
from foretell.proxy.engine import grammar as grammar_module  # noqa: E402
from foretell.proxy.engine.grammar import Grammar, grammar_tokenizer, json_grammar  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402

MODES = ("free+pred", "json+pred", "schema+pred", "free", "schema")


def document(index: int) -> dict:
    """A service configuration, different for each index."""
    names = ["billing", "search", "gateway", "images", "mailer", "reports", "auth", "queue"]
    name = names[index % len(names)]
    return {
        "service": f"{name}-api",
        "version": f"2.{index}.{3 * index % 7}",
        "replicas": 2 + index % 3,
        "image": {"repository": f"registry.example.com/{name}", "tag": f"v2.{index}", "pull_policy": "IfNotPresent"},
        "ports": [{"name": "http", "port": 8080 + index, "protocol": "TCP"},
                  {"name": "metrics", "port": 9090 + index, "protocol": "TCP"}],
        "env": {"LOG_LEVEL": "info", "REGION": ["eu-west-1", "us-east-2"][index % 2],
                "CACHE_TTL_SECONDS": 300 + 60 * index, "FEATURE_FLAGS": "search,export"},
        "resources": {"cpu": f"{250 + 50 * index}m", "memory": f"{256 + 128 * (index % 3)}Mi"},
        "healthcheck": {"path": "/healthz", "interval_seconds": 10, "timeout_seconds": 2},
        "owners": [f"team-{name}@example.com", "platform@example.com"],
        "enabled": index % 2 == 0,
    }


def schema_of(value):
    """The JSON schema of ``value``'s shape: its types, every key required, no others."""
    if isinstance(value, dict):
        return {"type": "object", "properties": {k: schema_of(v) for k, v in value.items()},
                "required": list(value), "additionalProperties": False}
    if isinstance(value, list):
        return {"type": "array", "items": schema_of(value[0])}
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    return {"type": "string"}


class MaskTimer:
    """The grammar's cost: time computing masks (on the worker thread) and time the step waited
    for them after the pass (the critical path)."""

    def __init__(self):
        self.compute, self.wait, self.rows, self.steps = 0.0, 0.0, 0, 0
        masks, wait = Grammar.masks, grammar_module.MaskJob.wait
        timer = self

        def timed_masks(grammar, draft):
            started = time.perf_counter()
            try:
                return masks(grammar, draft)
            finally:
                timer.compute += time.perf_counter() - started
                timer.rows += len(draft) + 1

        def timed_wait(job):
            started = time.perf_counter()
            try:
                return wait(job)
            finally:
                if job.futures:
                    timer.wait += time.perf_counter() - started
                    timer.steps += 1

        Grammar.masks, grammar_module.MaskJob.wait = timed_masks, timed_wait

    def reset(self) -> None:
        self.compute, self.wait, self.rows, self.steps = 0.0, 0.0, 0, 0


def embedded_engine_with_grammar():
    """The embedded model's calibrated engine at the server's default precision for this machine
    (--dtype/--quantize auto), its tokenizer and vocabulary size, and llguidance's table of it;
    the table's build time, and a line naming the CPU and the precision."""
    from foretell.proxy.engine.kernel_timing import describe_cpu

    loaded = load_model(None, dtype="auto", quantize="auto")
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer)
    engine.calibrate()
    tokenizer, vocab = loaded.tokenizer, loaded.model.config.vocab_size
    started = time.perf_counter()
    table = grammar_tokenizer(tokenizer, vocab, engine.eos_token_ids)
    built = time.perf_counter() - started
    return engine, tokenizer, vocab, table, built, f"CPU: {describe_cpu()}; engine: {engine.precision}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=400)
    args = parser.parse_args()
    engine, tokenizer, vocab, table, built, machine = embedded_engine_with_grammar()
    print(f"{machine}; grammar table built in {built:.1f} s")
    timer = MaskTimer()
    # (tokens/s, passes per token, mask ms/step, wait ms/step, tokens, ended by itself)
    figures = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for index in range(args.docs):
            doc = document(index)
            before = json.dumps(doc, indent=2)
            changed = dict(doc, replicas=doc["replicas"] + 4)
            prompt = (f"config.json:\n{before}\n\nThe same config.json with replicas set to "
                      f"{changed['replicas']}, in full:\n")
            ids = tokenizer(prompt)["input_ids"]
            grammars = {"json": json_grammar(None), "schema": json_grammar(schema_of(doc))}
            for mode in MODES:
                kind = mode.split("+")[0]
                grammar = Grammar(table, grammars[kind], vocab) if kind in grammars else None
                prediction = before if mode.endswith("+pred") else None
                timer.reset()
                began = time.perf_counter()
                result = engine.generate(GenerationRequest(
                    prompt_ids=ids, max_tokens=args.max_tokens, prediction=prediction,
                    prompt_lookup=None if prediction else False, grammar=grammar))
                wall = time.perf_counter() - began
                tokens = max(1, len(result.token_ids))
                steps = max(1, timer.steps)
                figures[mode].append((tokens / wall, result.stats.target_passes / tokens,
                                      1000 * timer.compute / steps, 1000 * timer.wait / steps, tokens,
                                      result.finish_reason == "stop"))
                if round_ == 0 and index == 0 and kind != "free":
                    try:
                        json.loads(result.text)
                        valid = "valid JSON"
                    except ValueError:
                        valid = "not JSON (cut at max_tokens?)"
                    print(f"  {mode}: {tokens} tokens, {result.finish_reason}, {valid}")
    print(f"\n{args.docs} documents x {args.rounds} rounds, max_tokens {args.max_tokens}; medians")
    print(f"{'mode':<13} {'tok/s':>7} {'vs free':>8} {'passes/tok':>11} {'mask ms/step':>13} {'wait ms/step':>13} "
          f"{'tokens':>7} {'stopped':>8}")
    for mode in MODES:
        rows = figures[mode]
        speed = statistics.median(r[0] for r in rows)
        base = "free+pred" if mode.endswith("+pred") else "free"
        ratio = statistics.median(a[0] / b[0] for a, b in zip(rows, figures[base]))
        print(f"{mode:<13} {speed:>7.1f} {ratio:>7.2f}x {statistics.median(r[1] for r in rows):>11.3f} "
              f"{statistics.median(r[2] for r in rows):>13.2f} {statistics.median(r[3] for r in rows):>13.2f} "
              f"{statistics.median(r[4] for r in rows):>7.0f} {sum(r[5] for r in rows):>4}/{len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
