"""Errors in OpenAI's envelope: the app's exception handlers. Unknown paths (404) and wrong
methods (405) come with a hint for the usual slip: a base URL without ``/v1``
(``POST /chat/completions``), or with it twice, or a trailing slash."""

from __future__ import annotations

from fastapi import Request
from starlette.exceptions import HTTPException

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.guard import error_response
from foretell.proxy.server.routes import PATHS


async def api_error_handler(request: Request, error: APIError):
    return error_response(error)


async def http_error_handler(request: Request, error: HTTPException):
    """Starlette's routing errors (unknown paths and methods) in the same envelope as every other."""
    return error_response(route_error(request.method, request.url.path, error.status_code, str(error.detail),
                                      error.headers, PATHS))


def route_error(method: str, path: str, status: int, detail: str, headers: dict | None,
                known_paths) -> APIError:
    """The envelope for Starlette's routing errors: ``known_paths`` are the app's route paths."""
    if status == 404:
        message = f"Invalid URL ({method} {path})"
        suggestion = suggest_path(path, set(known_paths))
        if suggestion is not None:
            message += f": did you mean {suggestion}?"
            if not path.startswith("/v1/"):
                message += " (an OpenAI base URL ends with /v1, e.g. http://127.0.0.1:8000/v1)"
        return APIError(404, message, code="unknown_url", headers=headers)
    if status == 405:
        allowed = (headers or {}).get("allow") or (headers or {}).get("Allow")
        message = f"method {method} is not allowed on {path}" + (f"; use {allowed}" if allowed else "")
        return APIError(405, message, code="method_not_allowed", headers=headers)
    return APIError(status, detail or "request failed", headers=headers)


def suggest_path(path: str, known: set[str]) -> str | None:
    """The route the caller most likely meant, or None."""
    trimmed = path.rstrip("/") or "/"
    candidates = ["/v1" + trimmed, trimmed]
    if trimmed.startswith("/v1/v1/"):
        candidates.append(trimmed[3:])
    for candidate in candidates:
        if candidate != path and candidate in known:
            return candidate
    return None
