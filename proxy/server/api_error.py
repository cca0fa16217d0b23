"""The error every endpoint answers with: OpenAI's envelope (``{"error": {message, type, param,
code}}``) and its HTTP status. Its own module, importable without pydantic: most modules that
raise it need nothing else from the request schema."""

from __future__ import annotations


class APIError(Exception):
    """An error answered in OpenAI's envelope."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
