"""From a validated request to what runs it: the server's defaults filled in, its limits checked,
and, for the local engine, one ``GenerationRequest`` per choice.

Every generation route reads a request through ``plan``, so a default or a limit means the same
whether the local engine, the echo path, remote verification or a plain forward answers it; the
local engine's own limits (the context, streams of one choice) are checked in ``engine_requests``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from foretell.proxy.engine import GenerationRequest
from foretell.proxy.engine.draft_sources import PredictionEncoding
from foretell.proxy.engine.grammar import Grammar
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.schema import ChatCompletionRequest
from foretell.proxy.server.tool_calls.format import TAG_CLOSE, ToolPlan

# OpenAI's default length of a legacy completion; chat defaults to settings.default_max_tokens.
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True)
class RequestPlan:
    """What a validated request asks for, with the server's defaults."""

    is_chat: bool
    max_tokens: int  # the completion's length at most; 0: score the prompt only (echo)
    prediction: str | None
    prompt_lookup: bool | None  # None: as the fallback when a prediction is given, else off
    draft_cache: bool | None  # False: the request opted out of the draft cache; None: as the server says
    draft_model: bool | None  # drafts from the server's draft model; None: without a prediction
    max_draft: int | None  # tokens drafted per round at most; None: the verifier's default
    report_origins: bool  # the stream's per-chunk origins (origins.py)
    include_usage: bool  # the stream ends with a usage chunk
    stop: tuple[str, ...]  # the request's own stop strings
    # Structured output: the JSON schema the output follows, {} for any JSON object; None: free text.
    json_schema: dict | None = None
    # The tools a chat offers the local model (tool_calls/; set by with_tools); None: none.
    tools: ToolPlan | None = None


def plan(parsed, settings) -> RequestPlan:
    """The defaults and limits every route shares; APIError 413 for a prediction over
    ``settings.max_prediction_chars``.

    The prediction limit holds on every route, the plain forward included: this proxy parses and
    validates every prediction it is sent, the engine and remote verification tokenise and align
    it, and a limit that held only where a model name happens to route (local, verified remotely)
    would be one no caller can predict.
    """
    is_chat = isinstance(parsed, ChatCompletionRequest)
    prediction = parsed.prediction.text() if parsed.prediction else None
    if prediction is not None and len(prediction) > settings.max_prediction_chars:
        raise APIError(413, f"prediction over {settings.max_prediction_chars} characters",
                       param="prediction", code="prediction_too_large")
    speculation = parsed.speculation
    return RequestPlan(
        is_chat=is_chat,
        max_tokens=parsed.max_tokens_or(settings.default_max_tokens if is_chat else COMPLETION_DEFAULT_MAX_TOKENS),
        prediction=prediction,
        prompt_lookup=speculation.prompt_lookup if speculation else None,
        draft_cache=speculation.draft_cache if speculation else None,
        draft_model=speculation.draft_model if speculation else None,
        max_draft=speculation.max_draft if speculation else None,
        report_origins=bool(speculation and speculation.report_origins),
        include_usage=bool(parsed.stream_options and parsed.stream_options.include_usage),
        stop=parsed.stop_strings(),
        json_schema=_json_schema(parsed.response_format),
    )


def with_tools(plan: RequestPlan, tools: ToolPlan | None, parsed) -> RequestPlan:
    """``plan`` offering ``tools`` on the local engine; APIError 400 for what it does not take
    together with tools."""
    if tools is None:
        return plan
    refused = [("response_format", plan.json_schema is not None, "response_format other than text"),
               ("logprobs", bool(parsed.logprobs), "logprobs"),
               ("speculation.report_origins", plan.report_origins, "speculation.report_origins")]
    for param, asked, what in refused:
        if asked:
            raise APIError(400, f"{what} together with tools is not supported on local models yet; "
                           'leave one out (or send tool_choice "none")', param=param)
    return dataclasses.replace(plan, tools=tools)


def _json_schema(response_format) -> dict | None:
    if response_format is None or not response_format.constrained():
        return None
    return response_format.schema() or {}


def engine_requests(parsed, plan: RequestPlan, prompt_ids: list[int], local,
                    prompt_logprobs: int | None = None, draft_cache_scope: str | None = None,
                    prediction_encoding: PredictionEncoding | None = None,
                    grammar: Grammar | None = None) -> list[GenerationRequest]:
    """The engine requests of a local generation, one per choice; APIError 400 when the
    completion cannot fit the model's context, or for ``n > 1`` in a stream. ``prompt_logprobs``:
    the prompt's log-probabilities with that many alternatives (echo); ``draft_cache_scope``: the
    tenant scope whose earlier answers it drafts from (``draft_scope.py``; None: none);
    ``prediction_encoding``: the prediction tokenised already, shared by every choice;
    ``grammar``: the output's grammar (structured output), each choice its own copy."""
    tokens = max(plan.max_tokens, 1)  # a score-only echo runs one token, which is dropped
    if local.context is not None and tokens > local.context - len(prompt_ids):
        raise APIError(400, f"max_tokens {plan.max_tokens} plus the prompt's {len(prompt_ids)} tokens "
                       f"exceed the context of {local.context}", param="max_tokens",
                       code="context_length_exceeded")
    if parsed.stream and parsed.n > 1:
        raise APIError(400, "n > 1 is not supported with stream", param="n")
    if plan.draft_model and local.draft_model is None:
        raise APIError(400, "speculation.draft_model: this server runs no draft model (start it with "
                       "--draft-model)", param="speculation.draft_model")
    first = GenerationRequest(
        prompt_ids=prompt_ids, max_tokens=tokens, prediction=plan.prediction, prompt_lookup=plan.prompt_lookup,
        prediction_encoding=prediction_encoding,
        # A chat answer also ends where the model starts the next turn (LocalModel.chat_stops).
        stop=plan.stop + (local.chat_stops if plan.is_chat else ()) + _tool_stops(plan, local),
        stop_token_ids=local.chat_stop_token_ids if plan.is_chat else (),
        max_draft=plan.max_draft or GenerationRequest.max_draft,
        temperature=parsed.temperature or 0.0, top_p=parsed.top_p or 1.0, top_k=parsed.top_k or None,
        seed=parsed.seed, logprobs=parsed.logprob_alternatives(), prompt_logprobs=prompt_logprobs,
        # A seeded sampled request drafts from itself alone: its random draws follow its draft
        # lengths, and its seed must replay whatever the cache holds by then.
        draft_cache_scope=None if parsed.seed is not None and (parsed.temperature or 0) > 0 else draft_cache_scope,
        grammar=grammar, draft_model=plan.draft_model,
    )
    # n choices are sibling sequences sharing the prompt's blocks; a seeded request's further
    # choices take the next seeds (modulo 2**64), so they differ yet replay.
    return [first] + [dataclasses.replace(first, seed=None if first.seed is None else (first.seed + i) % 2**64,
                                          grammar=grammar.copy() if grammar is not None else None)
                      for i in range(1, parsed.n)]


def _tool_stops(plan: RequestPlan, local) -> tuple[str, ...]:
    # One call at most, free to call or not: the answer ends with the call's closing tag (a
    # required call's grammar ends there itself).
    tools = plan.tools
    if tools is not None and not tools.parallel and not tools.required and local.call_format.tagged:
        return (TAG_CLOSE,)
    return ()
