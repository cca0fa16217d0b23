"""Exactness of remote verification against an upstream already running (vLLM, SGLang, foretell):
the text through the proxy equals the upstream's own greedy text for the same request.

Starts a proxy whose route ``remote-verify`` verifies predictions on ``--upstream`` (``"auto"``:
its start-up probe must find echo with prompt logprobs and token ids) with the embedded model's
tokenizer, then sends each case twice (JSON and stream) through it and once, without prediction
and speculation, straight to the upstream. The upstream must serve the embedded model's folder
under the name given by ``--model`` (vLLM: ``--served-model-name remote-verify``). Cases: an
edited prediction, a stop string and ``max_tokens`` inside an accepted draft, a useless
prediction, a prompt ending in a space (output that does not re-tokenise as written), unicode,
prompt lookup alone.

The test suite runs the same promises against a second ``foretell serve`` in CI
(``tests/proxy/server/test_remote_verify.py``); this script is for upstreams CI cannot start.

    python benchmarks/remote_verify_check.py --upstream http://127.0.0.1:8000 [--model remote-verify]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from remote_verify_benchmark import free_port, log, start, wait_healthy  # noqa: E402

PROMPT = "Here is a list of the planets of the solar system, one per line, with a short fact about each:\n"


def upstream_text(url: str, model: str, body: dict) -> tuple[str, str]:
    plain = {k: v for k, v in body.items() if k not in ("prediction", "speculation")}
    answer = httpx.post(url, json={**plain, "model": model}, timeout=600)
    answer.raise_for_status()
    choice = answer.json()["choices"][0]
    return choice["text"], choice["finish_reason"]


def proxy_text(url: str, model: str, body: dict, stream: bool) -> tuple[str, str, dict]:
    body = {**body, "model": model}
    if not stream:
        answer = httpx.post(url, json=body, timeout=600)
        answer.raise_for_status()
        payload = answer.json()
        return payload["choices"][0]["text"], payload["choices"][0]["finish_reason"], payload["speculation"]
    text, finish, report = "", None, {}
    with httpx.stream("POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                      timeout=600) as answer:
        answer.raise_for_status()
        for line in answer.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            if "error" in event:
                raise SystemExit(f"the stream ended with an error: {event}")
            if event.get("choices"):
                text += event["choices"][0]["text"]
                finish = event["choices"][0]["finish_reason"] or finish
            else:
                report = event.get("speculation", {})
    return text, finish, report


def probe_found(log_path: Path, timeout: float = 90) -> None:
    """Wait for the proxy's start-up probe of the upstream; exit unless it turned verification on."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = log_path.read_text()
        if "remote verification on" in text:
            return
        if "remote verification off" in text:
            raise SystemExit("the probe found no usable echo on the upstream:\n" + text[-2000:])
        time.sleep(0.5)
    raise SystemExit("the proxy's probe of the upstream did not finish")


def cases(reference: str) -> dict[str, dict]:
    words = reference.split(" ")
    edited = " ".join(words[:5] + ["inserted"] + words[5:20] + words[22:])
    base = {"prompt": PROMPT, "max_tokens": 80, "temperature": 0}
    whole = {"type": "content", "content": reference}
    return {
        "edited prediction": {**base, "prediction": {"type": "content", "content": edited}},
        "stop inside a draft": {**base, "stop": [" " + words[12]], "prediction": whole},
        "max_tokens inside a draft": {**base, "max_tokens": 23, "prediction": whole},
        "useless prediction": {**base, "max_tokens": 24,
                               "prediction": {"type": "content", "content": "def f():\n    pass\n" * 4}},
        "prompt ends in a space": {"prompt": "The three primary colours are ", "max_tokens": 40, "temperature": 0,
                                   "prediction": {"type": "content", "content": "red, green and blue."}},
        "unicode": {"prompt": "Traduis en français : « Le café est très chaud » ->", "max_tokens": 40,
                    "temperature": 0,
                    "prediction": {"type": "content", "content": " « The coffee is très chaud » — ☕ café"}},
        "prompt lookup": {"prompt": PROMPT + reference + "\n\n" + PROMPT, "max_tokens": 60, "temperature": 0,
                          "speculation": {"prompt_lookup": True}},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", required=True, metavar="URL", help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default="remote-verify", help="the name the upstream serves the model under")
    args = parser.parse_args()
    upstream = args.upstream.rstrip("/").removesuffix("/v1")
    work = Path(tempfile.mkdtemp(prefix="foretell-remote-check-"))
    (work / "proxy.toml").write_text(f"""
[upstreams.checked]
base_url = "{upstream}/v1"
verify_predictions = "auto"
tokenizer = "gemma-3-270m"
verify_always = true
timeout_seconds = 600

[models.{json.dumps(args.model)}]
upstream = "checked"
""")
    port = free_port()
    log(f"starting the proxy (log in {work})")
    process = start(port, work / "proxy.log", "--config", str(work / "proxy.toml"), "--served-model-name",
                    "proxy-local", "--no-calibrate")
    try:
        proxy = f"http://127.0.0.1:{port}"
        wait_healthy(proxy, process, work / "proxy.log")
        probe_found(work / "proxy.log")
        direct, through = upstream + "/v1/completions", proxy + "/v1/completions"
        reference, _ = upstream_text(direct, args.model, {"prompt": PROMPT, "max_tokens": 80, "temperature": 0})
        differences = 0
        for name, body in cases(reference).items():
            expected = upstream_text(direct, args.model, body)
            for stream in (False, True):
                text, finish, report = proxy_text(through, args.model, body, stream)
                same = (text, finish) == expected
                differences += not same
                verification = report.get("remote_verification") or {}
                accepted, requests = report.get("accepted_tokens"), report.get("upstream_requests")
                print(f"{name:26s} {'stream' if stream else 'json':6s} {'same' if same else 'DIFFERS':7s} "
                      f"accepted {accepted!s:>3s}  requests {requests!s:>2s}"
                      f"  prompts {verification.get('prompts')}  fallback {verification.get('fallback')}")
        print(f"\n{differences} of {2 * len(cases(reference))} answers differ from the upstream's own")
        return 1 if differences else 0
    finally:
        process.terminate()
        process.wait(timeout=20)


if __name__ == "__main__":
    sys.exit(main())
