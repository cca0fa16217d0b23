"""The SDK's exceptions and its warning class.

Every error that carries text from a request or a response is built through ``redact`` with the
client's API key, so the key never shows in ``str()``, ``repr()``, ``.message`` or ``.body``, not
even when a server echoes it back in its error message.
"""

from __future__ import annotations

from typing import Any, Iterable

REDACTED = "[redacted]"


class ForetellWarning(UserWarning):
    """Something was adjusted or looks risky, but the request can still go ahead (a field dropped
    for a server that does not understand it, a prediction OpenAI documents as unsupported)."""


class ForetellError(Exception):
    """Base class of every exception raised by ``foretell.sdk``."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class TokenizerUnavailableError(ForetellError):
    """tiktoken could not load an encoding (typically: no internet and no local cache)."""


class EditTruncatedError(ForetellError):
    """An edit stopped at max_tokens before the whole file was written. ``result`` holds the
    partial result (for its statistics); its text must not replace the file."""

    def __init__(self, message: str, result: Any):
        super().__init__(message)
        self.result = result


class APIConnectionError(ForetellError):
    """The server could not be reached, or the connection broke before the answer was complete."""

    def __init__(self, message: str, *, method: str | None = None, url: str | None = None):
        super().__init__(message)
        self.method, self.url = method, url


class APITimeoutError(APIConnectionError):
    """The request timed out (connecting, waiting for the answer, or between stream events)."""


class APIStatusError(ForetellError):
    """The server answered with an error status (or sent an error event inside a stream)."""

    status_code: int = 0

    def __init__(self, message: str, *, status_code: int, request_id: str | None = None,
                 type: str | None = None, code: Any = None, param: str | None = None,
                 body: Any = None, during_stream: bool = False):
        super().__init__(message)
        self.status_code = status_code
        self.request_id = request_id
        self.type, self.code, self.param = type, code, param
        self.body = body
        # True when the error arrived as an event after the stream had started (HTTP 200).
        self.during_stream = during_stream

    def __str__(self) -> str:
        parts = [f"{self.status_code}"]
        if self.type or self.code:
            parts.append("/".join(str(p) for p in (self.type, self.code) if p))
        where = f" (request {self.request_id})" if self.request_id else ""
        return f"[{' '.join(parts)}] {self.message}{where}"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(status_code={self.status_code}, "
                f"request_id={self.request_id!r}, message={self.message!r})")


class BadRequestError(APIStatusError):
    status_code = 400


class AuthenticationError(APIStatusError):
    status_code = 401


class PermissionDeniedError(APIStatusError):
    status_code = 403


class NotFoundError(APIStatusError):
    status_code = 404


class ConflictError(APIStatusError):
    status_code = 409


class RequestTooLargeError(APIStatusError):
    status_code = 413


class UnprocessableEntityError(APIStatusError):
    status_code = 422


class RateLimitError(APIStatusError):
    status_code = 429


class InternalServerError(APIStatusError):
    """Any 5xx answer."""

    status_code = 500


# Each class names its own status once (its ``status_code`` class attribute).
_BY_STATUS = {cls.status_code: cls for cls in (
    BadRequestError, AuthenticationError, PermissionDeniedError, NotFoundError, ConflictError,
    RequestTooLargeError, UnprocessableEntityError, RateLimitError)}

# For errors sent inside a stream, which have no HTTP status of their own: OpenAI's error types.
_STATUS_BY_TYPE = {
    "invalid_request_error": 400, "authentication_error": 401, "permission_error": 403,
    "not_found_error": 404, "conflict_error": 409, "rate_limit_error": 429,
}


def status_error_class(status: int) -> type[APIStatusError]:
    if status >= 500:
        return InternalServerError
    return _BY_STATUS.get(status, APIStatusError)


def redact(value: Any, secrets: Iterable[str]) -> Any:
    """``value`` with every secret replaced, inside strings, lists and dicts."""
    secrets = [s for s in secrets if s]
    if not secrets:
        return value
    if isinstance(value, str):
        for secret in secrets:
            value = value.replace(secret, REDACTED)
        return value
    if isinstance(value, dict):
        return {redact(k, secrets): redact(v, secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, secrets) for v in value]
    return value


def error_from_body(status: int | None, body: Any, *, request_id: str | None,
                    secrets: Iterable[str] = (), fallback_text: str = "",
                    during_stream: bool = False) -> APIStatusError:
    """Build the typed error from OpenAI's envelope ``{"error": {message, type, param, code}}``
    (tolerating other shapes). ``status`` None means an error event inside a stream: the status
    comes from an integer ``code`` (as vLLM sends), else from OpenAI's error ``type``, else 500."""
    secrets = tuple(secrets)
    body = redact(body, secrets)
    detail = body.get("error") if isinstance(body, dict) else None
    if isinstance(detail, str):
        detail = {"message": detail}
    if not isinstance(detail, dict):
        detail = {}
    message = detail.get("message") or (body.get("message") if isinstance(body, dict) else None)
    if not message:
        # Redact before cutting, so that a key across the cut cannot leave a prefix behind.
        message = redact(fallback_text.strip(), secrets)[:500] or "the server answered an error"
    if status is None:
        code = detail.get("code")
        if isinstance(code, int) and 400 <= code < 600:
            status = code
        else:
            status = _STATUS_BY_TYPE.get(str(detail.get("type")), 500)
    cls = status_error_class(status)
    return cls(str(message), status_code=status, request_id=request_id, type=detail.get("type"),
               code=detail.get("code"), param=detail.get("param"), body=body,
               during_stream=during_stream)
