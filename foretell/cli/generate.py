"""``foretell generate``: a prompt completed on the local model, the prediction and/or prompt
lookup verified, the text to stdout as it is verified and the statistics to stderr."""

from __future__ import annotations

import argparse
import os
import sys

from foretell.cli.arguments import (add_precision_options, needs_proxy_extra,
                                    positive_int, read_text, temperature_value, top_p_value)
from foretell.origin_colors import CHOICES, legend, paint_spans, use_color
from foretell.proxy.model_spec import model_kind


def add_parser(commands) -> None:
    generate = commands.add_parser(
        "generate",
        help="complete a prompt on the local model, verifying a prediction and/or prompt lookup",
        description=(
            "Complete a prompt on the local model, greedily (default) or sampling with "
            "--temperature. Drafts from the prediction file and/or prompt lookup are verified "
            "many tokens per forward pass; the output is exactly what plain greedy decoding "
            "would produce (sampling: follows exactly plain sampling's distribution). The "
            "completion goes to stdout, the statistics to stderr."
        ),
    )
    generate.add_argument("--prompt-file", required=True, metavar="P",
                          help="file holding the prompt text ('-' reads stdin)")
    generate.add_argument("--prediction-file", metavar="F",
                          help="file holding the expected output, e.g. the file before an edit")
    lookup = generate.add_mutually_exclusive_group()
    lookup.add_argument("--prompt-lookup", action="store_true", default=None,
                        help="draft by copying n-grams from the prompt and the output so far "
                             "(default: on as the fallback when a prediction is given, else off)")
    lookup.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                        help="never use prompt lookup, not even as the prediction's fallback")
    generate.add_argument("--max-tokens", type=positive_int, default=256, metavar="N",
                          help="most tokens to generate (default: 256)")
    generate.add_argument("--stop", action="append", default=[], metavar="S",
                          help="stop before this string (repeatable)")
    generate.add_argument("--model", default=os.environ.get("FORETELL_MODEL"), metavar="M",
                          help="'gemma-3-270m' (embedded default), a .gguf file, or a local "
                               "Hugging Face model folder (env: FORETELL_MODEL)")
    generate.add_argument("--max-draft", type=positive_int, default=128, metavar="K",
                          help="most draft tokens verified per forward pass (default: 128)")
    generate.add_argument("--temperature", type=temperature_value, default=0.0, metavar="T",
                          help="0 (default) decodes greedily; > 0 samples, still speculating, with "
                               "exactly plain sampling's distribution")
    generate.add_argument("--top-p", type=top_p_value, default=1.0, metavar="P",
                          help="sampling: keep the likeliest tokens up to this mass (default: 1)")
    generate.add_argument("--top-k", type=positive_int, default=None, metavar="K",
                          help="sampling: keep the K likeliest tokens (default: all)")
    generate.add_argument("--seed", type=int, default=None,
                          help="sampling: the same seed gives the same text (default: a fresh "
                               "seed, printed with the statistics)")
    generate.add_argument("--no-calibrate", action="store_true",
                          help="skip measuring the pass cost at start-up (uses built-in figures)")
    generate.add_argument("--recalibrate", action="store_true",
                          help="measure the pass cost again instead of reusing this machine's cached "
                               "calibration of the model (under the foretell cache folder)")
    generate.add_argument("--color", choices=CHOICES, default="auto",
                          help="colour the text by token origin: green from the prediction, cyan "
                               "from prompt lookup, yellow from the draft model, plain the model's own (default: auto, when stdout "
                               "is a terminal and NO_COLOR is unset)")
    generate.add_argument("--json-stats", action="store_true",
                          help="print the statistics to stderr as one JSON object")
    add_precision_options(generate)


