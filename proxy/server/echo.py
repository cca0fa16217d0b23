"""OpenAI's legacy ``echo`` with prompt log-probabilities on ``/v1/completions``, and vLLM's
``return_tokens_as_token_ids``.

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
second ``foretell serve`` a faithful upstream for remote verification (``remote_verify/``).

The server calls ``run`` for a local completion that asks for echo or token ids (the rest takes
the ordinary path, ``local_generation.py``). vLLM's ``/tokenize`` and ``/detokenize``, which
tokenise as this path does, are ``routes/tokens.py``.
"""

from __future__ import annotations

import asyncio

from fastapi import Request

from foretell.proxy.engine.scheduler import TokensEvent
from foretell.proxy.server.local_jobs import LocalJob, answer
from foretell.proxy.server.logprobs_format import (
    RunningCompletionLogprobs,
    TokenTexts,
    completion_logprobs,
    join_logprobs,
    prompt_logprobs,
)
from foretell.proxy.server.prompts import adds_special_tokens, given_prompt_ids, prompt_ids
from foretell.proxy.server.request_builder import RequestPlan, engine_requests
from foretell.proxy.server.responses import Shape, engine_usage, finish_reason, speculation_report, usage
from foretell.proxy.server.schema import CompletionRequest


def wanted(parsed) -> bool:
    """Does this request take the echo path?"""
    return isinstance(parsed, CompletionRequest) and (parsed.echo or parsed.return_tokens_as_token_ids)


# ---- the prompt, with each token's character span ------------------------------------------

def _prompt_with_offsets(tokenizer, prompt: str | list[int], context: int | None,
                         special: bool | None = None) -> tuple[list[int], list[int], str]:
    """The prompt's ids (as the ordinary path makes them), each token's start in the prompt's
    text, and that text (a prompt of token ids: their decoded text, special tokens left out)."""
    if isinstance(prompt, list):
        ids = given_prompt_ids(tokenizer, prompt, context)
        text = tokenizer.decode(ids, skip_special_tokens=True)
        return ids, _laid_offsets(tokenizer, ids, text), text
    text = prompt
    ids = prompt_ids(tokenizer, text, context, param="prompt", special=special)
    try:
        encoded = tokenizer(text, add_special_tokens=adds_special_tokens(tokenizer, text, special),
                            return_offsets_mapping=True)
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


# ---- the endpoint path ------------------------------------------------------------------------

async def run(request: Request, server, local, parsed: CompletionRequest, plan: RequestPlan):
    """Answer ``parsed`` on ``local``; QueueFullError when the scheduler's queue is full."""
    async with server.prompt_slots:
        ids, offsets, prompt_text = await asyncio.to_thread(_prompt_with_offsets, local.tokenizer,
                                                            parsed.prompt, local.context, parsed.add_special_tokens)
    scored = parsed.echo and parsed.logprobs is not None
    choices = engine_requests(parsed, plan, ids, local, prompt_logprobs=parsed.logprobs if scored else None)
    echo = _Echo(local, parsed, plan, ids, offsets, prompt_text)
    return await answer(request, server, local, choices, parsed.stream,
                        lambda job: echo.chunks(job, plan.include_usage), echo.body)


class _Echo:
    """The echo answers of one request."""

    def __init__(self, local, parsed: CompletionRequest, plan: RequestPlan, ids, offsets, prompt_text: str):
        self.parsed, self.ids, self.offsets = parsed, ids, offsets
        self.shape = Shape(local.name, is_chat=False)
        self.texts, self.as_ids = TokenTexts(local.tokenizer), parsed.return_tokens_as_token_ids
        self.score_only = plan.max_tokens == 0  # the schema allows 0 only with echo
        self.prefix = prompt_text if parsed.echo else ""

    def prompt_part(self, result) -> dict:
        return prompt_logprobs(self.ids, self.offsets, result.prompt_logprobs or [], self.texts, self.as_ids)

    def finish(self, result) -> str:
        return "length" if self.score_only else finish_reason(result)

    def usage_of(self, result, completion_tokens: int) -> dict:
        if self.score_only:  # the one token the engine ran is dropped, with its counts
            return usage(result.stats.prompt_tokens, 0, cached_tokens=result.stats.cached_tokens)
        return engine_usage(result.stats, completion_tokens)

    def body(self, results) -> dict:
        choices = []
        for index, result in enumerate(results):
            completion = "" if self.score_only else result.text
            logprobs = None
            if self.parsed.logprobs is not None:
                entries = [] if self.score_only else (result.logprobs or [])
                part = completion_logprobs(entries, self.texts, len(self.prefix), self.as_ids)
                logprobs = join_logprobs(self.prompt_part(result), part) if self.parsed.echo else part
            choices.append(self.shape.choice(index, self.prefix + completion, self.finish(result), logprobs))
        total = 0 if self.score_only else sum(r.stats.completion_tokens for r in results)
        return self.shape.body(choices, self.usage_of(results[0], total), speculation_report(results[0]))

    async def chunks(self, job: LocalJob, include_usage: bool):
        """The echo stream: the prompt as the first chunk, then the completion as the ordinary
        stream sends it; with ``max_tokens: 0`` nothing after the prompt. The prompt's logprobs
        exist only once the request is done, so a stream asking for them sends everything at
        the end."""
        parsed, shape = self.parsed, self.shape
        completion_logprobs_so_far = RunningCompletionLogprobs(self.texts, len(self.prefix), self.as_ids)
        buffered = parsed.echo and parsed.logprobs is not None
        try:
            if parsed.echo and not buffered:
                yield shape.chunk(self.prefix)
            while True:
                event = await job.next_event()
                if isinstance(event, TokensEvent):
                    if self.score_only or buffered or not (event.text or event.logprobs):
                        continue
                    part = None
                    if parsed.logprobs is not None and event.logprobs:
                        part = completion_logprobs_so_far(event.logprobs)
                    yield shape.chunk(event.text, part)
                    continue
                result = event.result
                if buffered:
                    yield shape.chunk(self.prefix, self.prompt_part(result))
                    if not self.score_only and result.token_ids:
                        yield shape.chunk(result.text, completion_logprobs_so_far(result.logprobs or []))
                yield shape.finish_chunk(self.finish(result))
                if include_usage:
                    tokens = 0 if self.score_only else result.stats.completion_tokens
                    yield shape.usage_chunk(self.usage_of(result, tokens), speculation_report(result))
                return
        finally:
            job.cancel()
