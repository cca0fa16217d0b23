"""OpenAI request bodies as we accept them: validated, with unknown fields ignored.

Validation failures become ``APIError`` (400, OpenAI's error envelope) in the server, never
FastAPI's 422.
"""

from __future__ import annotations

from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator


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


class _Lenient(BaseModel):
    # Unknown OpenAI fields (and future ones) are accepted and ignored.
    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    type: Literal["text"]
    text: str


class Prediction(_Lenient):
    type: Literal["content"]
    content: Union[str, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Speculation(_Lenient):
    """foretell's extension: ``{"prompt_lookup": true, "max_draft": 64}``.

    ``prompt_lookup`` unset means: on as the fallback when a prediction is given, else off."""

    prompt_lookup: StrictBool | None = None
    max_draft: StrictInt | None = Field(default=None, ge=1, le=512)


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class _SamplingFields(_Lenient):
    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    # An extension (as in vLLM): keep the k most likely tokens; 0 or absent: no limit.
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = None
    stop: Union[str, list[str], None] = None
    n: StrictInt = Field(default=1, ge=1, le=8)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prediction: Prediction | None = None
    speculation: Speculation | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[str]]
    # Log-probabilities of the emitted tokens with this many alternatives (OpenAI allows 0-5).
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a string or a list of one string)")
            value = value[0]
        return value


class ChatContentPart(_Lenient):
    type: Literal["text"]
    text: str


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[ChatContentPart], None] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def describe_validation_error(error) -> tuple[str, str | None]:
    """Turn a pydantic ValidationError into (message, param) for the envelope."""
    first = error.errors()[0]
    location = ".".join(str(part) for part in first.get("loc", ()))
    message = first.get("msg", "invalid request")
    return (f"{location}: {message}" if location else message), (location or None)
