"""Routes and forwarding: models not served locally go to an OpenAI-compatible upstream.

Base URLs and keys come only from the server's configuration file and environment, never from
the request. The client's credentials are replaced by the route's key; keys never appear in
errors or logs, and every route key is redacted from whatever an upstream answers (bodies,
stream events, headers) before it is relayed. Streaming stays streaming (whole events are passed
on as they arrive); a stream that breaks off ends with an error event. Retries with backoff
happen only before any byte of a response has arrived; redirects are relayed, never followed.

Configuration file (TOML), see ``examples/foretell.toml``::

    [upstreams.openai]
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"
    supports_prediction = true

    [models."gpt-4o-mini"]
    upstream = "openai"

    [models."gemma-3-270m"]
    local = true
    fallback = "openai"        # used when the local queue is full

``FORETELL_UPSTREAM_BASE_URL`` / ``FORETELL_UPSTREAM_API_KEY`` set a default upstream for every
model not named in the file.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from foretell.proxy.options import PRECISION_KEYS, PRECISION_OPTIONS
from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.redact import Redactor

log = logging.getLogger("foretell.server")

# Body fields that are foretell's own and never go upstream.
LOCAL_ONLY_FIELDS = ("speculation",)
# Upstream response headers the client gets (redacted); the rest describe the upstream's own
# connection and encoding, or are none of the client's business.
RELAYED_HEADERS = ("location", "retry-after", "retry-after-ms")
# A server-sent event ends with a blank line, whatever the line endings.
EVENT_ENDS = (b"\n\n", b"\r\n\r\n", b"\r\r")
# An unfinished event longer than this is relayed without waiting for its end.
MAX_HELD_EVENT = 64 * 1024
# How much of a failed upstream's body is read to quote from.
MAX_ERROR_BODY = 64 * 1024


@dataclass(frozen=True)
class Upstream:
    name: str
    base_url: str
    api_key_env: str | None = None
    api_key: str | None = field(default=None, repr=False)  # only from FORETELL_UPSTREAM_API_KEY
    supports_prediction: bool = False
    timeout_seconds: float = 60.0
    connect_timeout_seconds: float = 10.0
    max_retries: int = 2
    # Remote verification of predictions through echo requests (see remote_verify/): "off"
    # (the default), "echo" (on), "auto" (on when a probe at start-up finds echo with prompt
    # logprobs). Each verify re-sends the whole context: never on for an upstream that bills
    # per prompt token unless you mean it.
    verify_predictions: str = "off"
    # A local tokenizer matching the upstream's model (a Hugging Face folder, a .gguf file, or
    # "gemma-3-270m"): exact token ids, chat requests (its chat template), token counts.
    tokenizer: str | None = None
    # Verify whenever a draft is available, without weighing an echo request's measured cost
    # against plain decoding (for an upstream whose prefill is known to be cheap).
    verify_always: bool = False

    def key(self) -> str | None:
        if self.api_key is not None:
            return self.api_key
        return os.environ.get(self.api_key_env) if self.api_key_env else None


@dataclass(frozen=True)
class ModelRoute:
    local: bool = False
    upstream: str | None = None
    fallback: str | None = None  # upstream to use when the local queue is full
    # A local route's precision (dtype, quantize, fp32_head), as --dtype etc. would set it.
    precision: tuple[tuple[str, object], ...] = ()


@dataclass
class RouteTable:
    upstreams: dict[str, Upstream] = field(default_factory=dict)
    models: dict[str, ModelRoute] = field(default_factory=dict)
    default_upstream: str | None = None

    def keys(self) -> list[str]:
        """Every configured upstream key (to redact from what upstreams answer)."""
        return [key for upstream in self.upstreams.values() if (key := upstream.key())]

    def local_precision(self) -> dict:
        """The precision the local routes set (one local model: they must agree)."""
        merged: dict = {}
        for model, route in self.models.items():
            for key, value in route.precision:
                if merged.setdefault(key, value) != value:
                    raise ValueError(f"model {model!r}: {key} = {value!r} differs from another local "
                                     f"route's {merged[key]!r} (one local model, one precision)")
        return merged

    def route_for(self, model: str, local_names: set[str]) -> ModelRoute | None:
        if model in self.models:
            return self.models[model]
        if model in local_names:
            return ModelRoute(local=True)
        if self.default_upstream:
            return ModelRoute(upstream=self.default_upstream)
        return None


def load_routes(config_path: str | None, environ=os.environ) -> RouteTable:
    """Read the configuration file (if any) and the default-upstream environment variables."""
    table = RouteTable()
    if config_path:
        path = Path(config_path)
        try:
            data = tomllib.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"config file {config_path} does not exist") from None
        except tomllib.TOMLDecodeError as error:
            raise ValueError(f"config file {config_path} is not valid TOML: {error}") from None
        for name, spec in data.get("upstreams", {}).items():
            unknown = set(spec) - {"base_url", "api_key_env", "supports_prediction", "timeout_seconds",
                                   "connect_timeout_seconds", "max_retries", "verify_predictions", "tokenizer",
                                   "verify_always"}
            if unknown or "base_url" not in spec:
                raise ValueError(f"upstream {name!r}: needs base_url; unknown keys {sorted(unknown)}")
            _check_verify_mode(spec.get("verify_predictions", "off"), f"upstream {name!r}: verify_predictions")
            table.upstreams[name] = Upstream(name=name, **spec)
        for model, spec in data.get("models", {}).items():
            unknown = set(spec) - {"local", "upstream", "fallback", *PRECISION_KEYS}
            if unknown:
                raise ValueError(f"model {model!r}: unknown keys {sorted(unknown)}")
            route = ModelRoute(local=bool(spec.get("local", False)), upstream=spec.get("upstream"),
                               fallback=spec.get("fallback"), precision=_local_precision(model, spec))
            for ref in (route.upstream, route.fallback):
                if ref is not None and ref not in table.upstreams:
                    raise ValueError(f"model {model!r} names unknown upstream {ref!r}")
            if not route.local and route.upstream is None:
                raise ValueError(f"model {model!r}: set local = true or upstream = NAME")
            table.models[model] = route
    base_url = environ.get("FORETELL_UPSTREAM_BASE_URL")
    if base_url:
        verify = _check_verify_mode(environ.get("FORETELL_UPSTREAM_VERIFY", "off"), "FORETELL_UPSTREAM_VERIFY")
        # An upstream verified remotely is one that drops `prediction`: native support is then
        # off unless FORETELL_UPSTREAM_SUPPORTS_PREDICTION=1 says otherwise (it would win).
        native = environ.get("FORETELL_UPSTREAM_SUPPORTS_PREDICTION", "1" if verify == "off" else "0")
        table.upstreams.setdefault("default", Upstream(
            name="default", base_url=base_url, api_key=environ.get("FORETELL_UPSTREAM_API_KEY"),
            supports_prediction=native != "0", verify_predictions=verify,
            tokenizer=environ.get("FORETELL_UPSTREAM_TOKENIZER") or None))
        table.default_upstream = "default"
    return table


VERIFY_MODES = ("off", "echo", "auto")


def _local_precision(model: str, spec: dict) -> tuple[tuple[str, object], ...]:
    """A route's dtype / quantize / fp32_head / kernels / draft_model, checked: they apply to the
    local model only."""
    given = [(key, spec[key]) for key in PRECISION_KEYS if key in spec]
    if given and not spec.get("local", False):
        raise ValueError(f"model {model!r}: {', '.join(k for k, _ in given)} apply to a local model "
                         "(local = true) only")
    for key, value in given:
        option = PRECISION_OPTIONS[key]
        if option.kind == "text":
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"model {model!r}: {key} must be a non-empty string, got {value!r}")
            continue
        choices = option.choices if option.kind == "choice" else (True, False)
        if not any(type(value) is type(choice) and value == choice for choice in choices):  # 1 is no True
            raise ValueError(f"model {model!r}: {key} must be one of "
                             f"{', '.join(str(c).lower() for c in choices)}, got {value!r}")
    return tuple(given)


def _check_verify_mode(value, where: str) -> str:
    if value not in VERIFY_MODES:
        raise ValueError(f"{where} must be one of {', '.join(VERIFY_MODES)}, not {value!r}")
    return value


def prepare_body(body: dict, upstream: Upstream) -> tuple[dict, list[str]]:
    """The body to send upstream, and notes for the client about what was dropped."""
    body = {k: v for k, v in body.items() if k not in LOCAL_ONLY_FIELDS}
    notes = []
    if "prediction" in body and not upstream.supports_prediction:
        del body["prediction"]
        notes.append(f"prediction dropped: upstream {upstream.name!r} does not support predicted outputs")
    return body, notes


class Forwarder:
    """Sends requests to upstreams with one shared connection pool."""

    def __init__(self):
        # A redirect goes back to the client as it is: following it would send the route's key
        # to wherever the upstream points.
        self.client = httpx.AsyncClient(follow_redirects=False)

    async def close(self) -> None:
        await self.client.aclose()

    async def open(self, upstream: Upstream, path: str, body: dict) -> httpx.Response:
        """Send the request and return the response with its body not yet read.

        Retries (exponential backoff with jitter) only when no response arrived at all.
        Raises APIError 502 (unreachable) or 504 (timed out).
        """
        url = upstream.base_url.rstrip("/") + path
        # Plain bytes: a compressed stream would have to be decoded before it can be relayed
        # (and redacted) event by event anyway.
        headers = {"content-type": "application/json", "accept": "application/json, text/event-stream",
                   "accept-encoding": "identity"}
        key = upstream.key()
        if key:
            headers["authorization"] = f"Bearer {key}"
        timeout = httpx.Timeout(upstream.timeout_seconds, connect=upstream.connect_timeout_seconds)
        attempt = 0
        while True:
            request = self.client.build_request("POST", url, json=body, headers=headers, timeout=timeout)
            try:
                return await self.client.send(request, stream=True)
            except httpx.TimeoutException:
                failure = APIError(504, f"upstream {upstream.name!r} timed out", type="upstream_error",
                                   code="upstream_timeout")
            except httpx.TransportError as error:
                # The message names the host and the error class only: never headers or keys.
                failure = APIError(502, f"upstream {upstream.name!r} unreachable: {type(error).__name__}",
                                   type="upstream_error", code="upstream_unreachable")
            if attempt >= upstream.max_retries:
                raise failure
            await asyncio.sleep(min(4.0, 0.2 * 2 ** attempt) * (0.5 + random.random()))
            attempt += 1


async def relay(response: httpx.Response, upstream: Upstream, *, stream: bool, notes: list[str],
                redactor: Redactor, request_id: str) -> Response:
    """The client's answer from an upstream's response (its body not yet read).

    Raises APIError 502 when the upstream failed (5xx, or its body broke off)."""
    headers = {"x-foretell-upstream": upstream.name}
    for name in RELAYED_HEADERS:
        if name in response.headers:
            headers[name] = redactor.text(response.headers[name])
    if notes:
        headers["x-foretell-note"] = "; ".join(notes)
    if response.status_code >= 500:
        try:
            detail = redactor.bytes(await _read_some(response, MAX_ERROR_BODY)).decode("utf-8", "replace")
        except httpx.HTTPError:
            detail = ""
        finally:
            await response.aclose()
        raise APIError(502, f"upstream {upstream.name!r} answered {response.status_code}: {detail[:500]}",
                       type="upstream_error", code="upstream_error")
    content_type = redactor.text(response.headers.get("content-type", "application/json"))
    if stream and response.status_code < 400 and "text/event-stream" in content_type:
        return StreamingResponse(relay_events(response, upstream.name, redactor, request_id),
                                 status_code=response.status_code, media_type="text/event-stream",
                                 headers=headers, background=BackgroundTask(response.aclose))
    try:
        raw = redactor.bytes(await response.aread())  # decoded, whatever the upstream compressed
    except httpx.HTTPError as error:
        raise APIError(502, f"upstream {upstream.name!r} broke off its answer: {type(error).__name__}",
                       type="upstream_error", code="upstream_error") from None
    finally:
        await response.aclose()
    if notes and response.status_code < 400:
        try:
            payload = json.loads(raw)
            payload.setdefault("foretell", {})["notes"] = notes
            raw = json.dumps(payload).encode()
        except (ValueError, AttributeError):  # not JSON, or not an object
            pass
    return Response(raw, status_code=response.status_code, media_type=content_type, headers=headers)


async def relay_events(response: httpx.Response, name: str, redactor: Redactor, request_id: str):
    """An upstream's event stream, decoded and redacted, passed on event by event.

    Whole events only: a key never spans the blank line that ends an event, and a stream that
    breaks off leaves no half event for the client to choke on; it ends with an error event and
    ``[DONE]``, as a local generation that fails."""
    pending = b""
    try:
        async for chunk in response.aiter_bytes():
            pending += chunk
            cut = max((pending.rfind(end) + len(end) for end in EVENT_ENDS if end in pending), default=0)
            if not cut and len(pending) > MAX_HELD_EVENT:
                cut = len(pending) - redactor.held_back(pending)
            if cut:
                yield redactor.bytes(pending[:cut])
                pending = pending[cut:]
    except httpx.HTTPError as error:
        log.warning("%s: upstream %r broke off its stream: %s", request_id, name, type(error).__name__)
        failure = APIError(502, f"upstream {name!r} broke off the stream: {type(error).__name__}",
                           type="upstream_error", code="upstream_error")
        yield b"data: " + json.dumps(failure.body()).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"
        return
    if pending:
        yield redactor.bytes(pending)


async def _read_some(response: httpx.Response, limit: int) -> bytes:
    data = b""
    async for chunk in response.aiter_bytes():
        data += chunk
        if len(data) >= limit:
            break
    return data
