"""The prepared device check: everything issue 18 asks of a GPU, in one command, under 8 minutes
on one H200. Writes ``gpu_check.json`` and ``gpu_check.md`` (a markdown table per section) to
``--out`` and prints the markdown.

Sections (each catches its own failure, so one broken part does not lose the others' figures):
  kernel_tests     tests/kernels compiled on the device (FORETELL_TEST_DEVICE=cuda), against their
                   torch references
  self_check       the engine's start-up check in float32 and bfloat16: which kernels run Triton,
                   which fell back and why
  attention        the ragged paged attention kernel against the per-sequence loop on the
                   embedded model: a step mixing prefill chunks and verify rows, max |logit
                   difference| and whether every row's argmax agrees
  exactness        greedy tokens with predictions + prompt lookup against transformers'
                   generate(do_sample=False), counted: in float32 every one should equal (a near
                   tie may still part compiled kernels from transformers' own, so it is counted,
                   not asserted); bfloat16's divergence rate (the engine's speculative text
                   against its own plain decoding)
  batched          eight requests in one batch equal each request alone
  throughput       the embedded model at 1, 8, 32 and 64 concurrent sequences, plain and with
                   predictions (tok/s, target passes per output token), beside transformers'
                   generate with prompt lookup (one sequence) on the same device

    python benchmarks/gpu_check.py [--out gpu_check] [--dtype bfloat16] [--quick]

``--device cpu --quick`` runs the same sections on a CPU with the reference kernels, small: a
smoke test of the script itself (the figures mean nothing there).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edit_benchmark import PassCounter  # noqa: E402
from load_benchmark import workload  # noqa: E402

from foretell.kernels import LAUNCHES  # noqa: E402
from foretell.proxy.engine import GenerationRequest, SpeculativeEngine  # noqa: E402
from foretell.proxy.engine.model_loader import load_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# ---- sections ----------------------------------------------------------------------------------

def kernel_tests(args) -> dict:
    env = dict(os.environ, FORETELL_TEST_DEVICE=args.device, PYTHONUNBUFFERED="1")
    env["TRITON_INTERPRET"] = "0" if args.device == "cuda" else "1"
    started = time.perf_counter()
    try:  # a compile that hangs must not take the device's whole time
        done = subprocess.run([sys.executable, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as timeout:
        return {"returncode": None, "summary": "timed out after 300 s", "failures": [],
                "output_tail": (timeout.stdout or b"")[-2000:].decode(errors="replace")
                if isinstance(timeout.stdout, bytes) else (timeout.stdout or "")[-2000:]}
    lines = done.stdout.strip().splitlines()
    failures = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {"returncode": done.returncode, "summary": lines[-1] if lines else done.stderr[-400:],
            "failures": failures[:20], "seconds": round(time.perf_counter() - started, 1)}


def engine_for(loaded, kernels, args, **options):
    return SpeculativeEngine(loaded.model, loaded.tokenizer, kernels=kernels,
                             max_sequences=max(args.concurrency), **options)


def self_check(models, args) -> dict:
    return {dtype: engine_for(loaded, args.kernels, args, kv_cache_tokens=4096).kernels.describe()
            for dtype, loaded in models.items()}


def mixed_step_logits(loaded, kernels, args) -> torch.Tensor:
    """Logits [rows, V] of one step: sequence 0 feeds a 64-token prefill chunk, three others
    (whole prompts already in) verify rows of 5 drafts."""
    ids = [loaded.tokenizer(p)["input_ids"] for p, _ in workload(4, args.max_lines)]
    engine = engine_for(loaded, kernels, args, prefill_chunk=64, kv_cache_tokens=16384)
    sequences = [engine.add(GenerationRequest(prompt_ids=i, max_tokens=8)) for i in ids]
    for seq in sequences[1:]:
        while seq.uncached_prompt:
            engine.step([seq])
    feeds = [(sequences[0].blocks, ids[0][:64], 0)]
    # Fixed tokens, not each engine's own pending token: a near tie in its prefill must not make
    # the two paths score different inputs.
    feeds += [(seq.blocks, ids[0][:6], 0) for seq in sequences[1:]]
    before = LAUNCHES["paged_attention"]
    logits = engine._forward(feeds).float()
    launches = LAUNCHES["paged_attention"] - before
    for seq in sequences:
        engine.abort(seq)
    return logits, launches


def attention(models, args) -> dict:
    """The kernel against the loop on one mixed step; in bf16 both are also compared with the
    float32 model's logits, the yardstick for how far bf16 rounding alone moves them."""
    result, float32 = {}, None
    for dtype, loaded in models.items():
        loop, _ = mixed_step_logits(loaded, "reference", args)
        kernel, launches = mixed_step_logits(loaded, args.kernels, args)
        float32 = loop if dtype == "float32" else float32
        row = {"rows": loop.shape[0], "kernel_vs_loop_max": round((kernel - loop).abs().max().item(), 6),
               "argmax_agree": bool((kernel.argmax(-1) == loop.argmax(-1)).all()),
               "attention_launches": launches, "layers": loaded.model.config.num_hidden_layers}
        if dtype != "float32" and float32 is not None:
            row["loop_vs_float32_max"] = round((loop - float32).abs().max().item(), 4)
            row["kernel_vs_float32_max"] = round((kernel - float32).abs().max().item(), 4)
        result[dtype] = row
    return result


