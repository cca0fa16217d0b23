"""``foretell serve`` as a subprocess on 127.0.0.1, the one spawn-and-poll helper, for tests that
need the real process: its output goes to a log file the test can read, and its process id lets
a test watch its memory. (A server in the test process is tests/serving.py.)"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from harness.upstream_stub import free_port


@dataclass
class LiveServer:
    base: str
    port: int
    process: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def status(self, field: str) -> int:
        """A line of /proc/PID/status in kB (VmRSS, VmHWM)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)


@contextlib.contextmanager
def live_server(model_folder, log_path: Path, *args: str, env: dict | None = None, unset=(),
                timeout: float = 180):
    """``foretell serve --model MODEL_FOLDER --no-calibrate ARGS`` (the embedded model when
    ``model_folder`` is None) on a free port, healthy; ``unset``: environment variables removed."""
    port = free_port()
    environment = dict(os.environ, HF_HUB_OFFLINE="1", **(env or {}))
    for name in ("FORETELL_API_KEY", "FORETELL_ALLOWED_HOSTS", "FORETELL_METRICS_PUBLIC", "FORETELL_CONFIG",
                 "FORETELL_UPSTREAM_BASE_URL", *unset):
        if name not in (env or {}):
            environment.pop(name, None)
    model = [] if model_folder is None else ["--model", str(model_folder)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "foretell.cli", "serve", *model, "--port", str(port), "--no-calibrate", *args],
            env=environment, stdout=log, stderr=subprocess.STDOUT)
    server = LiveServer(f"http://127.0.0.1:{port}", port, process, log_path)
    try:
        deadline = time.time() + timeout
        # One client for the whole wait: each new httpx client builds an SSL context (~40 ms of
        # CPU, even for http://), which polled ten times a second took a third of a core from the
        # server starting beside it.
        with httpx.Client(timeout=2) as poll:
            while True:
                if process.poll() is not None:
                    raise RuntimeError("foretell serve exited:\n" + server.log())
                with contextlib.suppress(httpx.TransportError):
                    if poll.get(server.base + "/health").status_code == 200:
                        break
                if time.time() > deadline:
                    raise RuntimeError("foretell serve did not become healthy:\n" + server.log())
                time.sleep(0.1)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
