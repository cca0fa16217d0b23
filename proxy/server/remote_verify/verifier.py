"""Remote verification as the server sees it: which requests for an upstream it takes, and the
HTTP around a session (the prompt through the route's chat template, the body or the stream
through the one stream writer, the request's figures to its access line and the metrics)."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.logs import note_result
from foretell.proxy.server.prompts import chat_prompt, end_of_turn_ids
from foretell.proxy.server.remote_verify.echo_protocol import RemoteFailure
from foretell.proxy.server.remote_verify.session import DEFAULT_MAX_DRAFT, RemoteRequest, Session
from foretell.proxy.server.remote_verify.upstream_state import UpstreamClient, UpstreamState
from foretell.proxy.server.responses import ClientGone, ClientWatch, Shape, client_gone, stream_response, text_chunks
from foretell.proxy.server.schema import ChatCompletionRequest
from foretell.proxy.server.unsupported_fields import UNSUPPORTED, first_unsupported

# Request fields the loop reproduces; anything else set (logprobs, echo, ...) or a decoding field
# of ``unsupported_fields.py`` with a value that asks for something changes what the upstream
# would answer, so such a request is forwarded as before.
HANDLED_FIELDS = frozenset({"model", "prompt", "messages", "max_tokens", "max_completion_tokens",
                            "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                            "stream_options", "user", "prediction", "speculation", "add_special_tokens",
                            "response_format"})


class RemoteVerifier:
    """Remote verification for every upstream that has it on; see the package's docstring."""

    def __init__(self, settings, forwarder, metrics=None):
        """``metrics``: the server's ``Metrics``, where each finished request's figures are
        counted under its upstream's name (a bounded label: the caller's model names are not)."""
        self.settings, self.metrics = settings, metrics
        self.client = UpstreamClient(forwarder, settings.routes)
        self.states = {name: UpstreamState(upstream) for name, upstream in settings.routes.upstreams.items()
                       if upstream.verify_predictions != "off"}
        self.tasks: list[asyncio.Task] = []

    def start(self) -> None:
        """Load the routes' tokenizers and probe the "auto" upstreams, in the background."""
        for state in self.states.values():
            if state.upstream.tokenizer:
                state.loading = asyncio.create_task(state.load_tokenizer())
            if state.upstream.verify_predictions == "auto":
                self.tasks.append(asyncio.create_task(self.client.probe(state)))

    async def close(self) -> None:
        for task in self.tasks + [s.loading for s in self.states.values() if s.loading]:
            task.cancel()

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
        if parsed.response_format is not None and parsed.response_format.constrained():
            return False  # structured output: the upstream's grammar, not this loop's
        is_chat = isinstance(parsed, ChatCompletionRequest)
        # A decoding field we do not implement, set to anything but its neutral value, is the
        # upstream's to honour (the table knows 0 from unset: repetition_penalty 0 asks for
        # something); the upstream's template is unknown, so a field only a template reads counts.
        if first_unsupported(body, is_chat=is_chat, chat_template=None) is not None:
            return False
        if any(value not in (None, False) for key, value in body.items()
               if key not in HANDLED_FIELDS and key not in UNSUPPORTED):
            return False  # logprobs, echo, ...: forwarded as before
        if is_chat and not upstream.tokenizer:
            return False  # a chat prompt needs the model's template
        if not is_chat and not isinstance(parsed.prompt, str):
            return False  # a prompt of token ids: forwarded as sent
        return True

    async def run(self, request: Request, upstream, parsed, plan, body: dict, forward):
        """Answer the request with the loop; ``forward()`` answers it as before. ``plan`` is the
        request's ``RequestPlan``: its length, prediction, stops and speculation, defaults filled in."""
        state = self.states[upstream.name]
        if state.loading is not None:
            await asyncio.shield(state.loading)
        remote_request = await self._remote_request(request, state, parsed, plan, body)
        if remote_request is None:
            return await forward()
        session = Session(self.client, state, remote_request, ClientWatch(request))

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

        async def pieces():
            try:
                if first:
                    yield first, None, None
                async for piece in events:
                    yield piece, None, None
            except RemoteFailure as failure:  # mid-stream: an error event
                raise APIError(502, str(failure), type="upstream_error", code="upstream_error") from None
            finally:
                await events.aclose()

        async def ending():
            usage, report = await finished()
            return session.out.finish_reason or "stop", usage, report

        return stream_response(text_chunks(shape, pieces(), ending, plan.include_usage), headers=headers)

    async def _remote_request(self, request: Request, state: UpstreamState, parsed, plan, body: dict
                              ) -> RemoteRequest | None:
        """The request as a session runs it; None where it must be forwarded (a chat request
        whose route has no tokenizer with a chat template)."""
        tokenizer = state.tokenizer
        if plan.is_chat:
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                return None
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
        return RemoteRequest(parsed.model, prompt, special, plan.max_tokens, plan.stop, plan.prediction, lookup,
                             plan.max_draft or DEFAULT_MAX_DRAFT, request.scope.get("foretell.request_id", "-"),
                             eos_ids)
