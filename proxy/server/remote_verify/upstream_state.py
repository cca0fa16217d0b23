"""What remote verification knows of each upstream, and how it talks to one: the route's
tokenizer, what the upstream was found to accept (token ids in answers and in prompts), its
measured costs, the start-up probe of an ``"auto"`` upstream, and JSON requests with their
failures as ``RemoteFailure``."""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from collections import deque
from pathlib import Path

import httpx

from foretell.proxy.engine.draft_length import OnlinePassCost, PassCostModel
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.redact import Redactor
from foretell.proxy.server.remote_verify.echo_protocol import RemoteFailure, parse_echo

log = logging.getLogger("foretell.server")

# Until both costs are measured, verify-vs-plain assumes an echo request costs as much as this
# many plain tokens plus one per PREFILL_RATIO prompt tokens (prefill is that much cheaper).
PRIOR_VERIFY_FIXED_TOKENS = 2.0
PRIOR_PREFILL_RATIO = 15.0
# How long "auto" keeps trying to reach an upstream at start-up.
PROBE_SECONDS = 60.0
PROBE_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"


def load_tokenizer(spec: str):
    """A route's tokenizer: a Hugging Face folder, a .gguf file, or ``gemma-3-270m``.
    Returns (tokenizer, EOS ids)."""
    from transformers import AutoTokenizer

    from foretell.proxy.engine.model_loader import EMBEDDED_MODEL_NAME, resolve_model_folder, shared_tokenizer

    path = Path(spec).expanduser()
    folder = None
    if spec == EMBEDDED_MODEL_NAME:
        folder = resolve_model_folder(None)[1]
        tokenizer = shared_tokenizer(folder)
    elif path.is_file() and path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    elif path.is_dir():
        folder = path
        tokenizer = shared_tokenizer(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec)  # a hub name, from the local cache
    eos = {tokenizer.eos_token_id}
    config = folder / "generation_config.json" if folder is not None else None
    if config is not None and config.is_file():
        named = json.loads(config.read_text()).get("eos_token_id")
        eos |= set(named if isinstance(named, list) else [named])
    return tokenizer, frozenset(e for e in eos if isinstance(e, int))


class UpstreamState:
    """One upstream as remote verification has found it (shared by all its requests)."""

    def __init__(self, upstream):
        self.upstream = upstream
        self.enabled = upstream.verify_predictions == "echo"  # "auto": once the probe says so
        self.token_ids: bool | None = None  # answers return_tokens_as_token_ids (None: not seen yet)
        self.id_prompts: bool | None = None  # takes prompts of token ids (False: refused one)
        self.tokenizer = None
        self.eos_ids: frozenset[int] = frozenset()
        self.loading: asyncio.Task | None = None
        # Measured costs: an echo request's seconds by its new prompt tokens (those the upstream
        # did not say it reused); a plain token's seconds.
        self.verify_cost = OnlinePassCost(PassCostModel(fixed=PRIOR_VERIFY_FIXED_TOKENS, per_position=1 / PRIOR_PREFILL_RATIO))
        self.verify_measured = False
        # The last echo answer reported reused prompt tokens: an upstream that caches prompt
        # logprobs (foretell does; vLLM recomputes them) charges a verify for its new tokens only.
        self.reuses_prompts = False
        self.plain_token_seconds: deque = deque(maxlen=64)

    def costs(self) -> tuple[PassCostModel, float] | None:
        """(echo request seconds by prompt tokens, seconds per plain token), once both are known."""
        if not self.verify_measured or len(self.plain_token_seconds) < 2:
            return None
        return self.verify_cost.model, statistics.median(self.plain_token_seconds)

    def observe_verify(self, new_prompt_tokens: int, cached_tokens: int, seconds: float) -> None:
        self.verify_cost.observe(new_prompt_tokens, seconds)
        self.verify_measured = True
        self.reuses_prompts = cached_tokens > 0

    async def load_tokenizer(self) -> None:
        """The route's tokenizer, loaded in a worker thread; the route works without it."""
        try:
            self.tokenizer, self.eos_ids = await asyncio.to_thread(load_tokenizer, self.upstream.tokenizer)
        except Exception as error:  # text alignment, and chat requests forwarded
            log.warning("upstream %r: tokenizer %r did not load (%s: %s); remote verification aligns on "
                        "text and forwards chat requests", self.upstream.name, self.upstream.tokenizer,
                        type(error).__name__, error)


