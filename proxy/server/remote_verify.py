"""Remote verification: predicted outputs for any vLLM-style upstream, through prompt logprobs.

vLLM (and SGLang) drop OpenAI's ``prediction``, but their ``/v1/completions`` can verify a whole
draft in one request: with ``echo: true, logprobs: 1, max_tokens: 1`` the answer holds, for every
prompt token, the token itself and the model's best alternative at that position. Send
``prompt + output so far + draft`` as the prompt and the best token at each draft position is
exactly what greedy decoding would choose there: the longest prefix of the draft that agrees is
accepted, the best token at the first disagreement is the *recovered* token, and the one token
generated after a fully accepted draft is the *bonus*. One prefill verifies hundreds of tokens.

A request's speculation is the engine's own (``engine/speculation.py``: the draft sources and
their estimates, the output with its stops and ``max_tokens``, the statistics, the prediction's
usage) and a draft's length is weighed by the engine's policy (``draft_length.choose_drafts``)
against this upstream's costs; this module holds the remote protocol and its own session loop
around it (which still picks its source in a fixed order, below, and reads some of the
speculation's internals: issue 29). A finished request's figures go to its access line and to
the metrics under the upstream's name, as a local one's do. ``Session`` runs it for
a greedy request (explicit ``temperature: 0``) with a prediction or with
``speculation.prompt_lookup``, on an upstream whose ``verify_predictions`` is on:

- **verify**: one echo request over ``prompt + output + draft`` (the prediction first, then
  prompt lookup, only runs of at least ``LOOKUP_MIN_DRAFT`` tokens); what agreed is accepted
  with the recovered or bonus token (``Speculation.accept``);
- **plain**: where no draft is available (after an edit's seam), a plain greedy stream continues
  the output (a round with no draft: ``accept(0, tokens)``) and is closed as soon as the output
  rejoins the prediction, then verify again;
- **when**: the request's first prediction draft is always verified (the prediction is presumed
  right where the output starts, so one echo request at most is risked); after that a verify is
  sent only while its expected yield beats plain decoding for the time it costs; both costs are
  measured per upstream (an echo request's time by its prompt tokens, a plain token's time in
  plain streams), so a GPU upstream, where prefill is cheap, keeps verifying, and a slow-prefill
  upstream decodes plainly until a copy has proven itself;
- text goes to the client as it is confirmed, never past a stop string (``Output.release``).

**Token alignment.** *Token ids* (exact): when the route names a local ``tokenizer`` matching the
upstream's model and the upstream answers vLLM's ``return_tokens_as_token_ids``, every request
sends its prompt as token ids (OpenAI's legacy API takes them; vLLM, SGLang and foretell do):
the prompt's ids, then the very ids the upstream chose, then the draft's ids; the echo's ids
must be exactly those sent. Nothing is re-tokenised, so the context is the upstream's own
decoding whatever token sequence the model wrote. An upstream that refuses its first prompt of
token ids (a 4xx) gets text prompts from then on: the local tokenizer must then re-tokenise
``prompt + output`` into exactly the prompt's ids plus the ids chosen, and where it does not
(the model wrote a token sequence that is not how its tokenizer splits the same text; rare for
real models, but a seam merging two tokens does it) the rest of the request continues as plain
greedy decoding from the last point known to be exact, replaying what was already sent. *Text*
(best effort): without a tokenizer or token ids, the echo's token strings are laid over the
text sent (their ``text_offset`` must agree, up to one constant shift such as a ``<bos>`` the
upstream counts) and compared as strings, so a rare re-tokenisation difference can go unseen.

**Failures.** A malformed echo answer, a 5xx or a dropped connection never produce text: the
request continues as plain decoding from the last exact point (the upstream's own greedy text);
if that fails too, the client gets the error (a 502, or an error event in a stream).

Sampling, ``n > 1``, logprobs, echo and any other field that changes decoding are forwarded as
before; ``prediction`` goes natively to upstreams marked ``supports_prediction``.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
import re
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

from foretell.proxy.engine.draft_length import DraftOption, OnlinePassCost, PassCostModel, choose_drafts
from foretell.proxy.engine.draft_sources import PredictionSource, TextPieces
from foretell.proxy.engine.speculation import Output, Speculation, draft_sources
from foretell.proxy.prediction_usage import count_away
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.logs import note_result
from foretell.proxy.server.prompts import chat_prompt, end_of_turn_ids
from foretell.proxy.server.redact import Redactor
from foretell.proxy.server.responses import ClientGone, Shape, client_gone, engine_usage, stream_response
from foretell.proxy.server.schema import ChatCompletionRequest

log = logging.getLogger("foretell.server")

# Tokens drafted per verify at most (the request's speculation.max_draft lowers it). A longer
# draft costs the upstream only prefill, and each round trip re-sends the context anyway.
DEFAULT_MAX_DRAFT = 256
# Prompt lookup drafts only runs at least this long: each verify re-sends the whole context.
LOOKUP_MIN_DRAFT = 8
# The prediction's acceptance starts higher than the engine's prior: it is presumed right where the
# output starts, and its first verify is sent anyway (one echo request at most is risked).
PRIOR_ACCEPTED = {"prediction": 9.0}
# A mismatch this close to the end of the context is the draft merging with it (a token that
# spans the seam), not a context that re-tokenises differently.
BOUNDARY_TOKENS = 3
# Plain tokens before a rejoin may end a plain stream; doubled after each useless verify.
MAX_MIN_PLAIN = 64
# Until both costs are measured, verify-vs-plain assumes an echo request costs as much as this
# many plain tokens plus one per PREFILL_RATIO prompt tokens (prefill is that much cheaper).
PRIOR_VERIFY_FIXED_TOKENS = 2.0
PRIOR_PREFILL_RATIO = 15.0
# Upstream failures one request survives (each one continues plainly from the last exact point).
MAX_FAILURES = 2
# How long "auto" keeps trying to reach an upstream at start-up.
PROBE_SECONDS = 60.0
PROBE_PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox"

TOKEN_ID = re.compile(r"token_id:(\d+)")
# Token strings that may be a special token (EOS, BOS, end of turn): never emitted as text.
SPECIAL_LOOKING = re.compile(r"<[^<>\s]{1,40}>|<\|[^|\s]{1,40}\|>")
# Request fields the loop reproduces; anything else set (penalties, logit_bias, tools, ...)
# changes decoding, so such a request is forwarded as before.
HANDLED_FIELDS = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens",
                            "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                            "stream_options", "user", "prediction", "speculation", "add_special_tokens"})


class RemoteFailure(Exception):
    """The upstream failed or answered something the loop cannot trust."""

    def __init__(self, message: str, *, unsupported: bool = False, status: int | None = None):
        super().__init__(message)
        self.unsupported = unsupported  # the upstream does not do echo with prompt logprobs
        self.status = status  # the upstream's HTTP status, when it answered one
        self.id_prompts_refused = False  # the request may go on with text prompts


# ---- tokenizers -------------------------------------------------------------------------------

def load_tokenizer(spec: str):
    """A route's tokenizer: a Hugging Face folder, a .gguf file, or ``gemma-3-270m``.
    Returns (tokenizer, EOS ids)."""
    from transformers import AutoTokenizer

    from foretell.proxy.engine.model_loader import EMBEDDED_MODEL_NAME, resolve_model_folder

    path = Path(spec).expanduser()
    folder = None
    if spec == EMBEDDED_MODEL_NAME:
        folder = resolve_model_folder(None)[1]
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    elif path.is_file() and path.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    elif path.is_dir():
        folder = path
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        tokenizer = AutoTokenizer.from_pretrained(spec)  # a hub name, from the local cache
    eos = {tokenizer.eos_token_id}
    config = folder / "generation_config.json" if folder is not None else None
    if config is not None and config.is_file():
        named = json.loads(config.read_text()).get("eos_token_id")
        eos |= set(named if isinstance(named, list) else [named])
    return tokenizer, frozenset(e for e in eos if isinstance(e, int))


# ---- the echo answer --------------------------------------------------------------------------

def _trusted(text) -> bool:
    """A token string that is plain text (never a possible special token or a broken byte)."""
    return isinstance(text, str) and bool(text) and "\ufffd" not in text and not SPECIAL_LOOKING.fullmatch(text)


@dataclass
class EchoAnswer:
    ids: bool  # tokens came as "token_id:<id>"
    keys: list  # every token of the answer (ids, or strings); the prompt's first
    strings: list[str]  # the raw token strings
    best: list  # per token: the most likely key at that position (None where absent)
    starts: list  # text mode: each prompt token's start in the text sent (None: not laid)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the upstream says it reused (its prefix cache)
    completion_tokens: int
    generated: object  # the generated token's key, or None
    generated_text: str
    finish_reason: str | None


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_echo(payload, sent: str | list[int]) -> EchoAnswer:
    """Check and unpack an echo answer to the prompt ``sent`` (text, or token ids: then the
    caller checks the echoed ids); RemoteFailure when it is not one we can trust."""
    try:
        choice = payload["choices"][0]
        logprobs = choice["logprobs"]
        tokens, tops = logprobs["tokens"], logprobs["top_logprobs"]
        prompt_tokens = payload["usage"]["prompt_tokens"]
        completion_tokens = payload["usage"].get("completion_tokens", 1)
        text, finish = choice["text"], choice.get("finish_reason")
    except (KeyError, IndexError, TypeError):
        raise RemoteFailure("the echo answer has no prompt logprobs", unsupported=True) from None
    if not (isinstance(tokens, list) and isinstance(tops, list) and len(tokens) == len(tops)
            and all(isinstance(t, str) for t in tokens) and isinstance(text, str)
            and isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool)):
        raise RemoteFailure("the echo answer's logprobs are malformed", unsupported=True)
    if not 1 <= prompt_tokens <= len(tokens) <= prompt_tokens + 1:
        raise RemoteFailure(f"the echo answer covers {len(tokens)} tokens for {prompt_tokens} prompt tokens",
                            unsupported=True)
    if isinstance(sent, str) and not text.startswith(sent):
        raise RemoteFailure("the echo answer's text does not start with the prompt sent", unsupported=True)
    ids = all(TOKEN_ID.fullmatch(t) for t in tokens)
    keys = [int(t[len("token_id:"):]) for t in tokens] if ids else list(tokens)
    best = []
    for top in tops:
        if not isinstance(top, dict) or not top:
            best.append(None)  # absent (the first token has none); fatal only where it is needed
            continue
        if not all(isinstance(k, str) and _number(v) for k, v in top.items()):
            raise RemoteFailure("the echo answer's top_logprobs are malformed")
        key = max(top, key=top.get)  # the first of equal values, in the order given
        if ids:
            if not TOKEN_ID.fullmatch(key):
                raise RemoteFailure("the echo answer mixes token ids and token strings")
            key = int(key[len("token_id:"):])
        best.append(key)
    starts: list = []
    if not ids and isinstance(sent, str):
        starts = _lay_tokens(tokens[:prompt_tokens], sent)
        offsets = logprobs.get("text_offset")
        if offsets is not None:
            if not (isinstance(offsets, list) and len(offsets) == len(tokens) and all(_number(o) for o in offsets)):
                raise RemoteFailure("the echo answer's text_offset is malformed")
            shifts = {offsets[j] - start for j, start in enumerate(starts)
                      if start is not None and tokens[j] and not (start == 0 and SPECIAL_LOOKING.fullmatch(tokens[j]))}
            if len(shifts) > 1:
                raise RemoteFailure("the echo answer's text_offset disagrees with its tokens")
    generated = keys[prompt_tokens] if len(tokens) > prompt_tokens else None
    if not isinstance(completion_tokens, int):
        completion_tokens = 1
    details = payload["usage"].get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached <= prompt_tokens else 0
    # A prompt of token ids echoes as the upstream decodes it: the generated text is not split off.
    generated_text = text[len(sent):] if isinstance(sent, str) else ""
    return EchoAnswer(ids, keys, list(tokens), best, starts, prompt_tokens, cached, completion_tokens,
                      generated, generated_text, finish)


def _lay_tokens(strings: list[str], text: str) -> list:
    """Each token string's start in ``text``, laid end to end (a special token at the very start,
    such as ``<bos>``, spans nothing); None from the first one that does not fit."""
    starts, position, broken = [], 0, False
    for string in strings:
        if broken:
            starts.append(None)
        elif text.startswith(string, position):
            starts.append(position)
            position += len(string)
        elif position == 0 and SPECIAL_LOOKING.fullmatch(string):
            starts.append(0)
        else:
            broken = True
            starts.append(None)
    return starts


# ---- per upstream -----------------------------------------------------------------------------------

class UpstreamState:
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


class RemoteVerifier:
    """Remote verification for every upstream that has it on; see the module's docstring."""

    def __init__(self, settings, forwarder, metrics=None):
        """``metrics``: the server's ``Metrics``, where each finished request's figures are
        counted under its upstream's name (a bounded label: the caller's model names are not)."""
        self.settings, self.forwarder, self.metrics = settings, forwarder, metrics
        self.states = {name: UpstreamState(upstream) for name, upstream in settings.routes.upstreams.items()
                       if upstream.verify_predictions != "off"}
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Load the routes' tokenizers and probe the "auto" upstreams, in the background."""
        for state in self.states.values():
            if state.upstream.tokenizer:
                state.loading = asyncio.create_task(self._load(state))
            if state.upstream.verify_predictions == "auto":
                self.tasks.append(asyncio.create_task(self._probe(state)))

    async def close(self) -> None:
        for task in self.tasks + [s.loading for s in self.states.values() if s.loading]:
            task.cancel()

    async def _load(self, state: UpstreamState) -> None:
        try:
            state.tokenizer, state.eos_ids = await asyncio.to_thread(load_tokenizer, state.upstream.tokenizer)
        except Exception as error:  # the route works without it: text alignment, no chat
            log.warning("upstream %r: tokenizer %r did not load (%s: %s); remote verification aligns on "
                        "text and forwards chat requests", state.upstream.name, state.upstream.tokenizer,
                        type(error).__name__, error)

    async def _probe(self, state: UpstreamState) -> None:
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
        for model, route in self.settings.routes.models.items():
            if route.upstream == upstream.name:
                return model
        url = upstream.base_url.rstrip("/") + "/models"
        headers = {"authorization": f"Bearer {upstream.key()}"} if upstream.key() else {}
        try:
            response = await self.forwarder.client.get(url, headers=headers, timeout=upstream.connect_timeout_seconds)
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as error:
            raise RemoteFailure(f"GET /models failed: {type(error).__name__}") from None

    async def post_json(self, upstream, path: str, body: dict) -> dict:
        redactor = Redactor(self.settings.routes.keys())
        try:
            response = await self.forwarder.open(upstream, path, body)
        except APIError as error:
            raise RemoteFailure(redactor.text(error.message)) from None
        try:
            raw = await response.aread()
        except httpx.HTTPError as error:
            raise RemoteFailure(f"the upstream broke off its answer: {type(error).__name__}") from None
        finally:
            await response.aclose()
        if response.status_code >= 400:
            detail = redactor.bytes(raw[:300]).decode("utf-8", "replace")
            raise RemoteFailure(f"the upstream answered {response.status_code}: {detail}",
                                status=response.status_code)
        try:
            payload = json.loads(raw)
        except ValueError:
            raise RemoteFailure("the upstream's answer is not JSON") from None
        if not isinstance(payload, dict):
            raise RemoteFailure("the upstream's answer is not a JSON object")
        return payload

    # ---- which requests ---------------------------------------------------------------------

    def applies(self, upstream, parsed, body: dict) -> bool:
        """Does this request for ``upstream`` run the loop here (else it is forwarded)? A
        prediction over the server's limit never gets here: ``request_builder.plan`` refuses it
        (413) on every route."""
        state = self.states.get(upstream.name)
        if state is None or not state.enabled or upstream.supports_prediction:
            return False  # off, not (yet) found to work, or the upstream takes `prediction` itself
        if body.get("temperature") != 0 or parsed.n != 1:
            return False  # greedy only, by explicit temperature 0 (an upstream's default may differ)
        speculation = parsed.speculation
        if parsed.prediction is None and not (speculation and speculation.prompt_lookup):
            return False
        if any(value not in (None, False) for key, value in body.items() if key not in HANDLED_FIELDS):
            return False  # logprobs, echo, penalties, tools...: forwarded as before
        if isinstance(parsed, ChatCompletionRequest) and not upstream.tokenizer:
            return False  # a chat prompt needs the model's template
        if not isinstance(parsed, ChatCompletionRequest) and not isinstance(parsed.prompt, str):
            return False  # a prompt of token ids: forwarded as sent
        return True

    # ---- one request ------------------------------------------------------------------------------

    async def run(self, request: Request, upstream, parsed, plan, body: dict, forward):
        """Answer the request with the loop; ``forward()`` answers it as before. ``plan`` is the
        request's ``RequestPlan``: its length, prediction, stops and speculation, defaults filled in."""
        state = self.states[upstream.name]
        if state.loading is not None:
            await asyncio.shield(state.loading)
        tokenizer = state.tokenizer
        if plan.is_chat:
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                return await forward()
            prompt = await asyncio.to_thread(chat_prompt, tokenizer, parsed.messages)
            # The template's end-of-turn tokens end a chat answer as EOS does (as locally).
            eos_ids = state.eos_ids | frozenset(await asyncio.to_thread(end_of_turn_ids, tokenizer))
            # The template writes the BOS itself (vLLM's chat endpoint adds no special tokens).
            special = False
        else:
            prompt = parsed.prompt
            special = body.get("add_special_tokens")
            if not isinstance(special, bool):
                special = None
            eos_ids = state.eos_ids
        lookup = plan.prompt_lookup if plan.prompt_lookup is not None else plan.prediction is not None
        request_id = request.scope.get("foretell.request_id", "-")
        last_check = [0.0]

        async def gone() -> bool:
            if time.monotonic() - last_check[0] < 0.25:
                return False
            last_check[0] = time.monotonic()
            return await request.is_disconnected()

        session = Session(self, state, parsed.model, prompt, special, plan.max_tokens, plan.stop,
                          plan.prediction, lookup, plan.max_draft or DEFAULT_MAX_DRAFT, request_id, gone, eos_ids)

        async def finished() -> tuple[dict, dict]:
            """The usage and report, the request's figures given to its access line and metrics."""
            usage, report = await session.usage()
            note_result(request.scope, session.stats)
            if self.metrics is not None:
                self.metrics.record_generation(upstream.name, session.stats, session.out.finish_reason or "stop")
            return usage, report
        shape = Shape(parsed.model, plan.is_chat)
        headers = {"x-foretell-upstream": upstream.name,
                   "x-foretell-note": "prediction verified remotely (echo with prompt logprobs)"}
        if not parsed.stream:
            try:
                async for _ in session.events():
                    pass
            except ClientGone:
                return client_gone()
            usage, report = await finished()
            choice = shape.choice(0, session.out.text, session.out.finish_reason or "stop")
            return JSONResponse(shape.body([choice], usage, report), headers=headers)
        events = session.events()
        try:
            first = await anext(events, None)  # the first round: a failure here is a plain HTTP error
        except BaseException:
            await events.aclose()
            raise
        return stream_response(_chunks(shape, session, events, first, plan.include_usage, finished),
                               headers=headers)


