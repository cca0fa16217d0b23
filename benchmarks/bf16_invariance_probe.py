"""Can bf16 give one text per request on this CPU? A probe for issue 28, not an engine mode.

Three ways of running the embedded model in bf16 (the fp32 head's rescoring on, as by default),
each on the same edit prompts as ``precision_benchmark.py`` (greedy, a fresh engine per request):

  sdpa            the engine as it runs bf16 today (SDPA attention; not batch invariant)
  fixed-attention the engine's fixed-split attention switched on (``foretell_batch_invariant``)
  fixed-rows      that, and every ``nn.Linear`` (the head too) run in calls of exactly ``--rows``
                  rows: a pass's rows padded with zero rows and split, so a row's product never
                  depends on how many rows share the pass

Prints, per way, the median tok/s of plain, prompt-lookup and prediction + lookup decoding and
how many speculative texts equal the plain one.

    python benchmarks/bf16_invariance_probe.py [--files 6] [--output-tokens 256] [--rows 64]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from precision_benchmark import FORETELL_MODES, build_prompts, timed_on_a_fresh_engine  # noqa: E402

from foretell.proxy.engine import SpeculativeEngine  # noqa: E402
from foretell.proxy.engine.kernel_timing import describe_cpu  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402

WAYS = ("sdpa", "fixed-attention", "fixed-rows")


def fixed_rows(rows: int):
    """An ``nn.Linear.forward`` that multiplies in calls of exactly ``rows`` rows."""
    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])  # [n, in]
        n = flat.shape[0]
        padded = -(-n // rows) * rows
        if padded > n:
            flat = torch.cat([flat, flat.new_zeros(padded - n, flat.shape[1])])
        out = torch.cat([F.linear(flat[i:i + rows], self.weight, self.bias) for i in range(0, padded, rows)])
        return out[:n].reshape(*x.shape[:-1], out.shape[-1])  # [..., out]
    return forward


def run_way(way: str, prompts, output_tokens: int, rows: int) -> dict:
    loaded = load_model(None, dtype="bfloat16", quantize="none", fp32_head=None)
    model = loaded.model
    model.foretell_batch_invariant = way != "sdpa"
    if way == "fixed-rows":
        for module in model.modules():
            if type(module) is torch.nn.Linear:
                module.forward = types.MethodType(fixed_rows(rows), module)
    prior = SpeculativeEngine(model, loaded.tokenizer).calibrate()
    speeds = {mode: [] for mode in FORETELL_MODES}
    equal = dict.fromkeys(FORETELL_MODES, 0)
    for file, before, ids in prompts:
        plain = None
        for mode in FORETELL_MODES:
            _, result, tok_s = timed_on_a_fresh_engine(model, loaded.tokenizer, prior, ids, mode, before,
                                                       output_tokens)
            speeds[mode].append(tok_s)
            plain = result.token_ids if mode == "plain" else plain
            equal[mode] += result.token_ids == plain
        print(f"  {way} {file:16s} " + "  ".join(f"{m} {speeds[m][-1]:6.1f}" for m in FORETELL_MODES),
              file=sys.stderr, flush=True)
    return {"speeds": {m: statistics.median(v) for m, v in speeds.items()}, "equal": equal, "n": len(prompts)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=6, help="how many edit prompts (default 6)")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens per request (default 256)")
    parser.add_argument("--rows", type=int, default=64, help="rows per product call for fixed-rows (default 64)")
    args = parser.parse_args()
    if args.rows < 1:
        parser.error("--rows must be at least 1")
    cpu = describe_cpu()
    print(f"CPU: {cpu['model']}; kernel features: {', '.join(cpu['features']) or 'none'}; "
          f"torch {torch.__version__}, {cpu['threads']} threads")
    from transformers import AutoTokenizer

    from foretell.proxy.engine.model_loader import resolve_model_folder

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_folder(None)[1]), local_files_only=True)
    prompts = build_prompts(tokenizer, args.files, 250, 700)
    results = {way: run_way(way, prompts, args.output_tokens, args.rows) for way in WAYS}
    print("\n| bf16 way | plain tok/s | lookup tok/s | pred+lookup tok/s | lookup equal to plain "
          "| pred+lookup equal to plain |")
    print("|---|---|---|---|---|---|")
    for way, r in results.items():
        s, e, n = r["speeds"], r["equal"], r["n"]
        print(f"| {way} | {s['plain']:.1f} | {s['lookup']:.1f} | {s['pred+lookup']:.1f} | "
              f"{e['lookup']}/{n} | {e['pred+lookup']}/{n} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
