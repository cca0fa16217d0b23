"""``POST /v1/completions``: OpenAI's legacy completions (with echo and prompt logprobs)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from foretell.proxy.server.body import JsonBody
from foretell.proxy.server.dispatch import generate
from foretell.proxy.server.schema import CompletionRequest
from foretell.proxy.server.state import Server

router = APIRouter()


@router.post("/v1/completions")
async def completions(request: Request, server: Server, body: JsonBody):
    return await generate(request, server, body, CompletionRequest)