def hf_greedy(loaded, prompt_ids, max_new, lookup=False):
    model = loaded.model
    device = next(model.parameters()).device
    kwargs = {"prompt_lookup_num_tokens": 10} if lookup else {}
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids], device=device), max_new_tokens=max_new, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long, device=device),
                             **kwargs)
    return out[0, len(prompt_ids):].tolist()


def exactness(models, args) -> dict:
    result = {}
    for dtype, loaded in models.items():
        engine = engine_for(loaded, args.kernels, args)
        rows = []
        for prompt, prediction in workload(args.prompts, args.max_lines):
            ids = loaded.tokenizer(prompt)["input_ids"]
            spec = engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=args.max_tokens,
                                                     prediction=prediction, prompt_lookup=True)).token_ids
            plain = engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=args.max_tokens)).token_ids
            oracle = hf_greedy(loaded, ids, args.max_tokens)
            rows.append({"tokens": len(spec), "spec_equals_hf": spec == oracle[:len(spec)],
                         "spec_equals_own_plain": spec == plain, "plain_equals_hf": plain == oracle[:len(plain)]})
        result[dtype] = {"prompts": len(rows),
                         "spec_equals_hf": sum(r["spec_equals_hf"] for r in rows),
                         "spec_equals_own_plain": sum(r["spec_equals_own_plain"] for r in rows),
                         "plain_equals_hf": sum(r["plain_equals_hf"] for r in rows),
                         "divergence_rate": round(1 - sum(r["spec_equals_own_plain"] for r in rows) / len(rows), 3)}
    return result


def run_batch(engine, requests):
    """All requests in the same steps: (tokens per request, steps, seconds)."""
    sync(engine.device)
    started = time.perf_counter()
    sequences = [engine.add(r) for r in requests]
    if any(seq is None for seq in sequences):
        raise RuntimeError("the KV cache cannot hold this batch")
    tokens = {id(seq): [] for seq in sequences}
    steps = 0
    while not all(seq.finished for seq in sequences):
        for update in engine.step([seq for seq in sequences if not seq.finished]):
            if update.error is not None:
                raise update.error
            tokens[id(update.sequence)] += update.token_ids
        steps += 1
    sync(engine.device)
    return [tokens[id(seq)] for seq in sequences], steps, time.perf_counter() - started


def batched(models, args) -> dict:
    result = {}
    for dtype, loaded in models.items():
        engine = engine_for(loaded, args.kernels, args)
        requests = [GenerationRequest(prompt_ids=loaded.tokenizer(p)["input_ids"], max_tokens=args.max_tokens,
                                      prediction=pred if i % 2 else None, prompt_lookup=i % 3 == 0)
                    for i, (p, pred) in enumerate(workload(8, args.max_lines))]
        together, _, _ = run_batch(engine, requests)
        alone = [run_batch(engine, [r])[0][0] for r in requests]
        result[dtype] = {"requests": len(requests), "equal": sum(a == b for a, b in zip(together, alone))}
    return result


