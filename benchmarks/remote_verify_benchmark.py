"""Remote verification benchmark: the edit workload through the proxy to a foretell upstream,
plain forwarding vs remote verification, side by side in one run.

Two ``foretell serve`` processes on the embedded model: the *upstream*, and the *proxy* with a
TOML config routing ``remote-plain`` to the upstream as a plain route (the prediction is
dropped: decoded token by token upstream) and ``remote-verify`` to the same upstream with
``verify_predictions = "echo"`` and the model's tokenizer (the prediction verified by echo
requests with prompt logprobs). The workload is ``edit_benchmark.py``'s: a standard-library file
cut to a size, three edits around its middle, a prompt asking for the edited file again, the
file before the edit as the prediction. Every request is greedy (temperature 0).

Reported per file and mode: output tokens, wall time (client side, prefill included), output
tokens/s, requests the proxy made upstream, prompt tokens it sent upstream, and whether the text
equals plain forwarding's. A second table gives the upstream's own rates on this machine: prefill
(a 1-token request), prefill with prompt logprobs (an echo request) and decoding.

Each prompt is cold by default: neither mode finds it cached upstream (the rates are measured on
a copy that shares no prefix with it). ``--warm`` scores it first, as when the same file was
edited a moment before.

``--upstream URL`` runs the same against a server already running (vLLM serving the embedded
model's folder under both names) instead of a second ``foretell serve``.

    python benchmarks/remote_verify_benchmark.py [--files 3] [--min-tokens 150] [--max-tokens 300]
        [--output-tokens 150] [--warm] [--upstream URL]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import httpx

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))
from edit_benchmark import STDLIB_FILES, copy_prompt, cut_to_tokens, edit  # noqa: E402


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(port: int, log_path: Path, *args: str) -> subprocess.Popen:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for name in ("FORETELL_API_KEY", "FORETELL_UPSTREAM_BASE_URL", "FORETELL_CONFIG"):
        env.pop(name, None)
    with open(log_path, "w") as handle:
        return subprocess.Popen([sys.executable, "-m", "foretell.cli", "serve", "--port", str(port), *args],
                                env=env, stdout=handle, stderr=subprocess.STDOUT)


def wait_healthy(base: str, process: subprocess.Popen, log_path: Path, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while True:
        if process.poll() is not None:
            raise SystemExit(f"foretell serve exited:\n{log_path.read_text()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        if time.time() > deadline:
            raise SystemExit(f"foretell serve did not become healthy:\n{log_path.read_text()}")
        time.sleep(0.2)


def request(base: str, body: dict) -> tuple[dict, float]:
    started = time.perf_counter()
    response = httpx.post(base + "/v1/completions", json=body, timeout=1800)
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise SystemExit(f"request failed: {response.status_code} {response.text[:500]}")
    return response.json(), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--min-tokens", type=int, default=150, help="smallest file kept, in tokens")
    parser.add_argument("--max-tokens", type=int, default=300, help="files are cut to this many tokens")
    parser.add_argument("--output-tokens", type=int, default=150, help="max_tokens of each request")
    parser.add_argument("--warm", action="store_true",
                        help="score each prompt on the upstream before the timed runs (an echo with prompt "
                             "logprobs), as when the same file was edited before: both modes find its KV "
                             "cached, and remote verification its prompt logprobs")
    parser.add_argument("--upstream", metavar="URL",
                        help="an upstream already running (e.g. http://127.0.0.1:8000 for vLLM) instead of a "
                             "second foretell serve; it must serve the embedded model under the names "
                             "remote-plain and remote-verify (vllm serve FOLDER --served-model-name "
                             "remote-plain remote-verify)")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from foretell.proxy.engine.model_loader import resolve_model_folder

    folder = resolve_model_folder(None)[1]
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for name in STDLIB_FILES:
        text = cut_to_tokens((stdlib / name).read_text(), tokenizer, args.min_tokens, args.max_tokens)
        if text:
            files.append((name, text))
        if len(files) == args.files:
            break

    work = Path(tempfile.mkdtemp(prefix="foretell-remote-bench-"))
    up_port, proxy_port = free_port(), free_port()
    up_base = args.upstream.rstrip("/").removesuffix("/v1") if args.upstream else f"http://127.0.0.1:{up_port}"
    (work / "proxy.toml").write_text(f"""
[upstreams.plain]
base_url = "{up_base}/v1"
timeout_seconds = 1800

[upstreams.verify]
base_url = "{up_base}/v1"
verify_predictions = "echo"
tokenizer = "gemma-3-270m"
timeout_seconds = 1800

