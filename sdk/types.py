"""Typed responses: plain dataclasses built from the server's JSON.

Building never fails on the shape: missing fields become None (or an empty list), unknown fields
are kept. A response also carries ``request_id`` (the ``x-request-id`` header). Every object keeps
the JSON it was built from: ``.model_dump()`` (also ``.to_dict()``) returns a copy and
``.model_dump_json()`` the JSON text, as the openai package's models do, and an unknown top-level
field is readable as an attribute (``response.foretell`` for the proxy's notes).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar


@dataclass
class _Object:
    # field name -> class of a nested object / class of the items of a nested list
    _nested: ClassVar[dict[str, type]] = {}
    _lists: ClassVar[dict[str, type]] = {}

    _raw: dict = field(default_factory=dict, repr=False, compare=False)
    # The server's x-request-id, set on responses the client returns (not a JSON field).
    request_id: ClassVar[str | None] = None

    @classmethod
    def from_dict(cls, data: Any):
        data = data if isinstance(data, dict) else {}
        values = {}
        for f in fields(cls):
            if f.name == "_raw" or f.name not in data:
                continue
            value = data[f.name]
            if f.name in cls._nested and value is not None:
                value = cls._nested[f.name].from_dict(value)
            elif f.name in cls._lists:
                item = cls._lists[f.name]
                value = [item.from_dict(v) for v in value] if isinstance(value, list) else []
            values[f.name] = value
        return cls(_raw=data, **values)

    def to_dict(self) -> dict:
        """The JSON this object was built from (a deep copy)."""
        return copy.deepcopy(self._raw)

    def model_dump(self) -> dict:
        """The JSON object the server sent, as a plain dict (a deep copy): every field it had,
        unknown ones included, and none it did not have."""
        return self.to_dict()

    def model_dump_json(self, *, indent: int | None = None) -> str:
        """``model_dump()`` as JSON text: compact unless ``indent`` is given, non-ASCII kept."""
        separators = (",", ":") if indent is None else None
        return json.dumps(self._raw, indent=indent, separators=separators, ensure_ascii=False)

    def __getattr__(self, name: str):
        # Only called for attributes that are not fields: unknown JSON fields.
        if name.startswith("__") or name == "_raw":
            raise AttributeError(name)
        raw = self.__dict__.get("_raw", {})
        if name in raw:
            return raw[name]
        raise AttributeError(f"{type(self).__name__} has no field {name!r}")


@dataclass
class SourceReport(_Object):
    """One draft source's share of a foretell speculation report."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


@dataclass
class SpeculationReport(_Object):
    """foretell's extension: how speculation went for one request."""

    target_passes: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_rate: float | None = None
    per_source: dict[str, SourceReport] = field(default_factory=dict)
    decode_seconds: float | None = None
    seed: int | None = None  # the seed a sampled request ran with: pass it back to replay it

    @classmethod
    def from_dict(cls, data: Any):
        report = super().from_dict(data)
        sources = report.per_source if isinstance(report.per_source, dict) else {}
        report.per_source = {name: SourceReport.from_dict(v) for name, v in sources.items()}
        return report


@dataclass
class CompletionTokensDetails(_Object):
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    reasoning_tokens: int | None = None


@dataclass
class Usage(_Object):
    _nested = {"completion_tokens_details": CompletionTokensDetails}

    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    total_tokens: int | None = None
    completion_tokens_details: CompletionTokensDetails | None = None

    @property
    def accepted_prediction_tokens(self) -> int:
        """Prediction tokens whose text appears in the completion (0 when not reported)."""
        details = self.completion_tokens_details
        return (details and details.accepted_prediction_tokens) or 0

    @property
    def rejected_prediction_tokens(self) -> int:
        """Prediction tokens not in the completion; OpenAI bills them as output (0 when not
        reported)."""
        details = self.completion_tokens_details
        return (details and details.rejected_prediction_tokens) or 0


@dataclass
class ChatCompletionMessage(_Object):
    role: str | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list | None = None


@dataclass
class ChatChoice(_Object):
    _nested = {"message": ChatCompletionMessage}

    index: int = 0
    message: ChatCompletionMessage | None = None
    finish_reason: str | None = None
    logprobs: Any = None


@dataclass
class ChatCompletion(_Object):
    _lists = {"choices": ChatChoice}
    _nested = {"usage": Usage, "speculation": SpeculationReport}

    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[ChatChoice] = field(default_factory=list)
    usage: Usage | None = None
    speculation: SpeculationReport | None = None  # foretell only
    system_fingerprint: str | None = None

    @property
    def text(self) -> str:
        """The first choice's message content ('' when there is none)."""
        if not self.choices or self.choices[0].message is None:
            return ""
        return self.choices[0].message.content or ""


@dataclass
class ChoiceDelta(_Object):
    role: str | None = None
    content: str | None = None
    tool_calls: list | None = None


@dataclass
class ChatChunkChoice(_Object):
    _nested = {"delta": ChoiceDelta}

    index: int = 0
    delta: ChoiceDelta | None = None
    finish_reason: str | None = None
    logprobs: Any = None


@dataclass
class ChatCompletionChunk(_Object):
    _lists = {"choices": ChatChunkChoice}
    _nested = {"usage": Usage, "speculation": SpeculationReport}

    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[ChatChunkChoice] = field(default_factory=list)
    usage: Usage | None = None  # the last chunk, with stream_options={"include_usage": True}
    speculation: SpeculationReport | None = None  # foretell, with the usage chunk

    @property
    def text(self) -> str:
        """The first choice's content delta ('' when there is none)."""
        if not self.choices or self.choices[0].delta is None:
            return ""
        return self.choices[0].delta.content or ""


@dataclass
class CompletionChoice(_Object):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: Any = None


@dataclass
class Completion(_Object):
    """A /completions answer; streamed chunks have the same shape."""

    _lists = {"choices": CompletionChoice}
    _nested = {"usage": Usage, "speculation": SpeculationReport}

    id: str | None = None
    object: str | None = None
    created: int | None = None
    model: str | None = None
    choices: list[CompletionChoice] = field(default_factory=list)
    usage: Usage | None = None
    speculation: SpeculationReport | None = None
    system_fingerprint: str | None = None

    @property
    def text(self) -> str:
        return self.choices[0].text or "" if self.choices else ""


@dataclass
class Model(_Object):
    id: str | None = None
    object: str | None = None
    created: int | None = None
    owned_by: str | None = None


@dataclass
class ModelList(_Object):
    _lists = {"data": Model}

    object: str | None = None
    data: list[Model] = field(default_factory=list)
