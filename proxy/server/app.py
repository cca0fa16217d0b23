"""The OpenAI-compatible HTTP server: FastAPI under uvicorn.

Local models run on the speculative engine (a scheduler thread batching every admitted request
into each target pass, bounded queue); other models are forwarded upstream. The port opens at
once; ``/health`` answers 503 until the model is loaded.

The app is its routers (``routes/``, one per concern), the guard and access-log middleware, and
the error handlers; what the routes share is one ``ServerState`` on ``app.state`` (``state.py``).
"""

from __future__ import annotations

import contextlib
import threading

from fastapi import FastAPI
from starlette.exceptions import HTTPException

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.guard import GuardMiddleware
from foretell.proxy.server.local_model import LocalModel, default_loader
from foretell.proxy.server.logs import AccessLogMiddleware
from foretell.proxy.server.route_errors import api_error_handler, http_error_handler
from foretell.proxy.server.routes import ROUTERS
from foretell.proxy.server.settings import ServerSettings
from foretell.proxy.server.state import ServerState

__all__ = ["LocalModel", "ServerSettings", "create_app"]


def create_app(settings: ServerSettings, load_local=None, first_routers=()) -> FastAPI:
    """Build the app. ``load_local(metrics)`` returns a ``LocalModel`` (run on a background
    thread; by default the model of ``settings``). ``first_routers`` answer their paths before
    the server's own (the replicas' ingress answers /health and /metrics for all replicas)."""
    server = ServerState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Load on a thread so the port opens at once and /health can answer 503 meanwhile.
        threading.Thread(target=server.load, args=(load_local or default_loader(settings),),
                         name="foretell-load", daemon=True).start()
        server.remote.start()
        yield
        await server.close()

    app = FastAPI(title="foretell", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.foretell = server
    app.add_exception_handler(APIError, api_error_handler)
    app.add_exception_handler(HTTPException, http_error_handler)
    app.add_middleware(GuardMiddleware, settings=settings, metrics=server.metrics)
    app.add_middleware(AccessLogMiddleware)  # outside the guard: one foretell.access line per request
    for router in (*first_routers, *ROUTERS):
        app.include_router(router)
    return app
