"""The playground: a static page at ``/`` (HTML, CSS and JS shipped as package data in
``proxy/server/static/``; no build step, nothing fetched from elsewhere).

The page talks to this server's own ``/v1`` API with ``fetch``: same origin, so none of the
guard's rules change (a POST is still JSON with the key in ``Authorization``). The page itself
needs no key; it asks for one when ``/v1/models`` answers 401 and keeps it in the tab's
``sessionStorage``. A strict Content-Security-Policy allows only the page's own files and
requests to this server, and no framing.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

STATIC = Path(__file__).parents[1] / "static"  # package data of foretell.proxy.server

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


router = APIRouter(include_in_schema=False)
_cache: dict[str, bytes] = {}  # each file read once, at the first request for it


def _route(name: str, media_type: str):
    async def serve() -> Response:
        if name not in _cache:
            _cache[name] = (STATIC / name).read_bytes()
        return Response(_cache[name], media_type=media_type, headers=HEADERS)
    return serve


for _path, (_name, _media_type) in FILES.items():
    router.add_api_route(_path, _route(_name, _media_type), methods=["GET"])
