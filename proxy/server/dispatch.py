"""Which path answers a generation request: the local engine (``local_generation.py``, or
``echo.py`` for echo and token ids), remote verification on an upstream (``remote_verify/``),
or a plain forward (``upstream.py``); a full local queue goes to the route's fallback upstream.

Fields that would change the text and that foretell does not implement (``unsupported_fields.py``)
are refused with a 400 on the local engine; a request carrying one is never verified remotely
(it is forwarded plainly, and its upstream honours the field)."""

from __future__ import annotations

import asyncio
import logging

from fastapi import Request

from foretell.proxy.engine.scheduler import QueueFullError
from foretell.proxy.server import echo, local_generation
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.logs import note
from foretell.proxy.server.redact import Redactor
from foretell.proxy.server.prompts import template_source
from foretell.proxy.server.request_builder import plan, with_tools
from foretell.proxy.server.schema import ChatCompletionRequest, validate
from foretell.proxy.server.state import ServerState, model_loading
from foretell.proxy.server.tool_calls.format import tool_plan
from foretell.proxy.server.unsupported_fields import refuse_unsupported
from foretell.proxy.server.upstream import ModelRoute, prepare_body, relay

log = logging.getLogger("foretell.server")


async def generate(request: Request, server: ServerState, body: dict, schema):
    """Answer a completion (``schema`` CompletionRequest) or chat completion request."""
    # A body of many small parts (100k messages) takes a second to validate.
    parsed = await asyncio.to_thread(validate, schema, body)
    route = _route(request, server, parsed)
    planned = plan(parsed, server.settings)  # the limits hold on every route (request_builder.py)
    is_chat = isinstance(parsed, ChatCompletionRequest)
    path = "/chat/completions" if is_chat else "/completions"
    if not route.local:
        if planned.draft_model:
            raise APIError(400, "speculation.draft_model drafts for the local model only; "
                           f"{parsed.model!r} is served upstream", param="speculation.draft_model")
        upstream = server.settings.routes.upstreams[route.upstream]

        async def forward_here():
            return await forward(request, server, upstream, path, body, parsed.stream)

        if server.remote.applies(upstream, parsed, body):  # never with a field we do not implement
            return await server.remote.run(request, upstream, parsed, planned, body, forward_here)
        return await forward_here()
    local = server.loaded()
    refuse_unsupported(body, is_chat=is_chat, chat_template=template_source(local.tokenizer))
    if planned.json_schema is not None and echo.wanted(parsed):
        raise APIError(400, "response_format other than text is not supported with echo or "
                       "return_tokens_as_token_ids", param="response_format")
    if is_chat:
        planned = with_tools(planned, tool_plan(body), parsed)
    try:
        if echo.wanted(parsed):  # echo, prompt logprobs, token ids
            return await echo.run(request, server, local, parsed, planned)
        return await local_generation.run(request, server, local, parsed, planned)
    except QueueFullError:
        if route.fallback:
            note(request.scope, route=route.fallback)
            return await forward(request, server, server.settings.routes.upstreams[route.fallback], path, body,
                                 parsed.stream)
        raise APIError(429, "the server is busy: queue full", type="rate_limit_error",
                       code="queue_full", headers={"Retry-After": "1"}) from None


def _route(request: Request, server: ServerState, parsed) -> ModelRoute:
    """The route of the model asked for; APIError 404 for a model served nowhere."""
    route = server.settings.routes.route_for(parsed.model, server.local_names())
    note(request.scope, model=parsed.model)
    if route is None:
        if server.local is None and not server.load_error:
            raise model_loading()  # the local model's name is known once it has loaded: it may be this one
        raise APIError(404, f"model {parsed.model!r} does not exist", param="model", code="model_not_found")
    note(request.scope, route="local" if route.local else route.upstream)
    return route


async def forward(request: Request, server: ServerState, upstream, path: str, body: dict, stream: bool):
    """Relay the request to ``upstream`` as sent (less what is foretell's own)."""
    request_id = request.scope.get("foretell.request_id", "-")
    body, notes = prepare_body(body, upstream)
    # Whatever an upstream answers is relayed without any route's key in it.
    redactor = Redactor(server.settings.routes.keys())
    try:
        response = await server.forwarder.open(upstream, path, body)
        return await relay(response, upstream, stream=stream, notes=notes, redactor=redactor,
                           request_id=request_id)
    except APIError as error:
        log.warning("%s: %s", request_id, redactor.text(error.message))
        raise