# ---- the loop ---------------------------------------------------------------------------------

@dataclass
class Draft:
    text: str
    source: str
    ids: list[int] | None = None  # its token ids (sent as such when the upstream takes id prompts)


class Session:
    """One request's speculation (``engine/speculation.py``: sources, estimates, output, stops,
    statistics) verified by the upstream: echo requests over drafts, plain streams between."""

    def __init__(self, verifier: RemoteVerifier, state: UpstreamState, model: str, prompt: str,
                 special: bool | None, max_tokens: int, stop: tuple[str, ...], prediction: str | None,
                 lookup: bool, max_draft: int, request_id: str, gone, eos_ids: frozenset[int]):
        self.verifier, self.state, self.upstream = verifier, state, state.upstream
        self.model, self.prompt, self.special = model, prompt, special
        self.max_tokens = max_tokens
        self.request_id, self.gone = request_id, gone
        self.tokenizer = state.tokenizer
        # Token ids when a local tokenizer can read them and the upstream has not been seen
        # ignoring return_tokens_as_token_ids.
        self.ids = self.tokenizer is not None and state.token_ids is not False
        # ...and then prompts as token ids (the context exactly as decoded, never re-tokenised),
        # unless the upstream has refused them.
        self.id_prompts = self.ids and state.id_prompts is not False
        # Prompt lookup starts once the prompt's keys are known (text alignment: from the first answer).
        self.want_lookup = lookup
        sources = draft_sources(self.tokenizer or TextPieces(), None, prediction, False)
        output = Output(self.tokenizer if self.ids else None, stop, max_tokens, eos_ids)
        self.spec = Speculation(output, sources, max_draft, prior_accepted=PRIOR_ACCEPTED)
        self.out, self.stats = self.spec.output, self.spec.stats
        self.prompt_keys: list | None = None
        self.requests = 0
        self.prompt_tokens_sent = 0
        self.checkpoint = (0, 0)  # (tokens, characters) of output whose context is known exact
        self.shared_with_last_verify = 0  # context tokens the last echo request already held
        self.verifying = True  # False once the rest is plain decoding
        self.failures = 0
        self.fallback: str | None = None  # why verification stopped, for the report
        self.min_plain = 1
        self.started = time.perf_counter()

    @property
    def prediction(self) -> PredictionSource | None:
        return self.spec.source("prediction")

    # ---- helpers ----------------------------------------------------------------------------

    def _encode(self, text: str) -> list[int]:
        special = True if self.special is None else self.special
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def _decode_after(self, context: list, ids: list) -> str | None:
        head = self.tokenizer.decode(context, skip_special_tokens=True)
        full = self.tokenizer.decode(list(context) + list(ids), skip_special_tokens=True)
        return full[len(head):] if full.startswith(head) else None

    def _start_lookup(self) -> None:
        if self.want_lookup and self.prompt_keys is not None:
            self.spec.start_lookup(self.prompt_keys)

    def _propose(self) -> Draft | None:
        """The draft to verify now, or None: no source has one, or none is worth its round trip.
        The prediction first, then prompt lookup; its length by ``_worth``. Turning the chosen
        tokens into what is sent (token ids, or text) is this module's alignment."""
        limit = min(self.spec.max_draft, self.spec.room - 1)
        if limit < 1:
            return None
        options = {option.source: option for option in self.spec.draft_options(limit)}
        source = self.prediction
        if source is not None and source.cursor is not None and source.cursor < len(source.text):
            starts = source.token_starts
            pieces = source.scores_on_text
            # Pieces are not tokens: count by the characters per token of this output.
            per_token = (len(self.out.raw) / len(self.out.keys) if self.out.raw else 4.0) if pieces else None
            index = bisect.bisect_left(starts, source.cursor)
            # Inside a token (an edit's seam) the piece up to the next token start is one more.
            head = 0 if index < len(starts) and starts[index] == source.cursor else 1
            if pieces:
                available = min(limit, max(1, round((len(source.text) - source.cursor) / per_token)))
            else:
                available = min(limit, len(starts) - index + head)
            length, expected = self._worth("prediction", available, options["prediction"].run)
            if length:
                if pieces:
                    index = bisect.bisect_left(starts, source.cursor + int(length * per_token) + 1)
                    end = starts[index] if index < len(starts) else len(source.text)
                else:
                    stop = index + length - head
                    end = starts[stop] if stop < len(starts) else len(source.text)
                if end > source.cursor:
                    self.spec.set_draft("prediction", length, expected)
                    return Draft(source.text[source.cursor:end], "prediction",
                                 list(self.spec.draft) if self.id_prompts else None)
        if "prompt_lookup" in options:
            proposal = self.spec.proposals["prompt_lookup"]
            length, expected = (self._worth("prompt_lookup", len(proposal), None)
                                if len(proposal) >= LOOKUP_MIN_DRAFT else (0, None))
            if length:
                proposal = proposal[:length]
                text = ""
                if self.ids and not self.id_prompts:
                    text = self._decode_after((self.prompt_keys + self.out.keys)[-BOUNDARY_TOKENS:], proposal)
                elif not self.ids:
                    text = "".join(proposal) if all(_trusted(p) for p in proposal) else None
                if text or self.id_prompts:
                    self.spec.set_draft("prompt_lookup", length, expected)
                    return Draft(text, "prompt_lookup", list(proposal) if self.id_prompts else None)
        return None

    def _worth(self, source: str, available: int, run: float | None) -> tuple[int, float | None]:
        """(the draft length whose verify yields the most tokens per second, or 0 when plain
        decoding is faster; the tokens it is expected to yield), by the engine's draft choice
        (``draft_length.choose_drafts``) against this upstream's measured costs: an echo request
        over the context and the draft, or a plain token. Before both costs are measured: all
        of it."""
        if available < 1:
            return 0, None
        costs = self.state.costs()
        if costs is None or self.upstream.verify_always or (source == "prediction" and source not in self.spec.tried):
            # Unmeasured, told to, or the request's first try of its prediction, which is
            # presumed right where the output starts: one echo request at most is risked.
            return available, None
        verify, plain = costs
        context = (len(self.prompt_keys) if self.prompt_keys is not None else len(self.prompt) // 4) + len(self.out.keys)
        if self.state.reuses_prompts:  # charged for what the last verify did not already send
            context -= min(context, self.shared_with_last_verify)
        option = DraftOption(source, self.spec.estimates[source].rate, run, available, self.spec.calibration[source])
        [(_, length)] = choose_drafts([[option]], lambda drafted: verify.at(context + drafted) if drafted else plain)
        return length, (option.expected(length) if length else None)

    async def _context_exact(self) -> bool:
        """Token ids: does ``prompt + output`` re-tokenise into the tokens actually chosen?"""
        if self.id_prompts:
            return True  # the context is sent as the very tokens chosen
        if not self.out.exact():
            return False
        if not self.ids:
            return True  # checked on each echo answer instead
        ids = await asyncio.to_thread(self._encode, self.prompt + self.out.raw)
        if ids != self.prompt_keys + self.out.keys:
            return False
        self.checkpoint = (len(self.out.keys), len(self.out.raw))
        return True

    def _check_id_prompts_refused(self, failure: RemoteFailure) -> None:
        """A 4xx to a prompt of token ids before the upstream has ever taken one: it does not take
        them. It gets text prompts from now on (re-tokenised context, checked)."""
        if not (self.id_prompts and self.state.id_prompts is not True and failure.status is not None
                and 400 <= failure.status < 500):
            return
        self.state.id_prompts = self.id_prompts = False
        failure.id_prompts_refused = True
        log.warning("upstream %r: refused a prompt of token ids (%s); remote verification sends it text "
                    "prompts", self.upstream.name, failure)

    def _fail(self, failure: RemoteFailure, what: str) -> None:
        if failure.id_prompts_refused:
            return  # not a failure: the loop goes on with text prompts
        self.failures += 1
        log.warning("%s: remote verification on upstream %r: %s failed: %s%s", self.request_id,
                    self.upstream.name, what, failure,
                    "; giving up" if self.failures > MAX_FAILURES else "; continuing with plain decoding")
        if failure.unsupported and what == "verify":
            self.state.enabled = False
            log.warning("upstream %r: remote verification off until restart: its echo answers are unusable",
                        self.upstream.name)
        self.verifying = False
        self.fallback = f"{what}: {failure}"
        if self.failures > MAX_FAILURES:
            raise APIError(502, f"upstream {self.upstream.name!r} failed: {failure}", type="upstream_error",
                           code="upstream_error")

    async def _check_client(self) -> None:
        if await self.gone():
            raise ClientGone

    # ---- the loop ----------------------------------------------------------------------------

    async def events(self):
        """Text pieces as they are confirmed; the session holds the result at the end."""
        if self.ids:
            self.prompt_keys = await asyncio.to_thread(self._encode, self.prompt)
            self._start_lookup()
        while not self.out.finished:
            await self._check_client()
            if self.verifying and not await self._context_exact():
                self.verifying = False
                self.fallback = "the output does not re-tokenise as written; plain decoding from the last exact point"
            if not self.verifying:
                try:
                    async for piece in self._plain(rejoin=False):
                        yield piece
                except RemoteFailure as failure:
                    self._fail(failure, "plain decoding")
                continue
            draft = self._propose()
            outcome = "boundary"
            if draft is not None or (not self.ids and self.prompt_keys is None):
                try:
                    outcome = await self._verify(draft)
                except RemoteFailure as failure:
                    self._fail(failure, "verify")
                    continue
                if piece := self.out.release():
                    yield piece
            if outcome == "ok" or self.out.finished:
                continue
            if outcome == "inexact":
                self.verifying = False
                self.fallback = "the context re-tokenises differently; plain decoding from the last exact point"
                continue
            try:
                async for piece in self._plain(rejoin=True):
                    yield piece
            except RemoteFailure as failure:
                self._fail(failure, "plain decoding")
        if piece := self.out.release():
            yield piece

    async def _verify(self, draft: Draft | None) -> str:
        """One echo request over ``prompt + output + draft``: "ok" (tokens accepted), "boundary"
        (nothing verifiable: decode plainly a little) or "inexact" (the context re-tokenises
        differently: the rest is plain decoding)."""
        out = self.out
        sent: str | list[int]
        if self.id_prompts:
            sent = self.prompt_keys + out.keys + (draft.ids if draft else [])
        else:
            sent = self.prompt + out.raw + (draft.text if draft else "")
        body = {"model": self.model, "prompt": sent, "echo": True, "logprobs": 1, "max_tokens": 1,
                "temperature": 0}
        if self.ids:
            body["return_tokens_as_token_ids"] = True
        if self.special is not None and not self.id_prompts:
            body["add_special_tokens"] = self.special
        self.requests += 1
        asked = time.perf_counter()
        try:
            payload = await self.verifier.post_json(self.upstream, "/completions", body)
        except RemoteFailure as failure:
            self._check_id_prompts_refused(failure)
            raise
        answer = parse_echo(payload, sent)
        self.state.verify_cost.observe(answer.prompt_tokens - answer.cached_tokens, time.perf_counter() - asked)
        self.state.verify_measured = True
        self.state.reuses_prompts = answer.cached_tokens > 0
        self.prompt_tokens_sent += answer.prompt_tokens
        self.stats.target_passes += 1
        if self.ids and not answer.ids:
            self.state.token_ids = False
            raise RemoteFailure("the upstream ignores return_tokens_as_token_ids")
        if self.ids:
            self.state.token_ids = True
        if self.id_prompts:
            if answer.keys[:answer.prompt_tokens] != sent:
                raise RemoteFailure("the echo answer's tokens are not the token ids sent")
            self.state.id_prompts = True
        keys = answer.keys[:answer.prompt_tokens]
        if self.prompt_keys is None:  # text alignment: the prompt's tokens, from this answer
            starts = answer.starts
            boundary = next((j for j, start in enumerate(starts) if start == len(self.prompt)), None)
            if boundary is None and sent == self.prompt and starts and starts[-1] is not None \
                    and starts[-1] + len(answer.strings[len(starts) - 1]) == len(sent):
                boundary = len(starts)  # nothing after the prompt: all of it
            if boundary is None or any(s is None for s in starts[:boundary]):
                return "boundary" if not out.keys else "inexact"
            self.prompt_keys = keys[:boundary]
            self._start_lookup()
        context = self.prompt_keys + out.keys
        mismatch = next((i for i in range(len(context)) if i >= len(keys) or keys[i] != context[i]), None)
        if mismatch is not None:
            if mismatch >= len(context) - BOUNDARY_TOKENS:
                self.min_plain = min(MAX_MIN_PLAIN, self.min_plain * 2)
                return "boundary"  # the draft merges with the context's last token
            if self.ids:  # the local tokenizer said this context is exact: the two disagree
                raise RemoteFailure("the upstream tokenises the context differently from the route's tokenizer")
            return "inexact"
        if not self.ids:
            self.checkpoint = (len(out.keys), len(out.raw))
        drafted = keys[len(context):]
        if (self.ids and not self.id_prompts and draft is not None
                and self._decode_after(context[-BOUNDARY_TOKENS:], drafted) != draft.text):
            raise RemoteFailure("the echo answer's tokens do not spell the draft sent")
        accepted, recovered, complete = 0, None, True
        for j in range(len(context), len(keys)):
            if not self.ids and (answer.starts[j] is None or not _trusted(answer.strings[j])):
                complete = False  # a token we cannot lay over the text: verify no further
                break
            if answer.best[j] is None:
                raise RemoteFailure("the echo answer has no top_logprobs at a draft position")
            if answer.best[j] != keys[j]:
                recovered, complete = answer.best[j], False
                break
            accepted += 1
        tail, ending = [], None
        if recovered is not None:
            if self.ids or _trusted(recovered):
                tail = [(recovered, "" if self.ids else recovered)]
        elif complete:
            tail, ending = self._bonus(answer)
        verified = [(keys[j], answer.strings[j]) for j in range(len(context), len(context) + accepted)] + tail
        if draft is None:
            self.spec.set_draft(None, 0)
        kept = self.spec.accept(accepted, [key for key, _ in verified], [text for _, text in verified],
                                drafted=len(drafted))
        if ending is not None:
            out.end(ending)
        kept_drafts = min(accepted, len(kept))
        self.shared_with_last_verify = len(context) + kept_drafts
        self.min_plain = 1 if kept_drafts >= 2 else min(MAX_MIN_PLAIN, self.min_plain * 2)
        log.debug("%s: verify %d: %d prompt tokens, drafted %d (%s), accepted %d, then %s", self.request_id,
                  self.requests, answer.prompt_tokens, len(drafted), draft.source if draft else "-", kept_drafts,
                  "a recovered token" if recovered is not None else "the bonus" if complete else "nothing")
        return "ok" if kept or out.finished else "boundary"

    def _bonus(self, answer: EchoAnswer) -> tuple[list[tuple], str | None]:
        """The token generated after a fully accepted draft as (key, text), or the end of the
        output: ([tokens], reason the output ends or None)."""
        if answer.generated is not None:
            if self.ids:
                return [(answer.generated, "")], None
            string = answer.strings[answer.prompt_tokens]
            if _trusted(string) and string == answer.generated_text:
                return [(string, string)], None
        if answer.finish_reason == "stop" and not answer.generated_text:
            # The end-of-sequence token: counted, no text (token ids: the id itself ends it).
            return ([] if self.ids else [(None, "")]), "stop"
        if answer.finish_reason == "length" and answer.completion_tokens == 0:
            return [], "length"  # no room left in the upstream's context
        return [], None

    async def _plain(self, rejoin: bool):
        """Plain greedy decoding upstream, streamed: from the output's end (``rejoin``: until the
        output rejoins the prediction), or, once verification is given up, from the last exact
        point to the end, replaying what was already sent."""
        out = self.out
        # Prompts of token ids are exact wherever the output ends: nothing to replay.
        start_tokens, start_chars = ((len(out.keys), len(out.raw)) if self.verifying or self.id_prompts
                                     else self.checkpoint)
        replay = out.keys[start_tokens:]
        prompt = (self.prompt_keys + out.keys[:start_tokens] if self.id_prompts
                  else self.prompt + out.raw[:start_chars])
        body = {"model": self.model, "prompt": prompt,
                "max_tokens": self.max_tokens - start_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, "logprobs": 0}
        if self.ids:
            body["return_tokens_as_token_ids"] = True
        if self.special is not None and not self.id_prompts:
            body["add_special_tokens"] = self.special
        redactor = Redactor(self.verifier.settings.routes.keys())
        self.requests += 1
        # Prompt tokens sent: known here (the stream's usage chunk, when read, corrects it; a
        # stream closed early never sends one).
        sent = (len(self.prompt_keys) if self.prompt_keys is not None else len(self.prompt) // 4) + start_tokens
        self.prompt_tokens_sent += sent
        try:
            response = await self.verifier.forwarder.open(self.upstream, "/completions", body)
        except APIError as error:
            raise RemoteFailure(redactor.text(error.message)) from None
        generated, replayed, counted, rejoined, upstream_done = 0, 0, False, False, False
        last_chunk = None  # when the previous tokens arrived (the first include the prefill)
        try:
            if response.status_code >= 400:
                detail = redactor.bytes(await response.aread())[:300].decode("utf-8", "replace")
                failure = RemoteFailure(f"the upstream answered {response.status_code}: {detail}",
                                        status=response.status_code)
                self._check_id_prompts_refused(failure)
                raise failure
            async for event in _sse_events(response):
                if not isinstance(event, dict) or "error" in event:
                    raise RemoteFailure("the upstream's stream carried an error: "
                                        + redactor.text(json.dumps(event)[:300]))
                usage = event.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int) and not counted:
                    self.prompt_tokens_sent += usage["prompt_tokens"] - sent
                    counted = True
                choices = event.get("choices") or []
                if not choices or upstream_done:
                    continue  # after the upstream's last token: only its usage is still read
                choice = choices[0]
                text = choice.get("text") or ""
                strings = (choice.get("logprobs") or {}).get("tokens") or []
                if text and not strings:
                    raise RemoteFailure("a stream chunk came without its tokens")
                keys = self._stream_keys(strings, text)
                now = time.perf_counter()
                if keys and last_chunk is not None and replayed >= len(replay):
                    self.state.plain_token_seconds.append((now - last_chunk) / len(keys))
                if keys:
                    last_chunk = now
                # Plain tokens are a round with no draft: every source's proposal is scored on them,
                # as the engine scores its sources every round.
                fresh = replayed >= len(replay)
                new = []
                for key, string in keys:
                    if replayed < len(replay):
                        if key != replay[replayed]:
                            raise RemoteFailure("the upstream's output differs from what it wrote before")
                        replayed += 1
                        continue
                    new.append((key, string))
                if new:
                    self.spec.draft_options(len(new) if fresh else 0)
                    generated += len(self.spec.accept(0, [key for key, _ in new], [text for _, text in new],
                                                      passes=None))
                finish = choice.get("finish_reason")
                if out.finished:
                    if finish:
                        upstream_done = True
                        continue
                    break  # a stop string or max_tokens here: the upstream would go on
                if finish and replayed >= len(replay):
                    if finish == "stop":
                        if not self.ids and (not out.keys or out.keys[-1] is not None):
                            out.push(None)  # the end-of-sequence token: counted, no text
                        out.end("stop")
                    else:
                        out.end("length")
                    upstream_done = True
                    continue
                if piece := out.release():
                    yield piece
                if rejoin and self.verifying and generated >= self.min_plain and self._propose() is not None:
                    rejoined = True
                    break  # rejoined: verify again
            else:
                if not out.finished:
                    raise RemoteFailure("the upstream's stream ended before the output did")
        except httpx.HTTPError as error:
            raise RemoteFailure(f"the upstream broke off its stream: {type(error).__name__}") from None
        finally:
            await response.aclose()
        log.debug("%s: plain %d: %d tokens (replayed %d)%s", self.request_id, self.requests, generated,
                  replayed, ", rejoined" if rejoined else "")
        if piece := out.release():
            yield piece

    def _stream_keys(self, strings: list, text: str) -> list[tuple]:
        """(key, text) per token of a plain stream chunk."""
        if self.ids:
            if not all(isinstance(s, str) and TOKEN_ID.fullmatch(s) for s in strings):
                self.state.token_ids = False
                raise RemoteFailure("the upstream ignores return_tokens_as_token_ids")
            return [(int(s[len("token_id:"):]), "") for s in strings]
        if all(isinstance(s, str) for s in strings):
            if "".join(strings) == text:
                return [(s, s) for s in strings]
            # An end-of-sequence token shown by its name beside no text: counted, no text.
            named = [bool(SPECIAL_LOOKING.fullmatch(s)) for s in strings]
            if "".join(s for s, special in zip(strings, named) if not special) == text:
                return [(None, "") if special else (s, s) for s, special in zip(strings, named)]
        # The tokens do not spell the text (a character split across tokens): the text wins,
        # and these token strings cannot be compared later: no more verification.
        self.verifying = False
        self.fallback = "token strings that do not spell the text; plain decoding"
        return [(None, text)] + [(None, "") for _ in strings[1:]]

    # ---- the result ------------------------------------------------------------------------------

    async def usage(self) -> tuple[dict, dict]:
        """(usage, speculation report) of the request, once its output is done."""
        stats = self.stats
        stats.prompt_tokens = len(self.prompt_keys) if self.prompt_keys is not None else 0
        self.spec.close(count_usage=False)
        # The prediction's usage, a diff of two texts: away from the event loop and the GIL.
        await asyncio.to_thread(self.spec.count_prediction_usage, count_away)
        stats.decode_seconds = time.perf_counter() - self.started
        report = {**stats.speculation_report(), "seed": None, "upstream_requests": self.requests,
                  "upstream_prompt_tokens": self.prompt_tokens_sent,
                  "remote_verification": {"alignment": "token_ids" if self.ids else "text",
                                          "prompts": "token_ids" if self.id_prompts else "text",
                                          "fallback": self.fallback}}
        return engine_usage(stats), report


async def _sse_events(response: httpx.Response):
    """The JSON payloads of an event stream, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise RemoteFailure("the upstream's stream holds an event that is not JSON") from None


# ---- response shapes ----------------------------------------------------------------------------

async def _chunks(shape: Shape, session: Session, events, first: str | None, include_usage: bool, finished):
    """A stream's chunks: ``first`` (the first round's text) and the session's further pieces,
    then the finish and the usage (``finished()``, which also reports the request's figures,
    whether the client asked for the usage or not). An upstream that fails mid-stream is a 502
    error event."""
    async with contextlib.aclosing(events):
        try:
            if shape.is_chat:
                yield shape.role_chunk()
            if first:
                yield shape.chunk(first)
            async for piece in events:
                if piece:
                    yield shape.chunk(piece)
        except RemoteFailure as failure:
            raise APIError(502, str(failure), type="upstream_error", code="upstream_error") from None
    yield shape.finish_chunk(session.out.finish_reason or "stop")
    usage, report = await finished()
    if include_usage:
        yield shape.usage_chunk(usage, report)