[models.remote-plain]
upstream = "plain"
[models.remote-verify]
upstream = "verify"
""")
    proxy_base = f"http://127.0.0.1:{proxy_port}"
    log(f"starting {'the proxy' if args.upstream else 'the upstream and the proxy'} (logs in {work})")
    processes = []
    if not args.upstream:
        (work / "up.toml").write_text("[models.remote-plain]\nlocal = true\n[models.remote-verify]\nlocal = true\n")
        processes.append(start(up_port, work / "up.log", "--config", str(work / "up.toml")))
    processes.append(start(proxy_port, work / "proxy.log", "--config", str(work / "proxy.toml"),
                           "--served-model-name", "proxy-local", "--no-calibrate"))
    try:
        if not args.upstream:
            wait_healthy(up_base, processes[0], work / "up.log")
        wait_healthy(proxy_base, processes[-1], work / "proxy.log")
        return run(args, files, tokenizer, up_base, proxy_base)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


def run(args, files, tokenizer, up_base: str, proxy_base: str) -> int:
    # Warm both paths (first-request costs: allocations, the route's tokenizer).
    for model in ("remote-plain", "remote-verify"):
        request(proxy_base, {"model": model, "prompt": "def f(x):\n    return", "max_tokens": 4, "temperature": 0,
                             "prediction": {"type": "content", "content": " x + 1\n"}})
    rows, rates = [], []
    for index, (name, before) in enumerate(files):
        after = edit(before)
        prompt = copy_prompt(name, after)
        # The upstream's own rates on a prompt of this size: prefill alone, prefill with prompt
        # logprobs. Measured on a copy that shares no prefix with the prompt, so that neither
        # timed run finds its KV or its prompt logprobs already cached by these requests.
        timing = f"# timing {index}\n" + prompt
        prompt_tokens = len(tokenizer(timing)["input_ids"])
        _, prefill = request(up_base, {"model": "remote-plain", "prompt": timing, "max_tokens": 1, "temperature": 0})
        _, echo = request(up_base, {"model": "remote-plain", "prompt": timing, "max_tokens": 1,
                                    "temperature": 0, "echo": True, "logprobs": 1})
        if args.warm:
            request(up_base, {"model": "remote-plain", "prompt": prompt, "max_tokens": 1, "temperature": 0,
                              "echo": True, "logprobs": 1})
        reference = None
        for mode, model in (("plain forwarding", "remote-plain"), ("remote verification", "remote-verify")):
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_tokens, "temperature": 0,
                    "prediction": {"type": "content", "content": before}}
            answer, seconds = request(proxy_base, body)
            text = answer["choices"][0]["text"]
            reference = text if reference is None else reference
            usage, report = answer["usage"], answer.get("speculation") or {}
            remote = mode == "remote verification"
            row = {"file": name, "mode": mode, "tokens": usage["completion_tokens"], "seconds": seconds,
                   "requests": report["upstream_requests"] if remote else 1,
                   "sent": report["upstream_prompt_tokens"] if remote else usage["prompt_tokens"],
                   "accepted": report.get("accepted_tokens") if remote else None,
                   "exact": text == reference, "fallback": (report.get("remote_verification") or {}).get("fallback")}
            row["tok_s"] = row["tokens"] / seconds
            rows.append(row)
            if not remote:
                decode = (seconds - prefill) / max(row["tokens"] - 1, 1)
                rates.append((name, prompt_tokens, prefill, echo, decode))
            log(f"[{index + 1}/{len(files)}] {name:15s} {mode:19s} {row['tokens']:4d} tok {seconds:7.2f} s "
                f"{row['tok_s']:6.2f} tok/s  requests {row['requests']:3d}  prompt tokens sent {row['sent']:6d}"
                f"  {'exact' if row['exact'] else 'DIFFERS'}{'  fallback: ' + row['fallback'] if row['fallback'] else ''}")
    print_tables(rows, rates, files)
    return 0 if all(r["exact"] for r in rows) else 1


def print_tables(rows, rates, files) -> None:
    print("\n| file | mode | output tokens | seconds | output tok/s | upstream requests | prompt tokens sent "
          "| accepted draft tokens | same text |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['file']} | {row['mode']} | {row['tokens']} | {row['seconds']:.1f} | {row['tok_s']:.2f} | "
              f"{row['requests']} | {row['sent']} | {'-' if row['accepted'] is None else row['accepted']} | "
              f"{'yes' if row['exact'] else 'NO'} |")
    for mode in ("plain forwarding", "remote verification"):
        mine = [r for r in rows if r["mode"] == mode]
        tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
        print(f"| **all {len(files)} files** | **{mode}** | {tokens} | {seconds:.1f} | **{tokens / seconds:.2f}** | "
              f"{sum(r['requests'] for r in mine)} | {sum(r['sent'] for r in mine)} | "
              f"{'-' if mode.startswith('plain') else sum(r['accepted'] for r in mine)} | "
              f"{sum(r['exact'] for r in mine)}/{len(mine)} |")
    plain = {r["file"]: r for r in rows if r["mode"] == "plain forwarding"}
    ratios = [r["tok_s"] / plain[r["file"]]["tok_s"] for r in rows if r["mode"] == "remote verification"]
    print(f"\nspeed-up of remote verification per file: {', '.join(f'{x:.2f}x' for x in ratios)}")
    print("\n| file | prompt tokens | prefill (1-token request) | echo with prompt logprobs | decode per token "
          "| prefill per token / decode per token |")
    print("|---|---|---|---|---|---|")
    for name, tokens, prefill, echo, decode in rates:
        print(f"| {name} | {tokens} | {prefill:.2f} s | {echo:.2f} s | {1000 * decode:.0f} ms | "
              f"1/{decode / (prefill / tokens):.0f} (echo: 1/{decode / (echo / tokens):.0f}) |")


if __name__ == "__main__":
    sys.exit(main())
