"""A request body as a JSON object: parsed off the event loop, with a nesting limit, answered
400 in OpenAI's envelope when it is not one. Handlers take it as ``body: JsonBody``."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

from fastapi import Depends, Request

from foretell.proxy.server.api_error import APIError

# JSON nested deeper than this is refused (OpenAI bodies are shallow; deep nesting only costs).
MAX_JSON_DEPTH = 64


async def json_body(request: Request) -> dict:
    raw = await request.body()  # GuardMiddleware has bounded it to settings.max_body_bytes
    return await asyncio.to_thread(parse_body, raw)  # megabytes of JSON: off the event loop


JsonBody = Annotated[dict, Depends(json_body)]


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object, or APIError 400."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "request body is not valid UTF-8", code="invalid_encoding") from None
    try:
        body = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None
    except ValueError as error:  # not JSON, NaN / Infinity, or an integer of > 4300 digits
        raise APIError(400, f"request body is not valid JSON: {error}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if _json_depth(body) > MAX_JSON_DEPTH:
        raise APIError(400, f"request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json")
    return body


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _json_depth(value) -> int:
    """How deeply a parsed JSON value nests (iteratively: no recursion limit to hit)."""
    deepest, todo = 1, [(value, 1)]
    while todo:
        container, depth = todo.pop()
        deepest = max(deepest, depth)
        items = container.values() if isinstance(container, dict) else container
        todo += [(item, depth + 1) for item in items if isinstance(item, (dict, list))]
    return deepest
