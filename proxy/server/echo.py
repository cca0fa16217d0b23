"""OpenAI's legacy ``echo`` with prompt log-probabilities on ``/v1/completions``, vLLM's
``return_tokens_as_token_ids``, and vLLM's ``POST /tokenize`` / ``POST /detokenize``.

With ``echo: true`` the choice's text is the prompt followed by the completion; with
``logprobs: N`` as well, the legacy logprobs object covers the prompt's tokens first (the first
one has no log-probability: ``null`` in ``token_logprobs`` and ``top_logprobs``), then the
completion's. ``text_offset`` indexes the choice's text: a prompt token's offset comes from the
tokenizer's own character spans (a BOS token the tokenizer added spans nothing, at 0), a
completion token's runs on from the end of the prompt. A prompt sent as token ids echoes as
their decoded text (special tokens left out), each token's offset laid end to end. A prompt
token's ``top_logprobs`` always holds the token itself besides the N best (so up to N + 1
entries, as OpenAI and vLLM).
``max_tokens: 0`` is allowed with echo: the prompt is scored and nothing is generated (the engine
runs one token, which is dropped).

This is what evaluation tools (lm-evaluation-harness' loglikelihood) need, and what makes a
second ``foretell serve`` a faithful upstream for remote verification (``remote_verify.py``).

The server calls ``run`` for a local completion that asks for echo or token ids (the rest takes
the ordinary path), with ``LocalHooks``: the server's own helpers for waiting on the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, StrictBool, StrictInt, ValidationError, model_validator

from foretell.proxy.engine import GenerationRequest
from foretell.proxy.engine.scheduler import ErrorEvent, TokensEvent
from foretell.proxy.server.logprobs_format import TokenTexts
from foretell.proxy.server.prompts import chat_prompt, given_prompt_ids, prompt_ids
from foretell.proxy.server.schema import (
    APIError,
    ChatMessage,
    CompletionRequest,
    Text,
    _Lenient,
    describe_validation_error,
)


@dataclass
class LocalHooks:
    """What the echo path borrows from the server (closures of ``create_app``)."""

    settings: Any
    prompt_slots: asyncio.Semaphore
    collect: Callable  # (request, local, job, started) -> results or None
    wait_event: Callable  # (request, job) -> event; raises client_gone
    observe: Callable  # (local, result, started, first)
    usage_body: Callable
    speculation_body: Callable
    finish: Callable  # result -> "stop" / "length"
    generation_error: Callable  # exception -> APIError
    client_gone: type


def wanted(parsed) -> bool:
    """Does this request take the echo path?"""
    return isinstance(parsed, CompletionRequest) and (parsed.echo or parsed.return_tokens_as_token_ids)


# ---- the prompt, with each token's character span ------------------------------------------

def _prompt_with_offsets(tokenizer, prompt: str | list[int], context: int | None) -> tuple[list[int], list[int], str]:
    """The prompt's ids (as the ordinary path makes them), each token's start in the prompt's
    text, and that text (a prompt of token ids: their decoded text, special tokens left out)."""
    if isinstance(prompt, list):
        ids = given_prompt_ids(tokenizer, prompt, context)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return ids, _laid_offsets(tokenizer, ids, text), text
    text = prompt
    ids = prompt_ids(tokenizer, text, context, param="prompt")
    has_bos = bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token)
    try:
        encoded = tokenizer(text, add_special_tokens=not has_bos, return_offsets_mapping=True)
        spans = encoded["offset_mapping"]
        if list(encoded["input_ids"]) == list(ids):
            return ids, [start for start, _ in spans], text
    except (NotImplementedError, ValueError, KeyError):  # a slow tokenizer has no offsets
        pass
    return ids, _laid_offsets(tokenizer, ids, text), text


def _laid_offsets(tokenizer, ids: list[int], text: str) -> list[int]:
    """Each token's text laid end to end, special tokens spanning nothing (exact for plain text)."""
    texts, offsets, at = TokenTexts(tokenizer), [], 0
    special = set(tokenizer.all_special_ids)
    for token in ids:
        offsets.append(min(at, len(text)))
        if token not in special:
            at += len(texts(token))
    return offsets


