"""What the routes share: one ``ServerState`` on ``app.state``, reaching handlers through the
``Server`` dependency (``server: Server`` in a handler's parameters)."""

from __future__ import annotations

import asyncio
import gc
from typing import Annotated

from fastapi import Depends, Request

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.local_model import LocalModel
from foretell.proxy.server.metrics import Metrics
from foretell.proxy.server.remote_verify import RemoteVerifier
from foretell.proxy.server.settings import ServerSettings
from foretell.proxy.server.upstream import Forwarder

# Prompts tokenised at once (on worker threads): the body limit bounds each one's size, this
# bounds their number, so a burst of huge prompts cannot take every core before the queue.
MAX_PROMPTS_IN_PREPARATION = 2


class ServerState:
    """The settings, the metrics, the upstream forwarder, the remote verifier, the slots for
    preparing prompts, and the local model once loaded (or why it did not load)."""

    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.metrics = Metrics()
        self.forwarder = Forwarder()
        self.remote = RemoteVerifier(settings, self.forwarder, self.metrics)  # predictions verified by upstreams
        self.prompt_slots = asyncio.Semaphore(MAX_PROMPTS_IN_PREPARATION)
        self.local: LocalModel | None = None
        self.load_error: str | None = None

    def load(self, load_local) -> None:
        """Run ``load_local(metrics)`` (on a background thread) and keep its model or its error."""
        try:
            local = load_local(self.metrics)
            self.metrics.record_kernels(local.kernels)
            self.local = local  # /health turns 200 here, with everything recorded
        except Exception as error:  # reported by /health, the server stays up
            self.load_error = f"{type(error).__name__}: {error}"
        # torch, transformers and the model are hundreds of thousands of objects that live as
        # long as the server: out of the garbage collector's full passes, which would otherwise
        # walk them all (half a second, the GIL held, the event loop stalled) whenever a large
        # request's objects set one off.
        gc.freeze()

    async def close(self) -> None:
        await self.remote.close()
        if self.local is not None:
            self.local.scheduler.close()
        await self.forwarder.close()
        # Hand what ``load`` froze back to the collector: frozen objects in reference cycles
        # (the model's modules, the engine and its scheduler) are never freed otherwise, so an app
        # built and closed inside a longer-lived process (tests, an embedding program) kept its
        # whole model, ~1.25 GiB for the embedded one in float32, for the rest of that process.
        self.local = None
        gc.unfreeze()

    def local_names(self) -> set[str]:
        """The model names the local model answers to (none known while it loads)."""
        names = {self.local.name} if self.local is not None else set()
        if self.settings.served_model_name:
            names.add(self.settings.served_model_name)
        return names

    def loaded(self) -> LocalModel:
        """The local model; APIError 503 (retry) while it loads."""
        if self.local is None:
            raise model_loading()
        return self.local


def model_loading() -> APIError:
    return APIError(503, "the model is still loading", type="server_error", code="model_loading",
                    headers={"Retry-After": "5"})


def server_state(request: Request) -> ServerState:
    return request.app.state.foretell


Server = Annotated[ServerState, Depends(server_state)]