def _format_stats(stats, finish_reason: str) -> str:
    lines = [
        f"tokens: {stats.completion_tokens} ({finish_reason}), prompt: {stats.prompt_tokens}",
        f"target passes: {stats.target_passes} "
        f"({stats.target_passes / max(stats.completion_tokens, 1):.3f} per output token)",
        f"drafted: {stats.drafted_tokens}, accepted: {stats.accepted_tokens} "
        f"({100 * stats.acceptance_rate:.1f}%)",
    ]
    for name, source in stats.per_source.items():
        lines.append(f"  {name}: {source.rounds} rounds, drafted {source.drafted}, "
                     f"accepted {source.accepted}")
    if "prediction" in stats.per_source:
        lines.append(f"prediction tokens: {stats.accepted_prediction_tokens} accepted, "
                     f"{stats.rejected_prediction_tokens} rejected")
    lines.append(f"time: prefill {stats.prefill_seconds:.2f} s, decode {stats.decode_seconds:.2f} s, "
                 f"{stats.tokens_per_second:.1f} tok/s")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    prompt = read_text(args.prompt_file, "prompt file")
    prediction = read_text(args.prediction_file, "prediction file") if args.prediction_file else None
    if not prompt:
        raise SystemExit("foretell: the prompt file is empty")

    try:
        model_kind(args.model)  # a wrong --model exits now, not after the imports
    except ValueError as error:
        raise SystemExit(f"foretell: cannot load model: {error}") from None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for a model hub at run time
    # The imports alone take seconds (torch, transformers): say something before them.
    print("foretell: loading the model...", file=sys.stderr, flush=True)
    with needs_proxy_extra("generate"):
        from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
        from foretell.proxy.engine.model_loader import load_model

    try:
        loaded = load_model(args.model, dtype=args.dtype or "auto", quantize=args.quantize or "auto",
                            fp32_head=args.fp32_head)
    except (ValueError, RuntimeError, OSError) as error:
        raise SystemExit(f"foretell: cannot load model: {error}") from None
    try:
        draft = None
        if args.draft_model:
            from foretell.proxy.engine.draft_model import load_draft_model

            print(f"foretell: loading the draft model {args.draft_model}...", file=sys.stderr, flush=True)
            draft = load_draft_model(args.draft_model, loaded)
        engine = SpeculativeEngine(loaded.model, loaded.tokenizer, fp32_head=args.fp32_head,
                                   kernels=args.kernels, draft_model=draft and draft.model,
                                   draft_model_name=args.draft_model or "draft")
    except (ValueError, RuntimeError, OSError) as error:
        raise SystemExit(f"foretell: {error}") from None
    print(f"foretell: precision {engine.precision}", file=sys.stderr)
    if not args.no_calibrate:
        from foretell.proxy.engine.calibration_cache import calibrate_with_cache

        cost = calibrate_with_cache(engine, loaded.source, recalibrate=args.recalibrate).pass_cost
        print(f"foretell: pass cost {1000 * cost.fixed:.0f} ms + {1000 * cost.per_position:.1f} ms "
              "per position", file=sys.stderr)
        if engine.draft_model is not None:
            cost = engine.draft_model.calibrate()
            print(f"foretell: draft pass cost {1000 * cost.fixed:.0f} ms + {1000 * cost.per_position:.1f} ms "
                  "per row", file=sys.stderr)
    prompt_ids = loaded.tokenizer(prompt)["input_ids"]
    request = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=args.max_tokens, prediction=prediction,
        prompt_lookup=args.prompt_lookup, stop=tuple(args.stop), max_draft=args.max_draft,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
    )

    spans = None
    if use_color(args.color, sys.stdout):
        from foretell.proxy.server.origins import OriginSpans

        spans = OriginSpans(loaded.tokenizer, request.stop)
        print(legend(), file=sys.stderr, flush=True)

    def show(update) -> None:
        if spans is None:
            sys.stdout.write(update.text)
        else:  # each piece in the colour of the draft source that wrote it
            spans.add(update.token_ids, update.origins)
            sys.stdout.write(paint_spans((s["text"], s["origin"]) for s in spans.split(update.text)))
        sys.stdout.flush()

    try:
        result = engine.generate(request, on_update=show)
    except ValueError as error:
        raise SystemExit(f"foretell: {error}") from None
    if not result.text.endswith("\n"):
        sys.stdout.write("\n")
    sys.stdout.flush()
    if args.json_stats:
        import json

        print(json.dumps({"finish_reason": result.finish_reason, "seed": result.seed,
                          **result.stats.as_dict()}), file=sys.stderr)
    else:
        print(_format_stats(result.stats, result.finish_reason), file=sys.stderr)
        if result.seed is not None:
            print(f"seed: {result.seed}", file=sys.stderr)
    return 0
