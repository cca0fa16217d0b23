"""One replica: one engine on its own accelerator (or CPU share), behind the same app a single
``foretell serve`` runs. The ingress hands it whole HTTP requests (``asgi_call.py``); it reports
its load to the routers every second (``record_routing_stats``)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import ray

from foretell.proxy.replicas.asgi_call import ForwardedRequest, ResponseStart, call_app
from foretell.proxy.server import ServerSettings, create_app

log = logging.getLogger("foretell.replica")


class EngineReplica:
    """A Serve deployment class (``launch.py`` applies the options): ready once its model has
    loaded, so no request reaches a replica that is still loading."""

    async def __init__(self, settings: ServerSettings):
        self.app = create_app(settings)
        self.server = self.app.state.foretell
        self.lifespan = self.app.router.lifespan_context(self.app)
        await self.lifespan.__aenter__()  # starts the model's load on a thread
        started = time.monotonic()
        while self.server.local is None:
            if self.server.load_error:
                raise RuntimeError(f"the model did not load: {self.server.load_error}")
            await asyncio.sleep(0.1)
        self.name = ray.get_runtime_context().get_actor_name() or "replica"
        log.info("replica %s ready in %.1f s", self.name, time.monotonic() - started)

    def describe(self) -> dict:
        """What the ingress needs to know of the model: its name, and the KV-cache block the
        routing hint hashes by."""
        local = self.server.local
        return {"model": local.name, "block_size": local.scheduler.engine.cache.block_size}

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[ResponseStart | bytes]:
        """The app's answer to ``request``: its start, then its body chunks."""
        async for part in call_app(self.app, request):
            yield part

    def record_routing_stats(self) -> dict:
        """Load and metrics, reported to the routers (and through them to the ingress's /metrics)."""
        local, metrics = self.server.local, self.server.metrics
        scheduler = local.scheduler
        waiting, running, usage = scheduler.queued, scheduler.running, scheduler.engine.cache.usage()
        metrics.record_load(local.name, waiting, running, usage)
        return {"name": self.name, "model": local.name, "waiting": waiting, "running": running,
                "kv_cache_usage": usage, "metrics": metrics.render().decode()}

    def check_health(self) -> None:
        """Serve restarts a replica whose engine stopped (its scheduler thread ended)."""
        if not self.server.local.scheduler.alive:
            raise RuntimeError("the engine's scheduler thread has stopped")
