"""Servers inside the test process: an ASGI app under uvicorn on a thread, listening on a real
socket on 127.0.0.1, so tests (and the commands they run) reach it over real HTTP without paying
for a ``foretell serve`` process (torch, transformers and a model load each time).

``tiny_app(folder, ...)`` is ``foretell serve --model FOLDER --no-calibrate`` in float32 (the
suite's exactness oracle, as tests/conftest.py sets for commands) with ``ServerSettings`` fields
for the options; ``route_table(toml)`` is ``--config``. ``foretell serve`` as a process, for what
only a process shows (its stderr, its memory, an event loop to itself), is harness/live_server.py."""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time

import httpx
import uvicorn


class ServedApp:
    """``app`` on 127.0.0.1 at a port of its own, on a daemon thread; a context manager."""

    def __init__(self, app, name: str = "app"):
        self.app = app
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base = f"http://127.0.0.1:{self.port}"
        # No log_config: uvicorn leaves the logging setup alone (pytest's capture included).
        self.server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, lifespan="on",
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name=f"uvicorn-{name}", daemon=True)

    def __enter__(self) -> ServedApp:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.01)
        return self

    def wait_healthy(self, timeout: float = 120.0, while_loading=None) -> ServedApp:
        """Wait for /health 200; ``while_loading(self)`` runs once if a 503 is seen first. A
        load that failed fails here at once."""
        deadline = time.monotonic() + timeout
        called = False
        # One client for the wait (each new httpx client builds an SSL context, ~40 ms of CPU).
        with httpx.Client(timeout=10) as poll:
            while True:
                try:
                    health = poll.get(self.base + "/health")
                except httpx.TimeoutException:
                    # Another in-process server loading its model on a busy machine can hold the GIL
                    # for seconds: the poll waits again, until the deadline.
                    if time.monotonic() > deadline:
                        raise
                    continue
                if health.status_code == 200:
                    return self
                if health.json().get("status") == "error":
                    raise RuntimeError(f"the in-process server's model did not load: {health.text}")
                if health.status_code == 503 and while_loading is not None and not called:
                    called = True
                    while_loading(self)
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the in-process server never became healthy: {health.text}")
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def tiny_app(folder, *, served_model_name: str = "tiny", **settings):
    """The app ``foretell serve --model FOLDER --no-calibrate --no-grammar-warmup`` builds, in float32."""
    from foretell.proxy.server.app import ServerSettings, create_app

    settings.setdefault("dtype", "float32")
    settings.setdefault("calibrate", False)
    # As --no-grammar-warmup: a test server builds structured output's table only if it is used.
    settings.setdefault("grammar_warmup", False)
    return create_app(ServerSettings(model=str(folder), served_model_name=served_model_name, **settings))


def route_table(toml_text: str, folder):
    """The routes ``--config`` would load from a file holding ``toml_text``."""
    from foretell.proxy.server.upstream import load_routes

    path = folder / "foretell.toml"
    path.write_text(toml_text)
    return load_routes(str(path))


@contextlib.contextmanager
def serve(app, name: str = "app", *, healthy: bool = True):
    """``app`` served on a thread for the ``with`` block (healthy first unless told otherwise).

    One model load at a time in this process: transformers' loading sets process-wide state
    (the default device while weights are made), so two loads on two threads at once can leave
    meta tensors behind for every later load. Start an app once the one before is healthy."""
    with ServedApp(app, name) as served:
        if healthy:
            served.wait_healthy()
        yield served


class LogRecords(logging.Handler):
    """The log of an in-process server, as ``foretell serve`` would write it: every record that
    reaches the root logger while capturing (foretell's at INFO and up, as the command logs),
    but those of the stub upstream's threads (harness/upstream_stub.py), which share
    uvicorn's logger names."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if not record.threadName.startswith("stub-"):
            self.records.append(record)

    def text(self) -> str:
        return "\n".join(self.format(r) for r in list(self.records))

    def __enter__(self) -> LogRecords:
        self.foretell = logging.getLogger("foretell")
        self.previous = self.foretell.level
        self.foretell.setLevel(logging.INFO)
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger().removeHandler(self)
        self.foretell.setLevel(self.previous)
