"""What the server serves and how it is doing: ``GET /health`` (503 while the model loads),
``GET /metrics`` (Prometheus) and ``GET /v1/models``."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from foretell.proxy.server.state import Server

router = APIRouter()


@router.get("/health")
async def health(server: Server):
    if server.local is not None:
        local = server.local
        return {"status": "ok", "model": local.name, "precision": local.precision,
                "batch_invariant": local.batch_invariant, "native_loops": local.native_loops,
                "cpu": local.cpu, "kernels": local.kernels,
                "draft_model": local.draft_model}
    if server.load_error:
        return JSONResponse({"status": "error", "error": server.load_error}, status_code=503)
    return JSONResponse({"status": "loading"}, status_code=503)


@router.get("/metrics")
async def prometheus(server: Server):
    local, metrics = server.local, server.metrics
    if local is not None:
        scheduler = local.scheduler
        metrics.record_load(local.name, scheduler.queued, scheduler.running, scheduler.engine.cache.usage())
    return Response(metrics.render(), media_type="text/plain; version=0.0.4")


@router.get("/v1/models")
async def models(server: Server):
    names = [server.local.name] if server.local is not None else []
    names += [model for model in server.settings.routes.models if model not in names]
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "foretell"} for name in names]}
