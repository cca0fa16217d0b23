"""What every request passes through before and after the endpoints (a plain ASGI middleware).

- The Host header must name this server (127.0.0.1, localhost, [::1], the --host address, or an
  --allowed-hosts entry): a web page that rebinds its own domain to 127.0.0.1 sends its domain.
- API keys on /v1/* (and /metrics unless --metrics-public).
- POST /v1/* must be JSON: a web page can send text/plain or form bodies to any address, but
  not JSON without asking first (a CORS preflight, which this server never grants).
- The body limit holds on any transfer encoding: bytes are counted as they arrive and the
  request is refused with 413 as soon as the limit is passed, never read whole first.
- Every response names its request (``x-request-id``) and is counted in the metrics; a client
  that hangs up mid-body is one log line, and an exception no endpoint caught is a 500 in
  OpenAI's envelope (logged once with its traceback), never a plain-text 500.

A plain ASGI middleware (not ``@app.middleware``), so that the endpoint's
``request.is_disconnected()`` sees the client hang up and can cancel its generation.
"""

from __future__ import annotations

import hmac
import logging
import uuid

from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from foretell import __version__
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.metrics import Metrics

log = logging.getLogger("foretell.server")

FORETELL_VERSION = __version__.encode()
# Each path the server serves has its own label in the metrics; any other is "other", so that
# a client probing random paths cannot grow the label set. The playground's three are
# routes/playground.py's FILES (not imported: routes/tokens.py imports this module).
KNOWN_PATHS = {"/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions",
               "/tokenize", "/detokenize", "/", "/static/playground.css", "/static/playground.js"}
LOOPBACK_NAMES = ("127.0.0.1", "localhost", "[::1]")


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


class GuardMiddleware:
    def __init__(self, app, settings, metrics: Metrics):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.hosts = allowed_hosts(settings.host, settings.allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        status = {"code": 500, "started": False}

        # Every response names its request (as OpenAI's x-request-id), so that clients can
        # quote it in errors and logs; a caller's own id is echoed back. x-foretell-version
        # tells clients (the SDK) that this server understands the ``speculation`` extension.
        request_id = _incoming_request_id(scope) or "req-" + uuid.uuid4().hex
        scope["foretell.request_id"] = request_id  # for the endpoints' own log lines

        async def send_and_note_status(message):
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode()),
                                                  (b"x-foretell-version", FORETELL_VERSION)]}
            await send(message)

        try:
            self.check(scope, path)
            await self.app(scope, self.limited(receive), send_and_note_status)
        except APIError as error:  # a check, or the body limit passed while the body was read
            if not status["started"]:
                await error_response(error)(scope, receive, send_and_note_status)
        except ClientDisconnect:
            log.info("%s: the client hung up before sending the whole body", request_id)
            status["code"] = 499
        except Exception:
            log.exception("%s: %s %s failed", request_id, scope["method"], path)
            if not status["started"]:
                error = APIError(500, f"internal error (request {request_id})", type="server_error")
                await error_response(error)(scope, receive, send_and_note_status)
        finally:
            self.metrics.requests.labels(path if path in KNOWN_PATHS else "other", str(status["code"])).inc()

    def check(self, scope, path: str) -> None:
        """The checks that need no body: Host, key, content type, declared length."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = headers.get("host")
        if self.hosts is not None and host is not None and not host_allowed(host, self.hosts):
            raise APIError(421, f"this server does not answer to the host {host!r}; start it with "
                                "--allowed-hosts naming it", code="host_not_allowed")
        if self.settings.api_keys and (path.startswith("/v1/")
                                       or (path == "/metrics" and not self.settings.metrics_public)):
            check_key(headers.get("authorization", ""), self.settings.api_keys)
        if scope["method"] == "POST" and path.startswith("/v1/"):
            media_type = headers.get("content-type", "").partition(";")[0].strip().lower()
            if media_type != "application/json":
                raise APIError(415, "send the body as JSON, with 'Content-Type: application/json'",
                               code="unsupported_media_type")
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.settings.max_body_bytes:
            raise self.too_large()

    def limited(self, receive):
        """``receive`` that counts the body's bytes as they arrive and raises 413 past the limit,
        whatever the transfer encoding (a chunked body declares no length)."""
        received = 0

        async def receive_within_limit():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.settings.max_body_bytes:
                    raise self.too_large()
            return message

        return receive_within_limit

    def too_large(self) -> APIError:
        return APIError(413, f"request body over {self.settings.max_body_bytes} bytes", code="body_too_large")


def allowed_hosts(host: str, extra: tuple[str, ...]) -> frozenset[str] | None:
    """The Host header values this server answers to; None: any ("*" in ``extra``)."""
    if "*" in extra:
        return None
    bound = f"[{host}]" if ":" in host and not host.startswith("[") else host  # an IPv6 address
    return frozenset(name.strip().lower() for name in (*LOOPBACK_NAMES, bound, *extra) if name.strip())


def host_allowed(header: str, hosts: frozenset[str]) -> bool:
    """An entry with a port must match the header whole; one without matches any port."""
    header = header.strip().lower()
    if header in hosts:
        return True
    name, colon, port = header.rpartition(":")
    return bool(colon) and port.isdigit() and not name.endswith(":") and name in hosts


def _incoming_request_id(scope) -> str | None:
    for key, value in scope["headers"]:
        if key.lower() == b"x-request-id":
            text = value.decode("latin-1")
            # Echo only a sane id: printable ASCII, bounded length.
            if 0 < len(text) <= 128 and text.isprintable() and text.isascii():
                return text
    return None


def check_key(header: str, keys: tuple[str, ...]) -> None:
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise APIError(401, "missing API key: send 'Authorization: Bearer <key>'",
                       type="authentication_error", code="invalid_api_key")
    # Compare against every key in constant time (no early exit on the first match).
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(token.encode(), key.encode())
    if not matched:
        raise APIError(401, "invalid API key", type="authentication_error", code="invalid_api_key")