# ---- the legacy logprobs object -------------------------------------------------------------

class _Renderer:
    def __init__(self, tokenizer, as_ids: bool):
        self.texts = TokenTexts(tokenizer)
        self.as_ids = as_ids

    def __call__(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_ids else self.texts(token_id)


def prompt_logprobs_part(render: _Renderer, ids: list[int], offsets: list[int], entries) -> dict:
    """The prompt's share of the legacy logprobs object; ``entries`` are the engine's
    ``TokenLogprob`` for every prompt token after the first."""
    tokens = [render(token) for token in ids]
    token_logprobs: list[float | None] = [None]
    top: list[dict | None] = [None]
    for token, entry in zip(ids[1:], entries):
        token_logprobs.append(entry.logprob)
        alternatives = {render(t): lp for t, lp in entry.top}
        alternatives.setdefault(render(token), entry.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": list(offsets)}


def completion_logprobs_part(render: _Renderer, entries, start_offset: int) -> dict:
    """The completion's share: offsets run on from ``start_offset`` by each token's own text."""
    tokens, offsets, offset = [], [], start_offset
    for entry in entries:
        tokens.append(render(entry.token_id))
        offsets.append(offset)
        offset += len(render.texts(entry.token_id))
    return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{render(t): lp for t, lp in e.top} for e in entries], "text_offset": offsets}


def join_parts(*parts: dict) -> dict:
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in joined:
            joined[key] += part[key]
    return joined


# ---- the endpoint path ------------------------------------------------------------------------

async def run(request: Request, local, parsed: CompletionRequest, hooks: LocalHooks):
    settings = hooks.settings
    async with hooks.prompt_slots:
        ids, offsets, prompt_text = await asyncio.to_thread(_prompt_with_offsets, local.tokenizer,
                                                            parsed.prompt, local.context)
    requested = parsed.max_tokens_or(16)
    score_only = requested == 0  # the schema allows 0 only with echo
    if local.context is not None and max(requested, 1) > local.context - len(ids):
        raise APIError(400, f"max_tokens {requested} plus the prompt's {len(ids)} tokens exceed the "
                       f"context of {local.context}", param="max_tokens", code="context_length_exceeded")
    prediction = parsed.prediction.text() if parsed.prediction else None
    if prediction is not None and len(prediction) > settings.max_prediction_chars:
        raise APIError(413, f"prediction over {settings.max_prediction_chars} characters",
                       param="prediction", code="prediction_too_large")
    if parsed.stream and parsed.n > 1:
        raise APIError(400, "n > 1 is not supported with stream", param="n")
    speculation = parsed.speculation
    scored = parsed.echo and parsed.logprobs is not None
    gen_request = GenerationRequest(
        prompt_ids=ids, max_tokens=max(requested, 1), prediction=prediction,
        prompt_lookup=speculation.prompt_lookup if speculation else None, stop=parsed.stop_strings(),
        max_draft=(speculation and speculation.max_draft) or GenerationRequest.max_draft,
        temperature=parsed.temperature or 0.0, top_p=parsed.top_p or 1.0, top_k=parsed.top_k or None,
        seed=parsed.seed, logprobs=parsed.logprobs,
        prompt_logprobs=parsed.logprobs if scored else None,
    )
    choices = [gen_request] + [
        dataclasses.replace(gen_request, seed=None if gen_request.seed is None
                            else (gen_request.seed + i) % 2**64)
        for i in range(1, parsed.n)]
    job = local.scheduler.submit(choices)  # QueueFullError: answered 429 by the caller
    started = time.perf_counter()
    shape = _Shape(local, parsed, ids, offsets, prompt_text, score_only, hooks)
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        return StreamingResponse(_stream(request, local, job, shape, include_usage, started, hooks),
                                 media_type="text/event-stream")
    results = await hooks.collect(request, local, job, started)
    if results is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return shape.body(results)


