"""Cost of one target pass by number of positions: the whole pass, the transformer body and
the LM head apart, the head computed in chunks of 32 rows, and the head taken vocabulary-major
(``weight @ hidden.T``, as the engine computes it) (medians of 5 runs).

    python benchmarks/pass_cost.py [--context 600] [--model M]
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from transformers import DynamicCache  # noqa: E402

from foretell.proxy.engine.model_loader import load_model  # noqa: E402


def median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return 1000 * sorted(times)[repeats // 2]


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=600)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    model = load_model(args.model).model
    # The model alone, on transformers' own cache (cropped back after each pass): the engine's
    # paged cache adds its per-sequence attention on top of this.
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    model(input_ids=torch.randint(10, 1000, (1, args.context)), cache=cache, logits_to_keep=1)
    cache.crop(0)
    hidden_size = model.config.hidden_size
    print(f"context {args.context} tokens, torch threads {torch.get_num_threads()}")
    print("| positions | full pass (ms) | body (ms) | LM head (ms) | LM head in 32-row chunks (ms) "
          "| LM head vocabulary-major (ms) |")
    print("|---|---|---|---|---|---|")
    weight = model.lm_head.weight  # [V, d]
    for n in (1, 4, 8, 17, 33, 65, 129):
        ids = torch.randint(10, 1000, (1, n))
        hidden = torch.randn(1, n, hidden_size)

        def full():
            model(input_ids=ids, cache=cache)
            cache.crop(-n)

        def body():
            model.model(input_ids=ids, cache=cache)
            cache.crop(-n)

        def head_chunks():
            for start in range(0, n, 32):
                model.lm_head(hidden[:, start:start + 32])

        def head_vocabulary_major():
            (weight @ hidden[0].t()).t().contiguous()  # [V, n] -> [n, V]

        print(f"| {n} | {median_ms(full):.0f} | {median_ms(body):.0f} | "
              f"{median_ms(lambda: model.lm_head(hidden)):.0f} | {median_ms(head_chunks):.0f} "
              f"| {median_ms(head_vocabulary_major):.0f} |", flush=True)


if __name__ == "__main__":
    main()
