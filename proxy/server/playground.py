"""The playground: a static page at ``/`` (HTML, CSS and JS shipped as package data in
``static/``; no build step, nothing fetched from elsewhere).

The page talks to this server's own ``/v1`` API with ``fetch``: same origin, so none of the
guard's rules change (a POST is still JSON with the key in ``Authorization``). The page itself
needs no key; it asks for one when ``/v1/models`` answers 401 and keeps it in the tab's
``sessionStorage``. A strict Content-Security-Policy allows only the page's own files and
requests to this server, and no framing.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import Response

STATIC = Path(__file__).with_name("static")

# URL path -> (file in static/, media type)
FILES = {
    "/": ("playground.html", "text/html; charset=utf-8"),
    "/static/playground.css": ("playground.css", "text/css; charset=utf-8"),
    "/static/playground.js": ("playground.js", "text/javascript; charset=utf-8"),
}

HEADERS = {
    "content-security-policy": ("default-src 'none'; script-src 'self'; style-src 'self'; "
                                "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                "form-action 'none'; frame-ancestors 'none'"),
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-cache",
}


def add_playground(app: FastAPI) -> None:
    """Serve the playground's files (read once, at the first request for each)."""
    cache: dict[str, bytes] = {}

    def route(name: str, media_type: str):
        async def serve() -> Response:
            if name not in cache:
                cache[name] = (STATIC / name).read_bytes()
            return Response(cache[name], media_type=media_type, headers=HEADERS)
        return serve

    for path, (name, media_type) in FILES.items():
        app.add_api_route(path, route(name, media_type), methods=["GET"], include_in_schema=False)
