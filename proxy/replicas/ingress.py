"""The HTTP entry of ``foretell serve --replicas N``: Serve's proxy hands it every request.

Generation requests for the local model go to an engine replica, with the prompt's leading
block hashes as the router's hint (``routing.py``); requests for models routed upstream are
answered here, by the same app a single server runs (without a model of its own), so no replica's
engine waits on them; everything else (models, tokenize, playground) goes to any replica.
``/health`` and ``/metrics`` answer for all replicas at once. A replica that dies before
answering is retried on another; one that dies mid-stream ends the stream with an error event
the client can retry on."""

from __future__ import annotations

import asyncio
import json
import logging

from ray import exceptions as ray_exceptions
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from foretell.proxy.replicas.asgi_call import ForwardedRequest, ResponseStart, call_app
from foretell.proxy.replicas.cluster_metrics import merge_metrics
from foretell.proxy.replicas.routers import replica_stats
from foretell.proxy.replicas.routing import GENERATION_PATHS, prompt_hint
from foretell.proxy.server import ServerSettings, create_app
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.guard import error_response
from foretell.proxy.server.responses import DONE, sse

log = logging.getLogger("foretell.ingress")

# What dying replicas raise to the caller of a deployment handle.
REPLICA_GONE = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)


def _no_local_model(metrics):
    raise RuntimeError("the local model runs on the replicas")


def replica_failed() -> APIError:
    return APIError(503, "the replica answering this request stopped; retry it", type="server_error",
                    code="replica_failed", headers={"Retry-After": "1"})


class Ingress:
    """A Serve deployment class (``launch.py`` applies the options and binds ``engines``, the
    handle of the ``EngineReplica`` deployment)."""

    async def __init__(self, settings: ServerSettings, engines):
        self.settings = settings
        self.engines = engines
        # Upstream routes, remote verification, /health and /metrics for all replicas, behind the
        # single server's checks (Host, key, body), access log and error shapes: its app.
        self.app = create_app(settings, load_local=_no_local_model, first_routers=[self._status_router()])
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()
        described = await engines.describe.remote()  # waits for a replica, and starts the router
        self.model, self.block_size = described["model"], described["block_size"]
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer)

    def _load_tokenizer(self):
        from foretell.proxy.engine.model_loader import resolve_model_folder, shared_tokenizer

        return shared_tokenizer(resolve_model_folder(self.settings.model)[1])

    def _status_router(self) -> APIRouter:
        router = APIRouter()
        router.add_api_route("/health", self._health, methods=["GET"])
        router.add_api_route("/metrics", self._metrics, methods=["GET"])
        return router

    async def __call__(self, request: Request) -> Response:
        path = request.url.path
        forwarded = ForwardedRequest(
            method=request.method, path=path, query_string=request.url.query.encode(),
            headers=list(request.headers.raw), body=await self._read_body(request),
            client=(request.client.host, request.client.port) if request.client else None,
            server=(self.settings.host, 0))
        if path in ("/health", "/metrics"):
            return await _respond(call_app(self.app, forwarded))
        if request.method == "POST" and path in GENERATION_PATHS:
            body = _json(forwarded.body)
            route = self.settings.routes.route_for(body.get("model"), self._local_names()) \
                if isinstance(body.get("model"), str) else None
            if route is not None and not route.local:
                return await _respond(call_app(self.app, forwarded))
            forwarded.block_hashes = await asyncio.to_thread(prompt_hint, self.tokenizer, path, body,
                                                             self.block_size)
        return await self._on_replica(forwarded)

    def _local_names(self) -> set[str]:
        return {self.model} | ({self.settings.served_model_name} if self.settings.served_model_name else set())

    async def _read_body(self, request: Request) -> bytes:
        """The body, cut one byte past the limit: the replica's guard answers 413 for it, as a
        single server does, and a huge body is never held here whole."""
        limit, parts, size = self.settings.max_body_bytes + 1, [], 0
        async for chunk in request.stream():
            parts.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
        return b"".join(parts)[:limit]

    async def _on_replica(self, forwarded: ForwardedRequest) -> Response:
        """Answered by a replica; one that dies before answering is replaced by another, once."""
        for attempt in (1, 2):
            parts = self.engines.options(stream=True).handle.remote(forwarded)
            try:
                start = await parts.__anext__()
            except REPLICA_GONE as error:
                log.warning("a replica stopped before answering (attempt %d): %s", attempt, error)
                continue
            except StopAsyncIteration:
                break
            except asyncio.CancelledError:  # the client left while the replica worked
                parts.cancel()
                raise
            return _streamed(start, parts)
        return error_response(replica_failed())

    async def _health(self) -> Response:
        stats = replica_stats()
        body = {"status": "ok" if stats else "loading", "model": self.model, "replicas": len(stats),
                "running": sum(s.get("running", 0) for s in stats.values()),
                "waiting": sum(s.get("waiting", 0) for s in stats.values())}
        return JSONResponse(body, status_code=200 if stats else 503)

    async def _metrics(self) -> Response:
        """This process's metrics (its upstream routes, its checks) and every replica's, each
        labelled by replica, with the load gauges summed."""
        merged = merge_metrics(self.model, self.app.state.foretell.metrics.render().decode(), replica_stats())
        return Response(merged, media_type="text/plain; version=0.0.4")


def _json(body: bytes) -> dict:
    try:
        value = json.loads(body)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


async def _respond(parts) -> Response:
    start = await parts.__anext__()
    return _streamed(start, parts)


def _streamed(start: ResponseStart, parts) -> StreamingResponse:
    """The answer as it comes: the replica's status and headers, then its chunks. A stream whose
    replica dies ends with an error event and [DONE] (its status line is long sent)."""
    is_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in start.headers)

    async def body():
        finished = False
        try:
            async for chunk in parts:
                yield chunk
            finished = True
        except REPLICA_GONE as error:
            log.warning("a replica stopped mid-answer: %s", error)
            if is_stream:
                yield sse(replica_failed().body())
                yield DONE
            finished = True
        finally:
            if not finished and hasattr(parts, "cancel"):
                parts.cancel()  # the client went away: the replica stops generating for it

    response = StreamingResponse(body(), status_code=start.status)
    response.raw_headers = list(start.headers)
    return response
