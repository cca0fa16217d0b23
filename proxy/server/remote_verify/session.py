"""One remotely verified request: the engine's own speculation state (``engine/speculation.py``:
sources, estimates, output with its stops and ``max_tokens``, statistics, prediction usage)
driven by an upstream's answers, through its public methods. Each round either verifies a draft
with one echo request (``_verify``) or, where no draft is worth its round trip, decodes plainly
(``plain_stream.py``) until the output rejoins a draft source. The draft, its source and its
length are the engine's choice (``draft_length.choose_drafts`` over every source's offer)
against this upstream's measured costs."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from foretell.proxy.engine.draft_sources import PredictionSource, TextPieces
from foretell.proxy.engine.speculation import Output, Speculation, draft_sources
from foretell.proxy.prediction_usage import count_away
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.remote_verify import draft_choice
from foretell.proxy.server.remote_verify.alignment import BOUNDARY_TOKENS, Alignment
from foretell.proxy.server.remote_verify.echo_protocol import (
    EchoAnswer,
    RemoteFailure,
    echo_body,
    parse_echo,
    trusted,
)
from foretell.proxy.server.remote_verify.plain_stream import PlainStream
from foretell.proxy.server.responses import engine_usage

log = logging.getLogger("foretell.server")

# Tokens drafted per verify at most (the request's speculation.max_draft lowers it). A longer
# draft costs the upstream only prefill, and each round trip re-sends the context anyway.
DEFAULT_MAX_DRAFT = 256
# The prediction's acceptance starts higher than the engine's prior: it is presumed right where the
# output starts, and its first verify is sent anyway (one echo request at most is risked).
PRIOR_ACCEPTED = {"prediction": 9.0}
# Plain tokens before a rejoin may end a plain stream; doubled after each useless verify.
MAX_MIN_PLAIN = 64
# Upstream failures one request survives (each one continues plainly from the last exact point).
MAX_FAILURES = 2


@dataclass(frozen=True)
class RemoteRequest:
    """What a session generates: the request with its defaults filled in."""

    model: str
    prompt: str
    special: bool | None  # add_special_tokens as the caller set it (None: the upstream's default)
    max_tokens: int
    stop: tuple[str, ...]
    prediction: str | None
    lookup: bool
    max_draft: int = DEFAULT_MAX_DRAFT
    request_id: str = "-"
    eos_ids: frozenset = frozenset()


class Session:
    """One request verified by the upstream of ``state``, through ``client`` (``UpstreamClient``);
    ``watch`` (``ClientWatch``) raises ClientGone between rounds once the client has hung up."""

    def __init__(self, client, state, request: RemoteRequest, watch=None):
        self.client, self.state, self.upstream = client, state, state.upstream
        self.request, self.watch = request, watch
        self.align = Alignment(state, request.prompt, request.special)
        sources = draft_sources(state.tokenizer or TextPieces(), None, request.prediction, False)
        output = Output(state.tokenizer if self.align.ids else None, request.stop, request.max_tokens,
                        request.eos_ids)
        self.align.output = output
        self.spec = Speculation(output, sources, request.max_draft, prior_accepted=PRIOR_ACCEPTED)
        self.out, self.stats = self.spec.output, self.spec.stats
        self.requests = 0  # to the upstream, echo and plain
        self.prompt_tokens_sent = 0
        self.shared_with_last_verify = 0  # context tokens the last echo request already held
        self.verifying = True  # False once the rest is plain decoding
        self.failures = 0
        self.fallback: str | None = None  # why verification stopped, for the report
        self.min_plain = 1
        self.started = time.perf_counter()

    # ---- the loop ----------------------------------------------------------------------------

    async def events(self):
        """Text pieces as they are confirmed; the session holds the result at the end."""
        await self.align.learn_prompt_ids()
        self._start_lookup()
        while not self.out.finished:
            if self.watch is not None:
                await self.watch.check()
            async for piece in self._round():
                yield piece
        if piece := self.out.release():
            yield piece

    async def _round(self):
        if self.verifying and not await self.align.context_exact():
            self.stop_verifying("the output does not re-tokenise as written; plain decoding from the last exact point")
        if not self.verifying:
            async for piece in self._plain(rejoin=False):
                yield piece
            return
        draft = self.propose()
        outcome = "boundary"
        if draft is not None or (not self.align.ids and self.align.prompt_keys is None):
            try:
                outcome = await self._verify(draft)
            except RemoteFailure as failure:
                self._fail(failure, "verify")
                return
            if piece := self.out.release():
                yield piece
        if outcome == "ok" or self.out.finished:
            return
        if outcome == "inexact":
            self.stop_verifying("the context re-tokenises differently; plain decoding from the last exact point")
            return
        async for piece in self._plain(rejoin=True):
            yield piece

    async def _plain(self, rejoin: bool):
        try:
            async for piece in PlainStream(self, rejoin).pieces():
                yield piece
        except RemoteFailure as failure:
            self._fail(failure, "plain decoding")

    def stop_verifying(self, reason: str) -> None:
        self.verifying, self.fallback = False, reason

    def _start_lookup(self) -> None:
        if self.request.lookup and self.align.prompt_keys is not None:
            self.spec.start_lookup(self.align.prompt_keys)

    def _fail(self, failure: RemoteFailure, what: str) -> None:
        if failure.id_prompts_refused:
            return  # not a failure: the loop goes on with text prompts
        self.failures += 1
        log.warning("%s: remote verification on upstream %r: %s failed: %s%s", self.request.request_id,
                    self.upstream.name, what, failure,
                    "; giving up" if self.failures > MAX_FAILURES else "; continuing with plain decoding")
        if failure.unsupported and what == "verify":
            self.state.enabled = False
            log.warning("upstream %r: remote verification off until restart: its echo answers are unusable",
                        self.upstream.name)
        self.stop_verifying(f"{what}: {failure}")
        if self.failures > MAX_FAILURES:
            raise APIError(502, f"upstream {self.upstream.name!r} failed: {failure}", type="upstream_error",
                           code="upstream_error")

    # ---- the draft ----------------------------------------------------------------------------

    def propose(self):
        """The draft to verify now, or None (``draft_choice.propose``)."""
        return draft_choice.propose(self)

    @property
    def prediction(self) -> PredictionSource | None:
        return self.spec.source("prediction")

    # ---- a verify -----------------------------------------------------------------------------

    async def _verify(self, draft: draft_choice.Draft | None) -> str:
        """One echo request over ``prompt + output + draft``: "ok" (tokens accepted), "boundary"
        (nothing verifiable: decode plainly a little) or "inexact" (the context re-tokenises
        differently: the rest is plain decoding)."""
        align, out = self.align, self.out
        sent = align.echo_prompt(draft)
        answer = await self._ask(sent)
        keys = answer.keys[:answer.prompt_tokens]
        if align.prompt_keys is None:  # text alignment: the prompt's tokens, from this answer
            if not align.learn_prompt_keys(answer, sent):
                return "boundary" if not out.keys else "inexact"
            self._start_lookup()
        context = align.context()
        mismatch = next((i for i in range(len(context)) if i >= len(keys) or keys[i] != context[i]), None)
        if mismatch is not None:
            if mismatch >= len(context) - BOUNDARY_TOKENS:
                self.min_plain = min(MAX_MIN_PLAIN, self.min_plain * 2)
                return "boundary"  # the draft merges with the context's last token
            if align.ids:  # the local tokenizer said this context is exact: the two disagree
                raise RemoteFailure("the upstream tokenises the context differently from the route's tokenizer")
            return "inexact"
        if not align.ids:
            align.mark_exact()
        drafted = keys[len(context):]
        align.check_spelling(context, drafted, draft)
        accepted, tail, ending, then = self._verified_run(answer, keys, len(context))
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
        log.debug("%s: verify %d: %d prompt tokens, drafted %d (%s), accepted %d, then %s", self.request.request_id,
                  self.requests, answer.prompt_tokens, len(drafted), draft.source if draft else "-", kept_drafts, then)
        return "ok" if kept or out.finished else "boundary"

    async def _ask(self, sent: str | list[int]) -> EchoAnswer:
        """Send one echo request and check its answer (and what it says of the upstream)."""
        align, state = self.align, self.state
        body = echo_body(self.request.model, sent, token_ids=align.ids, special=align.special)
        self.requests += 1
        asked = time.perf_counter()
        try:
            payload = await self.client.post_json(self.upstream, "/completions", body)
        except RemoteFailure as failure:
            align.refuse_id_prompts(failure)
            raise
        answer = parse_echo(payload, sent)
        state.observe_verify(answer.prompt_tokens - answer.cached_tokens, answer.cached_tokens,
                             time.perf_counter() - asked)
        self.prompt_tokens_sent += answer.prompt_tokens
        if align.ids and not answer.ids:
            state.token_ids = False
            raise RemoteFailure("the upstream ignores return_tokens_as_token_ids")
        if align.ids:
            state.token_ids = True
        if align.id_prompts:
            if answer.keys[:answer.prompt_tokens] != sent:
                raise RemoteFailure("the echo answer's tokens are not the token ids sent")
            state.id_prompts = True
        return answer

    def _verified_run(self, answer: EchoAnswer, keys: list, start: int) -> tuple[int, list, str | None, str]:
        """(draft tokens the upstream agrees with from ``start``, the (key, text) that follow them,
        the reason the output ends there or None, what followed for the log)."""
        ids = self.align.ids
        accepted = 0
        for j in range(start, len(keys)):
            if not ids and (answer.starts[j] is None or not trusted(answer.strings[j])):
                return accepted, [], None, "nothing"  # a token we cannot lay over the text: no further
            if answer.best[j] is None:
                raise RemoteFailure("the echo answer has no top_logprobs at a draft position")
            if answer.best[j] != keys[j]:
                recovered = answer.best[j]
                tail = [(recovered, "" if ids else recovered)] if ids or trusted(recovered) else []
                return accepted, tail, None, "a recovered token"
            accepted += 1
        tail, ending = answer.bonus()
        return accepted, tail, ending, "the bonus"

    # ---- the result ---------------------------------------------------------------------------

    async def usage(self) -> tuple[dict, dict]:
        """(usage, speculation report) of the request, once its output is done."""
        stats = self.stats
        stats.prompt_tokens = len(self.align.prompt_keys) if self.align.prompt_keys is not None else 0
        self.spec.close(count_usage=False)
        # The prediction's usage, a diff of two texts: away from the event loop and the GIL.
        await asyncio.to_thread(self.spec.count_prediction_usage, count_away)
        stats.decode_seconds = time.perf_counter() - self.started
        report = {**stats.speculation_report(), "seed": None, "upstream_requests": self.requests,
                  "upstream_prompt_tokens": self.prompt_tokens_sent,
                  "remote_verification": {**self.align.describe(), "fallback": self.fallback}}
        return engine_usage(stats), report
