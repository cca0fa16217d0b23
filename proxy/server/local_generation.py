"""A completion or chat completion on the local engine (the echo path is ``echo.py``): the prompt
tokenised off the event loop, one engine request per choice submitted to the scheduler, the
answer written as a body or a stream."""

from __future__ import annotations

import asyncio

from fastapi import Request

from foretell.proxy.engine.grammar import json_grammar
from foretell.proxy.engine.scheduler import TokensEvent
from foretell.proxy import prediction_usage
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.draft_scope import draft_cache_scope, key_identity
from foretell.proxy.server.local_jobs import LocalJob, answer
from foretell.proxy.server.logprobs_format import (
    RunningCompletionLogprobs,
    TokenTexts,
    chat_logprobs,
    completion_logprobs,
)
from foretell.proxy.server.origins import OriginSpans
from foretell.proxy.server.prompts import request_prompt_ids
from foretell.proxy.server.request_builder import RequestPlan, engine_requests
from foretell.proxy.server.responses import Shape, engine_usage, finish_reason, speculation_report, text_chunks
from foretell.proxy.server.tool_calls.format import call_grammar, grammar_error
from foretell.proxy.server.tool_calls.parser import ToolCallParser, collect, delta


async def run(request: Request, server, local, parsed, plan: RequestPlan):
    """Answer ``parsed`` on ``local``; QueueFullError when the scheduler's queue is full."""
    # Templates and tokenisation take seconds on a large prompt or prediction: off the event loop,
    # and off the engine's thread (which would stall every running stream for as long).
    async with server.prompt_slots:
        prompt_ids, prediction, grammar = await asyncio.to_thread(_tokenise, local, parsed, plan)
    settings = server.settings
    key = key_identity(request.headers.get("authorization")) if settings.api_keys else None
    scope = draft_cache_scope(settings.draft_cache_scope, key, parsed.user, plan.draft_cache)
    choices = engine_requests(parsed, plan, prompt_ids, local, draft_cache_scope=scope,
                              prediction_encoding=prediction, grammar=grammar)
    shape, texts = Shape(local.name, plan.is_chat), TokenTexts(local.tokenizer)
    origins = OriginSpans(local.tokenizer, choices[0].stop) if plan.report_origins and parsed.stream else None

    def calls():  # an answer's tool calls, read as it grows (None: no tools offered)
        tools = plan.tools
        return None if tools is None else ToolCallParser(local.call_format, tools.names(), tools.parallel)

    return await answer(request, server, local, choices, parsed.stream,
                        lambda job: _chunks(job, shape, texts, plan.include_usage, origins, calls()),
                        lambda results: _body(shape, texts, results, calls))


def _tokenise(local, parsed, plan: RequestPlan):
    """The prompt's ids, the prediction's encoding and the output's grammar (structured output,
    a required tool call), each None where the request has none."""
    prompt_ids = request_prompt_ids(local.tokenizer, parsed, plan.is_chat, local.context, plan.tools)
    grammar = _grammar(local, plan)
    if not plan.prediction:
        return prompt_ids, None, grammar
    prediction_usage.expect(plan.prediction)  # counted when the request finishes
    return prompt_ids, local.prediction_tokens.encode(plan.prediction), grammar


def _grammar(local, plan: RequestPlan):
    if plan.tools is not None and plan.tools.constrained():
        try:
            return local.grammar(call_grammar(plan.tools, local.call_format))
        except ValueError as error:
            raise grammar_error(error) from None
    if plan.json_schema is None:
        return None
    try:
        return local.grammar(json_grammar(plan.json_schema or None))
    except ValueError as error:
        param = "response_format.json_schema.schema" if plan.json_schema else "response_format"
        raise APIError(400, f"response_format: {error}", param=param, code="invalid_json_schema") from None


def _body(shape: Shape, texts: TokenTexts, results, calls) -> dict:
    """The whole answer: every choice, the usage of all, the first choice's speculation report.
    ``calls()``: a parser of an answer's tool calls (None: none offered)."""
    shape_logprobs = chat_logprobs if shape.is_chat else completion_logprobs
    choices = []
    for index, result in enumerate(results):
        logprobs = shape_logprobs(result.logprobs, texts) if result.logprobs is not None else None
        parser = calls()
        if parser is None:
            choices.append(shape.choice(index, result.text, finish_reason(result), logprobs))
            continue
        content, tool_calls = collect(parser.feed(result.text) + parser.finish())
        choices.append(shape.choice(index, content, finish_reason(result, bool(tool_calls)), logprobs, tool_calls))
    usage = engine_usage(results[0].stats, sum(result.stats.completion_tokens for result in results))
    return shape.body(choices, usage, speculation_report(results[0]))


def _chunks(job: LocalJob, shape: Shape, texts: TokenTexts, include_usage: bool,
            origins: OriginSpans | None, calls: ToolCallParser | None):
    """The stream's chunks: text as the engine confirms it (read into tool calls with
    ``calls``), then the finish and the usage."""
    finished = []  # the result, once the engine is done

    async def pieces():
        completion_logprobs_so_far = RunningCompletionLogprobs(texts)
        try:
            while True:
                event = await job.next_event()
                if not isinstance(event, TokensEvent):
                    finished.append(event.result)
                    for done in calls.finish() if calls is not None else ():
                        yield delta(done), None, None
                    return
                if calls is not None:  # tools offered: no logprobs, no origins (with_tools)
                    for found in calls.feed(event.text):
                        yield delta(found), None, None
                    continue
                if origins is not None:  # the report_origins extension
                    origins.add(event.token_ids, event.origins)
                if not (event.text or event.logprobs):
                    continue
                logprobs = None
                if event.logprobs:
                    logprobs = (chat_logprobs(event.logprobs, texts) if shape.is_chat
                                else completion_logprobs_so_far(event.logprobs))
                extra = {"foretell": origins.report(event.text)} if origins is not None else None
                yield event.text, logprobs, extra
        finally:
            job.cancel()  # no-op when finished; stops the engine if the client went away

    async def ending():
        [result] = finished
        called = calls is not None and calls.calls > 0
        return finish_reason(result, called), engine_usage(result.stats), speculation_report(result)

    return text_chunks(shape, pieces(), ending, include_usage)
