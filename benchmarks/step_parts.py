"""Where a plain decoding step's time goes.

One engine at the default precision (or ``--dtype`` / ``--quantize``), one sequence decoding
plainly after a ~230-token prompt. Prints the median step time over ``--steps`` steps, then the
parts of a step timed by module hooks in a second run, by module class (nested: a decoder layer
includes its attention and MLP blocks, a block its projections; ``Int8DynamicLinear`` counts the
shared q/k/v and gate/up products again under ``SharedInputProjection``; the hooks add a few
microseconds a call, so the step runs a little slower than unhooked).
To see what a change buys, run it beside an earlier commit, alternating rounds:
``edit_ab.py --script step_parts.py REF``.

``--try-compile`` also times one non-matmul part, the int8 products' activation quantization
(``invariant_linear.quantize_rows``, a dozen small operations), eager against ``torch.compile``
(inductor, dynamic shapes) at 1, 17 and 65 rows, with the compile time and whether the bits agree.

``--prefill N`` also times a cold prefill of an N-token prompt (and its first token), median of
three, with the time spent in each native loop (``foretell/kernels/*.cpp``) during it.

``--pass-rows 1,8,16`` also times one pass of each number of new rows (logits for all of them,
as a verify pass has) after a 700-token context, median of nine, and the int8 output head's
product alone at those rows; each both with the head's rows in calls of ``rows_per_call``, as it
runs, and in one FBGEMM call.

``--torch-candidates`` finds the head's rescoring candidates with topk instead of
``head_candidates.cpp``. ``--torch-norm`` keeps the model's own RMSNorms instead of
``row_norm.cpp``'s; ``--own-layers`` transformers' decoder layers instead of ``lean_layers.py``'s
one function each (whose parts call their modules' forward directly, so the hooks below see only
the layers and the norms: pass ``--own-layers`` for the whole breakdown).
``--torch-attention`` times the batch-invariant attention as torch operations instead of the
native loop (``foretell/kernels/row_attention.cpp``), ``--torch-int8-rows`` the int8 products'
quantization and scaling as torch operations instead of ``int8_rows.cpp``: to see what each buys.

    python benchmarks/step_parts.py [--steps 60] [--dtype auto] [--quantize auto] [--try-compile]
        [--torch-attention] [--torch-int8-rows] [--torch-norm] [--torch-candidates] [--own-layers]
        [--prefill N] [--pass-rows 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine  # noqa: E402
from foretell.proxy.engine import invariant_linear, invariant_norm, kv_cache, precision  # noqa: E402
from foretell.proxy.engine.forward import forward_pass  # noqa: E402
from foretell.proxy.engine.kernel_timing import median_seconds  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402

PROMPT = "".join(f"def function_{i}(value):\n    return value * {i} + {i * i}\n\n" for i in range(12))


def step_times(engine, seq, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step([seq])
        times.append(time.perf_counter() - start)
    return times


def parts(engine, seq, steps: int) -> dict[str, float]:
    """Milliseconds a step per module class (nested: a layer includes its projections)."""
    spent = collections.defaultdict(float)
    handles = []
    for module in engine.model.modules():
        name = type(module).__name__
        if name.endswith(("Attention", "MLP", "RMSNorm", "DecoderLayer", "Linear", "Projection")):
            def pre(m, *_):
                m._started = time.perf_counter()

            def post(m, *_, name=name):
                spent[name] += time.perf_counter() - m._started
            handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    attend = ALL_ATTENTION_FUNCTIONS[kv_cache.ATTENTION_NAME]

    def timed_attention(*args, **kwargs):
        start = time.perf_counter()
        try:
            return attend(*args, **kwargs)
        finally:
            spent["paged attention (the function)"] += time.perf_counter() - start
    ALL_ATTENTION_FUNCTIONS[kv_cache.ATTENTION_NAME] = timed_attention
    try:
        total = sum(step_times(engine, seq, steps))
    finally:
        ALL_ATTENTION_FUNCTIONS[kv_cache.ATTENTION_NAME] = attend
        for handle in handles:
            handle.remove()
    table = {"whole step": 1000 * total / steps, **{k: 1000 * v / steps for k, v in spent.items()}}
    layers = sum(v for k, v in table.items() if k.endswith("DecoderLayer"))
    table["outside the decoder layers (embedding, output head and rescoring, the engine)"] = table["whole step"] - layers
    return table


NATIVE_CALLS = {"row_attention": ["row_attention"], "int8_rows": ["quantize_rows", "scale_rows"],
                "row_norm": ["rms_norm"]}


def prefill(engine, tokenizer, tokens: int) -> None:
    """A cold prefill of ``tokens`` prompt tokens and one decoded token, three times: the median,
    and each native loop's share (its calls wrapped in timers)."""
    from foretell.kernels.cpu_native import load_native

    spent = collections.defaultdict(float)
    for name, calls in NATIVE_CALLS.items():
        module = load_native(name)
        for call in calls if module is not None else []:
            def timed(*args, original=getattr(module, call), call=call):
                start = time.perf_counter()
                try:
                    return original(*args)
                finally:
                    spent[call] += time.perf_counter() - start
            setattr(module, call, timed)
    ids = (tokenizer(PROMPT * (1 + tokens // 200))["input_ids"])[:tokens]
    times = []
    for _ in range(3):
        engine.cache.prefix.clear()  # cold: nothing of the prompt cached
        seq = engine.add(GenerationRequest(prompt_ids=ids, max_tokens=1, prompt_lookup=False))
        start = time.perf_counter()
        while not seq.finished:
            engine.step([seq])
        times.append(time.perf_counter() - start)
    print(f"\nprefill of {len(ids)} tokens and one token: median {1000 * statistics.median(times):.0f} ms "
          f"(runs: {', '.join(f'{1000 * t:.0f}' for t in times)})")
    for call, seconds in spent.items():
        print(f"  in {call}: {1000 * seconds / 3:.0f} ms a prefill")


def pass_rows(engine, counts: list[int], context: int = 700) -> None:
    """One pass of n new rows after ``context`` tokens, per n (never committed: each pass
    writes the same positions again), and the output head's product of n rows alone; an int8
    head both as it runs (``rows_per_call`` rows an FBGEMM call) and in one call, in turn."""
    blocks = engine.cache.reserve(context + max(counts) + 1, context + max(counts) + 1)
    head = engine.model.get_output_embeddings()
    int8_head = isinstance(head, invariant_linear.Int8DynamicLinear)
    chosen = head.rows_per_call if int8_head else None
    generator = torch.Generator().manual_seed(0)

    def median_ms(function, calls=None) -> float:
        if int8_head:
            head.rows_per_call = calls
        try:
            return 1000 * median_seconds(function, repeats=9, warmup=0)
        finally:
            if int8_head:
                head.rows_per_call = chosen

    try:
        forward_pass(engine.model, engine.cache, [(blocks, torch.randint(10, 1000, (context,)).tolist(), None)],
                     engine.fp32_head)
        blocks.committed = context
        hidden = torch.randn(max(counts), head.in_features, generator=generator)
        print(f"\nthe int8 head's rows a call: {chosen if int8_head else '-'}")
        print(f"\n| new rows (after {context} tokens) | pass ms | pass ms, head in one call | int8 head alone ms "
              "| head alone, one call |\n|---|---|---|---|---|")
        for n in counts:
            ids = torch.randint(0, 1000, (n,), generator=generator).tolist()

            def whole():
                forward_pass(engine.model, engine.cache, [(blocks, ids, 0)], engine.fp32_head)

            def alone():
                head.product(hidden[:n])

            figures = [median_ms(whole, chosen), median_ms(whole)]
            if int8_head:
                figures += [median_ms(alone, chosen), median_ms(alone)]
            print("| " + " | ".join([str(n)] + [f"{f:.1f}" for f in figures] + ["-"] * (4 - len(figures))) + " |")
    finally:
        engine.cache.free(blocks)


def try_compile(width: int = 640) -> None:
    from foretell.proxy.engine.invariant_linear import quantize_rows

    def quantize(x):
        levels, scales, residual = quantize_rows(x)
        return torch.cat(levels), torch.cat(scales), residual

    def median_us(function, x) -> float:
        return 1e6 * median_seconds(lambda: function(x), repeats=300, warmup=10)

    compiled = torch.compile(quantize, dynamic=True)
    start = time.perf_counter()
    compiled(torch.randn(2, width))
    print(f"\ntorch.compile of the activation quantization: {time.perf_counter() - start:.1f} s to compile")
    print("\n| rows | eager us | compiled us | same bits |\n|---|---|---|---|")
    for rows in (1, 17, 65):
        x = torch.randn(rows, width)
        same = all(torch.equal(a, b) for a, b in zip(quantize(x), compiled(x)))
        print(f"| {rows} | {median_us(quantize, x):.0f} | {median_us(compiled, x):.0f} | {same} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="auto")
    parser.add_argument("--try-compile", action="store_true")
    parser.add_argument("--torch-attention", action="store_true",
                        help="the batch-invariant attention as torch operations, not the native loop")
    parser.add_argument("--torch-int8-rows", action="store_true",
                        help="the int8 products' quantization and scaling as torch operations, not native")
    parser.add_argument("--prefill", type=int, default=0, metavar="N",
                        help="also time a cold prefill of an N-token prompt and the native loops in it")
    parser.add_argument("--pass-rows", default="", metavar="1,8,16",
                        help="also time one pass of each number of new rows, and the int8 head alone")
    parser.add_argument("--torch-norm", action="store_true",
                        help="the model's own RMSNorms (torch operations), not the native loop")
    parser.add_argument("--torch-candidates", action="store_true",
                        help="the head's rescoring finds its candidates with topk, not the native search")
    parser.add_argument("--own-layers", action="store_true",
                        help="transformers' decoder layers, not lean_layers.py's one function each")
    args = parser.parse_args()
    if args.torch_candidates:
        precision.native_head_candidates = lambda: None  # rescore_in_fp32 then takes topk's way
    if args.torch_norm:
        invariant_norm.native_rms_norm = lambda: None  # the load then keeps the model's norms
    loaded = load_model(None, dtype=args.dtype, quantize=args.quantize)
    if args.own_layers:
        loaded.model.foretell_lean_layers = False  # decided: the engine keeps them
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer)
    if args.torch_attention:
        engine.cache.row_attention = None
    if args.torch_int8_rows:
        invariant_linear.native_int8_rows = lambda: None  # every layer then takes the torch operations
    prompt = loaded.tokenizer(PROMPT)["input_ids"]
    seq = engine.add(GenerationRequest(prompt_ids=prompt, max_tokens=2 * args.steps + 8, prompt_lookup=False))
    attention = "native loop" if engine.cache.row_attention is not None else "torch operations"
    int8_rows = "native" if invariant_linear.native_int8_rows() is not None else "torch operations"
    norms = sum(isinstance(m, invariant_norm.RowInvariantRMSNorm) for m in engine.model.modules())
    print(f"precision {engine.precision}, {len(prompt)} prompt tokens, {torch.get_num_threads()} threads, "
          f"attention: {attention}, int8 rows: {int8_rows}, native RMSNorms: {norms}, "
          f"decoder layers: {'one function each' if engine.lean_layers else 'transformers'}")
    with torch.inference_mode():
        step_times(engine, seq, 5)  # the prefill and a warm-up
        median = statistics.median(step_times(engine, seq, args.steps))
        print(f"median step {1000 * median:.1f} ms ({1 / median:.1f} tok/s)")
        print("\n| part (module hooks) | ms a step |\n|---|---|")
        for name, ms in sorted(parts(engine, seq, args.steps).items(), key=lambda kv: -kv[1]):
            print(f"| {name} | {ms:.2f} |")
        if args.prefill:
            prefill(engine, loaded.tokenizer, args.prefill)
        if args.pass_rows:
            pass_rows(engine, [int(n) for n in args.pass_rows.split(",")])
    if args.try_compile:
        try_compile()
    return 0


if __name__ == "__main__":
    sys.exit(main())
