"""vLLM's ``POST /tokenize`` and ``POST /detokenize`` for the local model. They live outside
``/v1``, where the guard does not look, so they check the API key and the JSON content type
themselves (before the body is read)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.body import JsonBody
from foretell.proxy.server.guard import check_key
from foretell.proxy.server.prompts import chat_prompt, prompt_ids
from foretell.proxy.server.schema import DetokenizeRequest, TokenizeRequest, validate
from foretell.proxy.server.state import Server
from foretell.proxy.server.tool_calls.format import tool_plan


def _check(request: Request, server: Server) -> None:
    if server.settings.api_keys:
        check_key(request.headers.get("authorization", ""), server.settings.api_keys)
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise APIError(415, "send the body as JSON, with 'Content-Type: application/json'",
                       code="unsupported_media_type")


# A router's dependencies run before the handler's own (the body among them).
router = APIRouter(dependencies=[Depends(_check)])


@router.post("/tokenize")
async def tokenize_endpoint(server: Server, body: JsonBody):
    parsed = validate(TokenizeRequest, body)
    local = _local_for(server, parsed.model)
    # vLLM's field: the tools a chat offers, rendered as a generation request renders them.
    tools = tool_plan(body) if parsed.messages is not None else None
    async with server.prompt_slots:
        ids = await asyncio.to_thread(_tokenize, local.tokenizer, parsed, local.context, tools)
    return JSONResponse({"count": len(ids), "max_model_len": local.context, "tokens": ids, "token_strs": None})


@router.post("/detokenize")
async def detokenize_endpoint(server: Server, body: JsonBody):
    parsed = validate(DetokenizeRequest, body)
    local = _local_for(server, parsed.model)
    vocabulary = len(local.tokenizer)
    bad = next((i for i, t in enumerate(parsed.tokens) if not 0 <= t < vocabulary), None)
    if bad is not None:
        raise APIError(400, f"tokens.{bad}: {parsed.tokens[bad]} is not a token id of this model "
                       f"(0 to {vocabulary - 1})", param=f"tokens.{bad}")
    async with server.prompt_slots:
        text = await asyncio.to_thread(local.tokenizer.decode, parsed.tokens, skip_special_tokens=False)
    return JSONResponse({"prompt": text})


def _local_for(server, model: str | None):
    """The local model, which ``model`` (when given) must name."""
    local = server.loaded()
    if model is not None and model not in server.local_names():
        raise APIError(404, f"model {model!r} does not exist here (only the local model is tokenised)",
                       param="model", code="model_not_found")
    return local


def _tokenize(tokenizer, parsed: TokenizeRequest, context, tools) -> list[int]:
    if parsed.messages is not None:
        text = chat_prompt(tokenizer, parsed.messages, tools, add_generation_prompt=parsed.add_generation_prompt)
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
