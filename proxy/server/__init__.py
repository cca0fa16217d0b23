"""foretell.proxy.server: the OpenAI-compatible HTTP server (routes, request schema, upstream
forwarding, metrics). It drives the engine through its scheduler and is never imported by it."""

from foretell.proxy.server.app import ServerSettings, create_app

__all__ = ["ServerSettings", "create_app"]
