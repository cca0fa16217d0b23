"""bf16 batch invariant or not, side by side: what one text per request costs at bf16 (issue 28).

Two ways of running the embedded model in bf16 (the fp32 head's rescoring on, as by default),
on the same edit prompts as ``precision_benchmark.py`` (greedy, a fresh engine per request),
interleaved prompt by prompt so that a noisy machine slows both alike:

  variant    bf16 as it ran before 2026-12-06: one ``nn.Linear`` call per pass, SDPA attention
  invariant  bf16 as the engine loads it on a CPU with native bf16: products in calls of the row
             count checked at load (``row_chunked_linear.py``) and the fixed-split attention

Prints, per way, the median tok/s of plain, prompt-lookup and prediction + lookup decoding and
how many speculative texts equal that way's plain one. (Until 574084b this script probed three
ways, 64-row calls among them; their figures are in docs/benchmarks.md.)

    python benchmarks/bf16_invariance_probe.py [--files 6] [--output-tokens 256]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from precision_benchmark import FORETELL_MODES, build_prompts, timed_on_a_fresh_engine  # noqa: E402

from foretell.proxy.engine import SpeculativeEngine  # noqa: E402
from foretell.proxy.engine.kernel_timing import describe_cpu  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402
from foretell.proxy.engine.row_chunked_linear import RowChunkedLinear  # noqa: E402

WAYS = ("variant", "invariant")


def as_before(model):
    """A copy of ``model`` with every ``RowChunkedLinear`` a plain ``nn.Linear`` again (the same
    weights) and the attention back on SDPA."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, RowChunkedLinear):
                plain = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                        device="meta")
                plain.weight, plain.bias = child.weight, child.bias
                setattr(parent, name, plain)
    model.foretell_batch_invariant = False
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=6, help="how many edit prompts (default 6)")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens per request (default 256)")
    args = parser.parse_args()
    cpu = describe_cpu()
    print(f"CPU: {cpu['model']}; kernel features: {', '.join(cpu['features']) or 'none'}; "
          f"torch {torch.__version__}, {cpu['threads']} threads")
    loaded = load_model(None, dtype="bfloat16", quantize="none", fp32_head=None)
    rows = {m.rows for m in loaded.model.modules() if isinstance(m, RowChunkedLinear)}
    if not getattr(loaded.model, "foretell_batch_invariant", False):
        print("bf16 is not batch invariant on this CPU (no native bf16, or the row check failed): "
              "nothing to compare")
        return 1
    print(f"invariant: products in calls of at most {rows.pop()} rows")
    models = {"variant": as_before(loaded.model), "invariant": loaded.model}
    priors = {way: SpeculativeEngine(model, loaded.tokenizer).calibrate() for way, model in models.items()}
    prompts = build_prompts(loaded.tokenizer, args.files, 250, 700)
    speeds = {way: {mode: [] for mode in FORETELL_MODES} for way in WAYS}
    equal = {way: dict.fromkeys(FORETELL_MODES, 0) for way in WAYS}
    for file, before, ids in prompts:
        for way in WAYS:
            plain = None
            for mode in FORETELL_MODES:
                _, result, tok_s = timed_on_a_fresh_engine(models[way], loaded.tokenizer, priors[way], ids,
                                                           mode, before, args.output_tokens)
                speeds[way][mode].append(tok_s)
                plain = result.token_ids if mode == "plain" else plain
                equal[way][mode] += result.token_ids == plain
            print(f"  {way:9s} {file:16s} " + "  ".join(f"{m} {speeds[way][m][-1]:6.1f}" for m in FORETELL_MODES),
                  file=sys.stderr, flush=True)
    n = len(prompts)
    print("\n| bf16 way | plain tok/s | lookup tok/s | pred+lookup tok/s | lookup equal to plain "
          "| pred+lookup equal to plain |")
    print("|---|---|---|---|---|---|")
    for way in WAYS:
        s = {mode: statistics.median(v) for mode, v in speeds[way].items()}
        print(f"| {way} | {s['plain']:.1f} | {s['lookup']:.1f} | {s['pred+lookup']:.1f} | "
              f"{equal[way]['lookup']}/{n} | {equal[way]['pred+lookup']}/{n} |")
    ratios = {mode: statistics.median(i / v for i, v in zip(speeds["invariant"][mode], speeds["variant"][mode]))
              for mode in FORETELL_MODES}
    print("\ninvariant / variant, median of per-prompt ratios: "
          + ", ".join(f"{mode} {r:.2f}x" for mode, r in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
