"""End-to-end fixtures: ``foretell serve`` as a process, started as a user starts it
(harness/live_server.py), for what only a process shows: its stderr, its memory, an event loop
that nothing else in the process competes with, the browser's page, the SDK and the examples
against the real model."""

from __future__ import annotations

import pytest

from harness.live_server import live_server
from harness.probes import API_KEY as KEY
from harness.probes import LIMIT, PREDICTION_LIMIT

# The tiny model's serve process (serve_process): one key (the probe table's), one upstream key,
# a 4 MB body limit.
WRONG_KEY = "sk-wrong-key-2718"
UPSTREAM_KEY = "upstream-e2e-secret-1618"


@pytest.fixture(scope="session")
def serve_process(tmp_path_factory, tiny_model_folder):
    """``foretell serve`` on the tiny model ("tiny") with ``--log-format json``, an API key, and
    routes "up-ok" (a stub upstream with a key from the environment) and "up-down" (nothing
    listening); its log is a file (``server.log()``)."""
    from harness.upstream_stub import StubServer, free_port

    folder = tmp_path_factory.mktemp("serve-process")
    config = folder / "foretell.toml"
    with StubServer() as stub:
        config.write_text(f"""
[upstreams.stub]
base_url = "{stub.base_url}"
api_key_env = "E2E_UPSTREAM_KEY"
max_retries = 0

[upstreams.down]
base_url = "http://127.0.0.1:{free_port()}/v1"
max_retries = 0

[models.up-ok]
upstream = "stub"
[models.up-down]
upstream = "down"
""")
        with live_server(tiny_model_folder, folder / "server.log", "--served-model-name", "tiny",
                         "--log-format", "json", "--api-key", KEY, "--config", str(config),
                         "--max-body-bytes", str(LIMIT), "--max-prediction-chars", str(PREDICTION_LIMIT),
                         env={"E2E_UPSTREAM_KEY": UPSTREAM_KEY}) as live:
            yield live


@pytest.fixture(scope="session")
def embedded_server(tmp_path_factory, embedded_folder):
    """``foretell serve`` with the embedded model at the product's default precision (bf16 with
    the fp32 head on a CPU with native bf16: these tests compare the server with itself,
    speculative against plain, as the README promises); yields its OpenAI base URL. The model is
    converted first, if it must be, under ``embedded_folder``'s lock."""
    log = tmp_path_factory.mktemp("embedded-serve") / "server.log"
    with live_server(None, log, "--log-level", "warning", unset=("FORETELL_DTYPE", "FORETELL_MODEL"),
                     timeout=300) as live:
        yield live.base + "/v1"