class _Shape:
    """Builds the echo responses of one request."""

    def __init__(self, local, parsed, ids, offsets, prompt_text: str, score_only, hooks: LocalHooks):
        self.local, self.parsed, self.ids, self.offsets = local, parsed, ids, offsets
        self.score_only, self.hooks = score_only, hooks
        self.render = _Renderer(local.tokenizer, parsed.return_tokens_as_token_ids)
        self.id = "cmpl-" + uuid.uuid4().hex
        self.created = int(time.time())
        self.prefix = prompt_text if parsed.echo else ""

    def prompt_part(self, result) -> dict:
        return prompt_logprobs_part(self.render, self.ids, self.offsets, result.prompt_logprobs or [])

    def finish(self, result) -> str:
        return "length" if self.score_only else self.hooks.finish(result)

    def usage(self, result, completion_tokens: int | None = None) -> dict:
        usage = self.hooks.usage_body(result)
        if self.score_only:
            usage["completion_tokens"] = 0
            usage["completion_tokens_details"]["accepted_prediction_tokens"] = 0
            usage["completion_tokens_details"]["rejected_prediction_tokens"] = 0
        if completion_tokens is not None:
            usage["completion_tokens"] = completion_tokens
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        return usage

    def body(self, results) -> dict:
        choices = []
        for index, result in enumerate(results):
            completion = "" if self.score_only else result.text
            logprobs = None
            if self.parsed.logprobs is not None:
                entries = [] if self.score_only else (result.logprobs or [])
                part = completion_logprobs_part(self.render, entries, len(self.prefix))
                logprobs = join_parts(self.prompt_part(result), part) if self.parsed.echo else part
            choices.append({"index": index, "text": self.prefix + completion, "logprobs": logprobs,
                            "finish_reason": self.finish(result)})
        total = 0 if self.score_only else sum(r.stats.completion_tokens for r in results)
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.local.name, "choices": choices, "usage": self.usage(results[0], total),
                "speculation": self.hooks.speculation_body(results[0])}

    def chunk(self, text: str, logprobs=None, finish_reason=None) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.local.name,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def _sse(payload) -> bytes:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n".encode()


async def _stream(request, local, job, shape: _Shape, include_usage: bool, started: float, hooks: LocalHooks):
    """The echo stream: the prompt as the first chunk, then the completion as the ordinary stream
    sends it; with ``max_tokens: 0`` nothing after the prompt. The prompt's logprobs exist only
    once the request is done, so a stream asking for them sends everything at the end."""
    parsed = shape.parsed
    offset = len(shape.prefix)
    first = None
    buffered = parsed.echo and parsed.logprobs is not None
    try:
        if parsed.echo and not buffered:
            yield _sse(shape.chunk(shape.prefix))
        while True:
            try:
                event = await hooks.wait_event(request, job)
            except hooks.client_gone:
                return
            if isinstance(event, ErrorEvent):
                yield _sse(hooks.generation_error(event.error).body())
                yield b"data: [DONE]\n\n"
                return
            if isinstance(event, TokensEvent):
                first = first or time.perf_counter()
                if shape.score_only or buffered or not (event.text or event.logprobs):
                    continue
                part = None
                if parsed.logprobs is not None and event.logprobs:
                    part = completion_logprobs_part(shape.render, event.logprobs, offset)
                    offset = part["text_offset"][-1] + len(shape.render.texts(event.logprobs[-1].token_id))
                yield _sse(shape.chunk(event.text, part))
                continue
            result = event.result
            hooks.observe(local, result, started, first)
            if buffered:
                yield _sse(shape.chunk(shape.prefix, shape.prompt_part(result)))
                if not shape.score_only and result.token_ids:
                    tail = completion_logprobs_part(shape.render, result.logprobs or [], offset)
                    yield _sse(shape.chunk(result.text, tail))
            yield _sse(shape.chunk("", finish_reason=shape.finish(result)))
            if include_usage:
                tokens = 0 if shape.score_only else result.stats.completion_tokens
                yield _sse({"id": shape.id, "object": "text_completion", "created": shape.created,
                            "model": local.name, "choices": [], "usage": shape.usage(result, tokens),
                            "speculation": hooks.speculation_body(result)})
            yield b"data: [DONE]\n\n"
            return
    finally:
        job.cancel()


