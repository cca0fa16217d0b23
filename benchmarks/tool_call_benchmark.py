"""A required tool call's cost: the same requests free to call (``tool_choice: auto``) and held
to the functions' grammar (``required``), with and without a prediction, side by side.

Workload: the JSON documents of ``structured_benchmark.py``, in an agent's second round: the
history holds its ``write_file(path, content)`` call saving one (the file's text JSON-escaped in
the arguments, as a coding agent's edit tool sends it) and the tool's result; the user asks for
the file again with one value changed. The prediction is the earlier call's arguments.
Prompts, grammars and the reading of calls are the server's own (``proxy/server/tool_calls/``).
Modes, alternating on every document so the machine's drift falls on all:

  auto+pred      tools offered, decoding free, the prediction (prompt lookup as its fallback)
  required+pred  the call's grammar, the prediction
  auto           free, no drafts
  required       the grammar, no drafts

Figures: output tokens/s (prefill included), target passes per token, tokens, and how many
answers were a call whose arguments parse as JSON. Medians over documents; ratios to ``auto`` with
the same drafts.

    python benchmarks/tool_call_benchmark.py [--docs 3] [--rounds 1] [--max-tokens 500]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from structured_benchmark import document, embedded_engine_with_grammar  # noqa: E402  (benchmarks/ is the script's folder)

from foretell.proxy.engine import GenerationRequest  # noqa: E402
from foretell.proxy.engine.grammar import Grammar  # noqa: E402
from foretell.proxy.server.prompts import chat_prompt, implied_chat_stops  # noqa: E402
from foretell.proxy.server.schema import ChatCompletionRequest  # noqa: E402
from foretell.proxy.server.tool_calls.format import call_format, call_grammar, tool_plan  # noqa: E402
from foretell.proxy.server.tool_calls.parser import ToolCallParser, collect  # noqa: E402

MODES = ("auto+pred", "required+pred", "auto", "required")
WRITE_FILE = {"type": "function", "function": {
    "name": "write_file", "description": "Write a file's whole text",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40},
                                                    "content": {"type": "string"}},
                   "required": ["path", "content"], "additionalProperties": False}}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=500)
    args = parser.parse_args()
    engine, tokenizer, vocab, table, _, machine = embedded_engine_with_grammar()
    form = call_format("")  # the embedded model has no chat template: foretell's plain format
    stops, _ = implied_chat_stops(tokenizer)
    print(machine)
    figures = {mode: [] for mode in MODES}  # (tokens/s, passes per token, tokens, a call with JSON arguments)
    for _ in range(args.rounds):
        for index in range(args.docs):
            doc = document(index)
            before = json.dumps(doc, indent=2)
            replicas = doc["replicas"] + 4
            # An agent's second round: it wrote the file with a call, and is asked for one change.
            earlier = json.dumps({"path": "config.json", "content": before})
            ask = [{"role": "user", "content": "Save this service's config.json with write_file."},
                   {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
                       "name": "write_file", "arguments": earlier}}]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "written"},
                   {"role": "user", "content": f"Now save it again, in full, with replicas set to {replicas}."}]
            messages = ChatCompletionRequest.model_validate({"model": "m", "messages": ask}).messages
            prediction = earlier
            for mode in MODES:
                choice = mode.split("+")[0]
                plan = tool_plan({"tools": [WRITE_FILE], "tool_choice": choice, "parallel_tool_calls": False})
                ids = tokenizer(chat_prompt(tokenizer, messages, plan))["input_ids"]
                grammar = Grammar(table, call_grammar(plan, form), vocab) if plan.required else None
                drafts = prediction if mode.endswith("+pred") else None
                began = time.perf_counter()
                result = engine.generate(GenerationRequest(
                    prompt_ids=ids, max_tokens=args.max_tokens, prediction=drafts,
                    prompt_lookup=None if drafts else False, grammar=grammar, stop=stops))
                wall = time.perf_counter() - began
                reader = ToolCallParser(form, plan.names(), plan.parallel)
                _, calls = collect(reader.feed(result.text) + reader.finish())
                tokens = max(1, len(result.token_ids))
                figures[mode].append((tokens / wall, result.stats.target_passes / tokens, tokens,
                                      bool(calls) and _is_json(calls[0]["function"]["arguments"])))
    print(f"\n{args.docs} documents x {args.rounds} rounds, max_tokens {args.max_tokens}; medians")
    print(f"{'mode':<14} {'tok/s':>7} {'vs auto':>8} {'passes/tok':>11} {'tokens':>7} {'a call':>7}")
    for mode in MODES:
        rows = figures[mode]
        base = "auto+pred" if mode.endswith("+pred") else "auto"
        ratio = statistics.median(a[0] / b[0] for a, b in zip(rows, figures[base]))
        print(f"{mode:<14} {statistics.median(r[0] for r in rows):>7.1f} {ratio:>7.2f}x "
              f"{statistics.median(r[1] for r in rows):>11.3f} {statistics.median(r[2] for r in rows):>7.0f} "
              f"{sum(r[3] for r in rows):>4}/{len(rows)}")
    return 0


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


if __name__ == "__main__":
    raise SystemExit(main())