def throughput(models, args) -> dict:
    loaded = models[args.dtype]
    engine = engine_for(loaded, args.kernels, args)
    items = workload(max(args.concurrency), args.max_lines)
    engine.generate(GenerationRequest(prompt_ids=loaded.tokenizer(items[0][0])["input_ids"], max_tokens=8))  # warm
    rows = []
    for concurrency in args.concurrency:
        for mode in ("plain", "prediction"):
            # A unique first line per request: the prefix cache does not help, batching alone is measured.
            requests = [GenerationRequest(
                prompt_ids=loaded.tokenizer(f"# request {concurrency}-{mode}-{i}\n" + prompt)["input_ids"],
                max_tokens=args.max_tokens, prediction=prediction if mode == "prediction" else None,
                prompt_lookup=mode == "prediction") for i, (prompt, prediction) in enumerate(items[:concurrency])]
            tokens, steps, seconds = run_batch(engine, requests)
            total = sum(len(t) for t in tokens)
            rows.append({"concurrency": concurrency, "mode": mode, "tok_per_s": round(total / seconds, 1),
                         "passes_per_token": round(steps * concurrency / total, 3), "seconds": round(seconds, 2)})
            log(f"gpu_check: throughput {rows[-1]}")
    counter = PassCounter(loaded.model)
    for lookup in (False, True):
        times, tokens, passes = [], 0, 0
        for prompt, _ in items[:args.prompts]:
            ids = loaded.tokenizer(prompt)["input_ids"]
            counter.calls = 0
            sync(engine.device)
            started = time.perf_counter()
            tokens += len(hf_greedy(loaded, ids, args.max_tokens, lookup=lookup))
            sync(engine.device)
            times.append(time.perf_counter() - started)
            passes += counter.calls
        rows.append({"concurrency": 1, "mode": "hf-lookup" if lookup else "hf-greedy",
                     "tok_per_s": round(tokens / sum(times), 1), "passes_per_token": round(passes / tokens, 3),
                     "seconds": round(sum(times), 2)})
        log(f"gpu_check: throughput {rows[-1]}")
    return {"dtype": args.dtype, "rows": rows}


# ---- report ------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    lines = [f"# gpu_check ({report['device_name']}, torch {report['torch']}, kernels={report['kernels']})", ""]
    for name, section in report["sections"].items():
        lines.append(f"## {name} ({section.get('seconds', '?')} s)")
        if "error" in section:
            lines += ["", "```", section["error"].strip()[-1500:], "```", ""]
            continue
        body = section["result"]
        rows = body["rows"] if isinstance(body, dict) and "rows" in body else None
        if rows is None and isinstance(body, dict) and all(isinstance(v, dict) for v in body.values()):
            rows = [{"": key, **value} for key, value in body.items()]
        if rows:
            keys = list(dict.fromkeys(k for row in rows for k in row))  # every row's, in order
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(row.get(k, "")) for k in keys) + " |" for row in rows]
        else:
            lines += ["", "```", json.dumps(body, indent=1), "```"]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="gpu_check", help="folder for gpu_check.json and gpu_check.md")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", help="dtype of the throughput section (default bfloat16)")
    parser.add_argument("--kernels", default=None, help="auto (default on cuda), triton or reference")
    parser.add_argument("--quick", action="store_true", help="small: 2 prompts, 24 tokens, concurrency 1 and 4")
    parser.add_argument("--sections", nargs="+", default=["kernel_tests", "self_check", "attention", "exactness",
                                                          "batched", "throughput"])
    args = parser.parse_args()
    args.kernels = args.kernels or ("auto" if args.device == "cuda" else "reference")
    args.prompts, args.max_tokens, args.max_lines = (2, 24, 12) if args.quick else (6, 128, 40)
    args.concurrency = [1, 4] if args.quick else [1, 8, 32, 64]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": args.device, "kernels": args.kernels, "torch": torch.__version__,
              "device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "sections": {}}
    models = {}
    for dtype in ("float32", "bfloat16"):
        if args.sections != ["kernel_tests"]:
            log(f"gpu_check: loading the embedded model in {dtype}")
            models[dtype] = load_model(None, device=args.device, dtype=dtype)
    sections = {"kernel_tests": lambda: kernel_tests(args), "self_check": lambda: self_check(models, args),
                "attention": lambda: attention(models, args), "exactness": lambda: exactness(models, args),
                "batched": lambda: batched(models, args), "throughput": lambda: throughput(models, args)}
    for name in args.sections:
        log(f"gpu_check: {name}...")
        started = time.perf_counter()
        try:
            entry = {"result": sections[name]()}
        except Exception:
            entry = {"error": traceback.format_exc()}
        entry["seconds"] = round(time.perf_counter() - started, 1)
        report["sections"][name] = entry
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1))  # what is done survives a timeout
        log(f"gpu_check: {name} done in {entry['seconds']} s" + (" (failed)" if "error" in entry else ""))
    text = markdown(report)
    (out / "gpu_check.md").write_text(text)
    print(text)
    return 0 if all("error" not in s for s in report["sections"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
