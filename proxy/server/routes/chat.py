"""``POST /v1/chat/completions``: OpenAI's chat completions."""

from __future__ import annotations

from fastapi import APIRouter, Request

from foretell.proxy.server.body import JsonBody
from foretell.proxy.server.dispatch import generate
from foretell.proxy.server.schema import ChatCompletionRequest
from foretell.proxy.server.state import Server

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, server: Server, body: JsonBody):
    return await generate(request, server, body, ChatCompletionRequest)