# ---- /tokenize and /detokenize (vLLM's shapes) --------------------------------------------------

class TokenizeRequest(_Lenient):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: special tokens (BOS) for a prompt, none for messages (the template has them).
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Lenient):
    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1_000_000)


def add_token_routes(app, settings, get_local: Callable, read_body: Callable, prompt_slots_of: Callable) -> None:
    """``POST /tokenize`` and ``POST /detokenize`` for the local model, as vLLM serves them
    (outside /v1, so they check the API key and the JSON content type themselves)."""
    from foretell.proxy.server.guard import _check_key

    def check(request: Request):
        if settings.api_keys:
            _check_key(request.headers.get("authorization", ""), settings.api_keys)
        media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            raise APIError(415, "send the body as JSON, with 'Content-Type: application/json'",
                           code="unsupported_media_type")

    def local_for(model: str | None):
        local = get_local()
        if local is None:
            raise APIError(503, "the model is still loading", type="server_error", code="model_loading",
                           headers={"Retry-After": "5"})
        names = {local.name} | ({settings.served_model_name} if settings.served_model_name else set())
        if model is not None and model not in names:
            raise APIError(404, f"model {model!r} does not exist here (only the local model is tokenised)",
                           param="model", code="model_not_found")
        return local

    def parse(schema, body):
        try:
            return schema.model_validate(body)
        except ValidationError as error:
            message, param = describe_validation_error(error)
            raise APIError(400, message, param=param) from None

    def tokenize(tokenizer, parsed: TokenizeRequest, context) -> list[int]:
        if parsed.messages is not None:
            turns = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                     for m in parsed.messages]
            if parsed.add_generation_prompt or not getattr(tokenizer, "chat_template", None):
                text = chat_prompt(tokenizer, parsed.messages)
            else:
                try:
                    text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=False)
                except Exception as error:  # a template that rejects this conversation
                    raise APIError(400, f"the model's chat template rejected the messages: {error}",
                                   param="messages") from None
            param, default_special = "messages", False
        else:
            text, param, default_special = parsed.prompt, "prompt", True
        special = default_special if parsed.add_special_tokens is None else parsed.add_special_tokens
        has_bos = bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token)
        if special and not has_bos:
            return prompt_ids(tokenizer, text, context, param)  # as /v1/completions tokenises it
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if context is not None and len(ids) >= context:
            raise APIError(400, f"the {param} has {len(ids)} tokens; this model's context is {context}",
                           param=param, code="context_length_exceeded")
        return list(ids)

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request):
        check(request)
        parsed = parse(TokenizeRequest, await read_body(request))
        local = local_for(parsed.model)
        async with prompt_slots_of():
            ids = await asyncio.to_thread(tokenize, local.tokenizer, parsed, local.context)
        return JSONResponse({"count": len(ids), "max_model_len": local.context, "tokens": ids,
                             "token_strs": None})

    @app.post("/detokenize")
    async def detokenize_endpoint(request: Request):
        check(request)
        parsed = parse(DetokenizeRequest, await read_body(request))
        local = local_for(parsed.model)
        vocabulary = len(local.tokenizer)
        bad = next((i for i, t in enumerate(parsed.tokens) if not 0 <= t < vocabulary), None)
        if bad is not None:
            raise APIError(400, f"tokens.{bad}: {parsed.tokens[bad]} is not a token id of this model "
                           f"(0 to {vocabulary - 1})", param=f"tokens.{bad}")
        async with prompt_slots_of():
            text = await asyncio.to_thread(local.tokenizer.decode, parsed.tokens, skip_special_tokens=False)
        return JSONResponse({"prompt": text})
