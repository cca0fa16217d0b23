"""The server's logs: one access line per request, and the format and level of everything.

Loggers:
- ``foretell.access``: one line per request (``AccessLogMiddleware``): request id, method, path,
  model, route (``local`` or the upstream's name), status, prompt / completion / cached tokens,
  accepted / rejected prediction tokens, target passes, tokens per second, duration. Never a
  prompt, a message, a prediction, a header or a key: only the fields listed here.
- ``foretell.server``: the server's own lines (failed upstream calls, clients that hang up,
  tracebacks of bugs with their request id); ``foretell.engine``: loading and calibration.
- ``uvicorn.error``: uvicorn's start-up and errors, through the same handler. uvicorn's own
  access log is off (the access line above replaces it).

``configure_logging(level, fmt)`` sends all of them to stderr as text or as one JSON object a
line (``--log-format json``).
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
import time

ACCESS_LOGGER = "foretell.access"
SERVER_LOGGER = "foretell.server"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
FORMATS = ("text", "json")

access_log = logging.getLogger(ACCESS_LOGGER)

# The access line's fields, in order; all but the first five may be null.
ACCESS_FIELDS = ("request_id", "method", "path", "status", "duration_ms", "model", "route",
                 "prompt_tokens", "completion_tokens", "cached_tokens", "accepted_prediction_tokens",
                 "rejected_prediction_tokens", "target_passes", "tokens_per_second")
_SCOPE_KEY = "foretell.access"
MAX_MODEL_CHARS = 128  # the model name is the caller's string: bounded in the log


# ---- what the endpoints tell the access line ---------------------------------------------------------

def note(scope, **fields) -> None:
    """Record facts about the request for its access line (the model, the route)."""
    if "model" in fields and isinstance(fields["model"], str):
        fields["model"] = fields["model"][:MAX_MODEL_CHARS]
    scope.setdefault(_SCOPE_KEY, {}).update(fields)


def note_result(scope, stats) -> None:
    """Add a finished choice's counts, its ``GenerationStats`` (``n > 1`` choices add up; tok/s
    over the slowest): the local engine's and remote verification's alike."""
    noted = scope.setdefault(_SCOPE_KEY, {})
    noted["prompt_tokens"] = stats.prompt_tokens
    noted["cached_tokens"] = stats.cached_tokens
    for name, value in (("completion_tokens", stats.completion_tokens),
                        ("accepted_prediction_tokens", stats.accepted_prediction_tokens),
                        ("rejected_prediction_tokens", stats.rejected_prediction_tokens),
                        ("target_passes", stats.target_passes)):
        noted[name] = (noted.get(name) or 0) + value
    noted["_decode_seconds"] = max(noted.get("_decode_seconds", 0.0), stats.decode_seconds)
    seconds = noted["_decode_seconds"]
    noted["tokens_per_second"] = round(noted["completion_tokens"] / seconds, 2) if seconds > 0 else None


# ---- the access line ----------------------------------------------------------------------------------

class AccessLogMiddleware:
    """Writes one ``foretell.access`` line when a request's response has been sent (a stream:
    when it ends). Outside ``GuardMiddleware``, whose request id it reads from the scope."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = time.perf_counter()
        status = {"code": None}

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # No response at all: the client went away before one was due (499, as nginx).
            self.write(scope, status["code"] or 499, time.perf_counter() - started)

    @staticmethod
    def write(scope, status: int, seconds: float) -> None:
        if not access_log.isEnabledFor(logging.INFO):
            return
        noted = scope.get(_SCOPE_KEY, {})
        fields = {"request_id": scope.get("foretell.request_id"), "method": scope["method"],
                  "path": scope["path"], "status": status, "duration_ms": round(1000 * seconds, 1)}
        fields.update({name: noted.get(name) for name in ACCESS_FIELDS[5:]})
        shown = " ".join(f"{name}={value}" for name, value in fields.items()
                         if value is not None and name not in ACCESS_FIELDS[:5])
        access_log.info("%s %s %s %s %.0fms%s", fields["request_id"], fields["method"], fields["path"],
                        status, fields["duration_ms"], " " + shown if shown else "",
                        extra={"access": fields})


# ---- formats ------------------------------------------------------------------------------------------

class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, the access fields (access lines),
    the traceback (``exc_info``) when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
                    .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(getattr(record, "access", None) or {})
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exc_info"] = record.exc_text
        return json.dumps(entry, ensure_ascii=False, default=str)


TEXT_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


class _ForetellHandler(logging.StreamHandler):
    """The handler ``configure_logging`` installs (a class of its own, so it is replaced, not
    added twice)."""


def configure_logging(level: str = "info", fmt: str = "text", stream=None) -> None:
    """Send foretell's and uvicorn's logs to ``stream`` (stderr) at ``level``, as ``fmt``."""
    if level not in LEVELS or fmt not in FORMATS:
        raise ValueError(f"log level {level!r} or format {fmt!r} unknown")
    handler = _ForetellHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _ForetellHandler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    # Other libraries' records (httpx, asyncio, warnings) from WARNING up; ours at the level asked.
    root.setLevel(max(LEVELS[level], logging.WARNING))
    for name in ("foretell", "uvicorn", "uvicorn.error"):
        logger = logging.getLogger(name)
        logger.setLevel(LEVELS[level])
        logger.handlers = [h for h in logger.handlers if not isinstance(h, logging.StreamHandler)]
        logger.propagate = True
    access = logging.getLogger("uvicorn.access")  # replaced by foretell.access
    access.handlers, access.propagate, access.disabled = [], False, True
    logging.captureWarnings(True)
    # transformers writes through a handler of its own, and draws progress bars on stderr.
    try:
        from transformers.utils import logging as transformers_logging
    except ImportError:  # pragma: no cover - the proxy extra brings it
        transformers_logging = None
    if transformers_logging is not None:
        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()
        if fmt == "json":
            transformers_logging.disable_progress_bar()
    # Loading and calibration lines go to the log too, rather than printed on stderr.
    from foretell.proxy.engine import model_loader

    model_loader.progress_logger = logging.getLogger("foretell.engine")
