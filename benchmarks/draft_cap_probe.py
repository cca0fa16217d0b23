"""Probe: what a cap on the draft length does to the precision benchmark's edit prompts.

Runs each of precision_benchmark.py's six edit prompts (256 tokens, greedy, the default
precision) with prompt lookup alone and with the file as a prediction too, each on a fresh
engine, with no cap and with each cap given, and prints tok/s (wall, prefill included), passes,
drafted and accepted tokens, then the median of each (cap, mode). A diagnostic for the
draft-length policy (issue 28), not a benchmark of record.

    python benchmarks/draft_cap_probe.py 0,16,32      # 0: no cap (the engine's default)
"""

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import precision_benchmark as pb  # noqa: E402

from foretell.proxy.engine import SpeculativeEngine  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402


def main() -> None:
    caps = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "0,16,32").split(",")]
    dtype, quantize, fp32_head = pb.PRECISIONS["default"]
    loaded = load_model(None, dtype=dtype, quantize=quantize, fp32_head=fp32_head)
    prior = SpeculativeEngine(loaded.model, loaded.tokenizer, fp32_head=fp32_head).calibrate()
    rates: dict[tuple[int, str], list[float]] = {}
    for name, before, ids in pb.build_prompts(loaded.tokenizer, 6, 250, 700):
        for cap in caps:
            for mode in ("lookup", "pred+lookup"):
                _, result, rate = pb.timed_on_a_fresh_engine(loaded.model, loaded.tokenizer, prior, ids, mode,
                                                             before, 256, fp32_head, max_draft=cap or None)
                rates.setdefault((cap, mode), []).append(rate)
                s = result.stats
                print(f"{name:15s} cap {cap:3d} {mode:12s} {rate:6.1f} tok/s  prefill {s.prefill_seconds:.2f} s"
                      f"  decode {s.decode_seconds:.2f} s  passes {s.target_passes}  drafted {s.drafted_tokens}"
                      f"  accepted {s.accepted_tokens}", flush=True)
    for (cap, mode), values in rates.items():
        print(f"cap {cap:3d} {mode:12s} median {statistics.median(values):6.1f} tok/s")

if __name__ == "__main__":
    main()
