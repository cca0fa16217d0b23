"""Draft-model benchmark: free text plain vs self-drafted vs prompt lookup, and edits with the draft
model on and off, side by side in one run on the embedded model.

Free-text workload: eight prompts that bring no prediction and little to look up (questions,
story openings, an explanation), ``--tokens`` output tokens each. Modes, each on a fresh engine
(its own prefix cache and pass-cost fit), greedy and at each ``--temperatures`` (seeded):

  plain        no draft source at all
  lookup       prompt lookup
  self-draft   the draft model (``--draft-model``, default self:int8), chosen by the chooser
  forced       the draft model with its passes costed at nothing: what drafting every round
               from it would do (the chooser's decision shown by contrast)

at concurrency 1 (one request at a time) and 8 (all eight in flight, one batched pass a step),
one engine per mode for the whole table.
Figures: output tokens per second of wall time, prefill included (the draft's own prefill is a
cost of drafting): the median over prompts at concurrency 1, the batch's total at 8; the ratio to
plain, the draft model's rounds / drafted /
accepted, acceptance per draft position, and whether each greedy text equals plain's.

Edit workload (``--edits N``): the edit benchmark's files (``edit_benchmark.py``), the file
before the edit as prediction, prompt lookup on, on an engine without and with the draft model
(the three engines in turn on every file, medians over files).

    python benchmarks/draft_model_benchmark.py [--dtype auto] [--quantize auto]
        [--draft-model self:int8] [--tokens 96] [--temperatures 0.7]
        [--edits 3] [--modes plain,lookup,self-draft,forced] [--concurrency 1,8] [--no-free-text]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine  # noqa: E402
from foretell.proxy.engine.draft_length import PassCostModel  # noqa: E402
from foretell.proxy.engine.draft_model import DRAFT_SOURCE, load_draft_model  # noqa: E402
from foretell.proxy.engine.kernel_timing import cpu_features, describe_cpu  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402

sys.path.insert(1, str(Path(__file__).resolve().parent))
from edit_benchmark import STDLIB_FILES, copy_prompt, cut_to_tokens, edit  # noqa: E402

FREE_TEXT = [
    "Question: Why is the sky blue? Answer:",
    "Once upon a time, in a small village by the sea,",
    "The three most important things to know about climate change are",
    "Write a short letter to a friend about your summer holiday.\n\nDear Sam,\n",
    "Explain how a bicycle stays upright while moving.",
    "The history of the printing press begins",
    "Here is a recipe for a simple tomato soup:",
    "In economics, inflation means",
]
MODES = ("plain", "lookup", "self-draft", "forced")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def make_engine(loaded, draft, with_draft: bool, forced: bool = False) -> SpeculativeEngine:
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer, draft_model=draft.model if with_draft else None,
                               draft_model_name="draft")
    engine.calibrate()
    if engine.draft_model is not None:
        engine.draft_model.calibrate()
        if forced:  # its passes weigh nothing: it drafts whenever it is offered
            engine.draft_model.cost.reset(PassCostModel(1e-9, 1e-9))
            engine.draft_model.cost.observe = lambda *args: None
    return engine


def request_for(mode: str, prompt_ids: list[int], tokens: int, temperature: float, seed: int) -> GenerationRequest:
    return GenerationRequest(prompt_ids=prompt_ids, max_tokens=tokens, prompt_lookup=mode == "lookup",
                             draft_model=mode in ("self-draft", "forced"), temperature=temperature,
                             seed=seed if temperature > 0 else None)


def run_batch(engine, requests):
    """All requests in flight at once; (results in order, decode seconds of the batch)."""
    sequences = [engine.add(r) for r in requests]
    results, started = {}, time.perf_counter()
    while len(results) < len(sequences):
        for update in engine.step([s for s in sequences if not s.finished]):
            if update.error is not None:
                raise update.error
            if update.result is not None:
                results[id(update.sequence)] = update.result
    return [results[id(s)] for s in sequences], time.perf_counter() - started


def draft_figures(results) -> tuple[str, list[float]]:
    rounds = sum(r.stats.per_source.get(DRAFT_SOURCE).rounds for r in results if DRAFT_SOURCE in r.stats.per_source)
    drafted = sum(r.stats.per_source.get(DRAFT_SOURCE).drafted for r in results if DRAFT_SOURCE in r.stats.per_source)
    accepted = sum(r.stats.per_source.get(DRAFT_SOURCE).accepted for r in results if DRAFT_SOURCE in r.stats.per_source)
    by_position_d, by_position_a = [], []
    for r in results:
        for i, (d, a) in enumerate(zip(r.stats.drafted_by_position, r.stats.accepted_by_position)):
            while len(by_position_d) <= i:
                by_position_d.append(0)
                by_position_a.append(0)
            by_position_d[i] += d
            by_position_a[i] += a
    per_position = [a / d for d, a in zip(by_position_d, by_position_a) if d][:6]
    return f"{rounds} / {drafted} / {accepted}", per_position


def free_text(loaded, draft, args, temperatures) -> None:
    tokenizer = loaded.tokenizer
    prompts = [tokenizer(p)["input_ids"] for p in FREE_TEXT]
    print("\n## Free text (no prediction)\n")
    print("| T | concurrency | mode | tok/s (wall) | vs plain | draft rounds / drafted / accepted "
          "| acceptance by position | text = plain |")
    print("|---|---|---|---|---|---|---|---|")
    # One engine per mode for the whole table (prompt prefixes cached alike in every mode).
    engines = {mode: make_engine(loaded, draft, mode in ("self-draft", "forced"), forced=mode == "forced")
               for mode in args.modes}
    for temperature in temperatures:
        for concurrency in args.concurrency:
            plain_rate, plain_texts = None, None
            for mode in args.modes:
                engine = engines[mode]
                requests = [request_for(mode, ids, args.tokens, temperature, seed) for seed, ids in enumerate(prompts)]
                if concurrency == 1:
                    results = [engine.generate(r) for r in requests]
                    rate = statistics.median(r.stats.completion_tokens / r.stats.seconds for r in results)
                else:
                    results, seconds = run_batch(engine, requests[:concurrency])
                    rate = sum(r.stats.completion_tokens for r in results) / seconds
                texts = [r.token_ids for r in results]
                if mode == "plain":
                    plain_rate, plain_texts = rate, texts
                equal = sum(a == b for a, b in zip(texts, plain_texts))  # plain runs first
                counts, per_position = draft_figures(results) if mode in ("self-draft", "forced") else ("-", [])
                lookup = sum(r.stats.per_source.get("prompt_lookup").accepted for r in results
                             if "prompt_lookup" in r.stats.per_source)
                if mode == "lookup":
                    counts = f"(lookup accepted {lookup})"
                print(f"| {temperature:g} | {concurrency} | {mode} | {rate:.1f} | {rate / plain_rate:.2f}x | {counts} | "
                      f"{' '.join(f'{p:.2f}' for p in per_position) or '-'} | "
                      f"{f'{equal}/{len(texts)}' if temperature == 0 else 'sampled'} |", flush=True)
                log(f"T={temperature} c={concurrency} {mode}: {rate:.1f} tok/s")


def edits(loaded, draft, args) -> None:
    tokenizer = loaded.tokenizer
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in STDLIB_FILES:
        text = cut_to_tokens((stdlib / name).read_text(), tokenizer, 300, 700)
        if text:
            after = edit(text)
            files.append((text, copy_prompt(name, after), len(tokenizer.encode(after, add_special_tokens=False))))
        if len(files) == args.edits:
            break
    print("\n## Edits (prediction + prompt lookup), draft model off and on\n")
    print("| draft model | median tok/s (wall, prefill included) | ratio | draft rounds | texts equal |")
    print("|---|---|---|---|---|")
    labels = {None: "off", False: "on, requests as sent (a prediction: not offered)",
              True: "on, offered beside the prediction (speculation.draft_model: true)"}
    modes = list(labels)
    engines = {mode: make_engine(loaded, draft, mode is not None) for mode in modes}
    runs = {mode: [] for mode in modes}
    # Each file in every mode in turn, the order rotating file by file, so that the machine's
    # drift over the run falls on every mode alike; one warm-up edit per engine first.
    for index, (before, prompt, length) in enumerate([files[0]] + files):
        for mode in modes[index % len(modes):] + modes[:index % len(modes)]:
            request = GenerationRequest(prompt_ids=tokenizer(prompt)["input_ids"], max_tokens=length,
                                        prediction=before, prompt_lookup=True,
                                        draft_model=True if mode else None)  # None: the server's default
            started = time.perf_counter()
            result = engines[mode].generate(request)
            if index:  # not the warm-up
                runs[mode].append((result, result.stats.completion_tokens / (time.perf_counter() - started)))
    plain_rate = statistics.median(rate for _, rate in runs[None])
    for mode in modes:
        rate = statistics.median(rate for _, rate in runs[mode])
        rounds = sum(r.stats.per_source[DRAFT_SOURCE].rounds for r, _ in runs[mode] if DRAFT_SOURCE in r.stats.per_source)
        equal = sum(a.token_ids == b.token_ids for (a, _), (b, _) in zip(runs[mode], runs[None]))
        print(f"| {labels[mode]} | {rate:.1f} | {rate / plain_rate:.2f}x | "
              f"{rounds if mode is not None else '-'} | {equal}/{len(files)} |", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--draft-model", default="self:int8")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--temperatures", default="0.7", help="sampled temperatures besides greedy")
    parser.add_argument("--edits", type=int, default=3, help="edit files (0: skip the edit table)")
    parser.add_argument("--modes", default=",".join(MODES), help="free-text modes, plain first")
    parser.add_argument("--concurrency", default="1,8", help="requests in flight (at most 8)")
    parser.add_argument("--no-free-text", action="store_true", help="only the edit table")
    args = parser.parse_args()
    temperatures = [0.0] + [float(t) for t in args.temperatures.split(",") if t.strip()]
    args.modes = [m for m in args.modes.split(",") if m]
    args.concurrency = [int(c) for c in args.concurrency.split(",") if c]
    if args.modes[0] != "plain" or any(m not in MODES for m in args.modes):
        parser.error(f"--modes: some of {', '.join(MODES)}, plain first")
    loaded = load_model(None, dtype=args.dtype, quantize=args.quantize)
    draft = load_draft_model(args.draft_model, loaded)
    probe = SpeculativeEngine(loaded.model, loaded.tokenizer, draft_model=draft.model)
    target, drafting = probe.calibrate(), probe.draft_model.calibrate()
    del probe
    print(f"CPU: {describe_cpu()}; features: {', '.join(cpu_features())}; torch threads: {torch.get_num_threads()}")
    print(f"target: {args.dtype}/{args.quantize} -> {getattr(loaded.model, 'foretell_quantization', 'none')}, "
          f"pass {1000 * target.fixed:.0f} ms + {1000 * target.per_position:.1f} ms/position; "
          f"draft {args.draft_model}: pass {1000 * drafting.fixed:.0f} ms + {1000 * drafting.per_position:.1f} ms/row")
    if not args.no_free_text:
        free_text(loaded, draft, args, temperatures)
    if args.edits:
        edits(loaded, draft, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