class UpstreamClient:
    """Requests to upstreams through the server's forwarder, failures as ``RemoteFailure`` with
    every route's key redacted."""

    def __init__(self, forwarder, routes):
        self.forwarder, self.routes = forwarder, routes
        self.redactor = Redactor(routes.keys())

    async def post_json(self, upstream, path: str, body: dict) -> dict:
        try:
            response = await self.forwarder.open(upstream, path, body)
        except APIError as error:
            raise RemoteFailure(self.redactor.text(error.message)) from None
        try:
            raw = await response.aread()
        except httpx.HTTPError as error:
            raise RemoteFailure(f"the upstream broke off its answer: {type(error).__name__}") from None
        finally:
            await response.aclose()
        if response.status_code >= 400:
            raise self.refusal(response.status_code, raw)
        try:
            payload = json.loads(raw)
        except ValueError:
            raise RemoteFailure("the upstream's answer is not JSON") from None
        if not isinstance(payload, dict):
            raise RemoteFailure("the upstream's answer is not a JSON object")
        return payload

    async def open_stream(self, upstream, path: str, body: dict) -> httpx.Response:
        """A streamed answer, its status already checked (the caller closes it)."""
        try:
            response = await self.forwarder.open(upstream, path, body)
        except APIError as error:
            raise RemoteFailure(self.redactor.text(error.message)) from None
        if response.status_code >= 400:
            try:
                raw = await response.aread()
            finally:
                await response.aclose()
            raise self.refusal(response.status_code, raw)
        return response

    def refusal(self, status: int, raw: bytes) -> RemoteFailure:
        detail = self.redactor.bytes(raw)[:300].decode("utf-8", "replace")  # redacted whole, then cut
        return RemoteFailure(f"the upstream answered {status}: {detail}", status=status)

    async def probe(self, state: UpstreamState) -> None:
        """Turn remote verification on for an ``"auto"`` upstream once it answers an echo request
        with prompt logprobs (retrying for PROBE_SECONDS while it cannot be reached)."""
        upstream = state.upstream
        deadline = time.monotonic() + PROBE_SECONDS
        while True:
            try:
                model = await self._probe_model(upstream)
                body = {"model": model, "prompt": PROBE_PROMPT, "echo": True, "logprobs": 1, "max_tokens": 1,
                        "temperature": 0, "return_tokens_as_token_ids": True}
                answer = parse_echo(await self.post_json(upstream, "/completions", body), PROBE_PROMPT)
                if answer.prompt_tokens < 2 or all(b is None for b in answer.best[1:answer.prompt_tokens]):
                    raise RemoteFailure("the echo answer has no top_logprobs for the prompt", unsupported=True)
            except RemoteFailure as failure:
                if not failure.unsupported and time.monotonic() < deadline:
                    await asyncio.sleep(2.0)
                    continue
                log.warning("upstream %r: remote verification off (probe: %s)", upstream.name, failure)
                return
            state.enabled, state.token_ids = True, answer.ids
            log.info("upstream %r: remote verification on (probe of model %r: echo with prompt logprobs; "
                     "token ids: %s; local tokenizer: %s)", upstream.name, model,
                     "yes" if answer.ids else "no, aligning on text", upstream.tokenizer or "none")
            return

    async def _probe_model(self, upstream) -> str:
        for model, route in self.routes.models.items():
            if route.upstream == upstream.name:
                return model
        url = upstream.base_url.rstrip("/") + "/models"
        headers = {"authorization": f"Bearer {upstream.key()}"} if upstream.key() else {}
        try:
            response = await self.forwarder.client.get(url, headers=headers, timeout=upstream.connect_timeout_seconds)
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
            raise RemoteFailure(f"GET /models failed: {type(error).__name__}") from None
