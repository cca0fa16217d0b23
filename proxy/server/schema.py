"""OpenAI request bodies as we accept them, validated.

Fields these models do not name are not validated here: a field that would change the generated
text and that the local engine does not implement (penalties, ``logit_bias``, vLLM's and
llama.cpp's sampling extensions, ...) is refused with a 400 naming it on the local engine, unless
sent with its neutral value (``unsupported_fields.py``, checked in ``dispatch.py``); any other
(``store``, ``metadata``, ``service_tier``, ...) is ignored, so a new field that changes the text
belongs in that table. A plain forward relays them all as sent.

Validation failures become ``APIError`` (400, OpenAI's error envelope) in the server, never
FastAPI's 422.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import InitErrorDetails, PydanticCustomError

from foretell.proxy.server.api_error import APIError

# OpenAI's seed is a 64-bit integer; either signedness is accepted.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


class _Lenient(BaseModel):
    # Fields not named here pass validation; those that change the text and are not
    # implemented are refused later, where the route is known (unsupported_fields.py).
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        # OpenAI treats an optional field sent as null as not sent.
        if isinstance(data, dict) and None in data.values():
            return {key: value for key, value in data.items() if value is not None}
        return data


def _valid_unicode(text: str) -> str:
    # JSON can carry lone surrogates ("\ud800"), which are not text: the tokenizer (and any
    # UTF-8 output) would fail on them later, as a 500.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"holds a lone surrogate (U+{ord(text[error.start]):04X}), which is not "
                         "valid Unicode text") from None
    return text


# A string that is valid Unicode (for text the model reads: prompts, messages, predictions, stops).
Text = Annotated[str, AfterValidator(_valid_unicode)]


class TextPart(_Lenient):
    type: Literal["text"]
    text: Text


class Prediction(_Lenient):
    # Goose sends {"content": ...} without a type; "content" is the only one OpenAI has.
    type: Literal["content"] = "content"
    content: Union[Text, list[TextPart]]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class Speculation(_Lenient):
    """foretell's extension: ``{"prompt_lookup": true, "max_draft": 64, "report_origins": true}``.

    ``prompt_lookup`` unset means: on as the fallback when a prediction is given, else off.
    ``draft_cache``: false keeps the request out of the draft cache of earlier answers (it neither
    drafts from it nor adds its answer); unset or true: as the server's ``--draft-cache-scope``.
    ``draft_model``: true drafts from the server's ``--draft-model`` even beside a prediction,
    false never; unset: where the request brings no prediction (400 when true and there is none).
    ``report_origins`` (streams only) adds a ``foretell`` field to each chunk: its text in runs
    by origin (see ``origins.py``)."""

    prompt_lookup: StrictBool | None = None
    draft_cache: StrictBool | None = None
    draft_model: StrictBool | None = None
    max_draft: StrictInt | None = Field(default=None, ge=1, le=512)
    report_origins: StrictBool | None = None


class StreamOptions(_Lenient):
    include_usage: StrictBool = False


class JsonSchemaFormat(_Lenient):
    """OpenAI's ``response_format.json_schema``: the output follows ``schema`` (always exactly:
    ``strict`` is accepted either way)."""

    name: str | None = None
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema.
    json_schema: dict = Field(alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Lenient):
    """Structured output: free text (the default), any JSON object, or JSON of a schema,
    decoded under the grammar's mask (``engine/grammar.py``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only with it")
        return self

    def constrained(self) -> bool:
        return self.type != "text"

    def schema(self) -> dict | None:
        """The JSON schema the output follows; None: any JSON object."""
        return self.json_schema.json_schema if self.json_schema is not None else None


class _SamplingFields(_Lenient):
    model: str
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    # Numbers, not numeric strings or booleans (as OpenAI); integers are fine.
    temperature: StrictFloat | None = Field(default=None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(default=None, gt=0.0, le=1.0)
    # An extension (as in vLLM): keep the k most likely tokens; 0 or absent: no limit.
    top_k: StrictInt | None = Field(default=None, ge=0)
    seed: StrictInt | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: Union[Text, list[Text], None] = None
    n: StrictInt = Field(default=1, ge=1, le=8)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prediction: Prediction | None = None
    speculation: Speculation | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extension: the tokenizer's special tokens (the BOS) added to the prompt or not; unset:
    # added to a completion's prompt, and to a chat's where its template does not write the BOS.
    add_special_tokens: StrictBool | None = None

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

    def max_tokens_or(self, default: int) -> int:
        """The requested completion length, ``default`` when none is set."""
        return default if self.max_tokens is None else self.max_tokens


class CompletionRequest(_SamplingFields):
    # Text or token ids (as OpenAI's legacy API); one prompt per request. After validation: a
    # string, or a list of token ids (checked against the vocabulary when tokenising).
    prompt: Union[Text, list[Text], list[StrictInt], list[list[StrictInt]]]
    # 0 only with echo: score the prompt, generate nothing (as OpenAI's legacy API).
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    # Log-probabilities of the emitted tokens with this many alternatives (OpenAI allows 0-5).
    logprobs: StrictInt | None = Field(default=None, ge=0, le=5)
    # OpenAI's legacy echo: the choice's text starts with the prompt, and with ``logprobs`` its
    # log-probabilities cover the prompt's tokens first (the first one has none).
    echo: StrictBool = False
    # vLLM's extension: tokens in ``logprobs`` as "token_id:<id>" instead of their text.
    return_tokens_as_token_ids: StrictBool = False

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self):
        if self.max_tokens == 0 and not self.echo:
            raise ValidationError.from_exception_data(type(self).__name__, [InitErrorDetails(
                type=PydanticCustomError("greater_than_equal",
                                         "Input should be greater than or equal to 1 (0 only with echo)"),
                loc=("max_tokens",), input=0)])
        return self

    def logprob_alternatives(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and not isinstance(value[0], int):
            if len(value) != 1:
                raise ValueError("send one prompt per request (a string, a list of token ids, or a list "
                                 "of one of them)")
            value = value[0]
        if isinstance(value, list):
            if not value:
                raise ValueError("a prompt of token ids must not be empty")
            negative = next((i for i, token in enumerate(value) if token < 0), None)
            if negative is not None:
                raise ValueError(f"token ids are not negative (item {negative}: {value[negative]})")
        return value


class ChatContentPart(_Lenient):
    type: Literal["text"]
    text: Text


class CalledFunction(_Lenient):
    name: str
    arguments: Text  # JSON text, as the model wrote it


class ToolCall(_Lenient):
    """A call an assistant message made (the history of a tool round trip)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[Text, list[ChatContentPart], None] = None
    # An assistant's calls, as sent: ToolCall each where the local engine renders them
    # (tool_calls/), any kind an upstream knows where one answers.
    tool_calls: list[dict] | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _tool_fields_by_role(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Lenient):
    # OpenAI's rule for a function's name.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments; none: no arguments
    strict: StrictBool | None = None


class Tool(_Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Lenient):
    name: str


class NamedToolChoice(_Lenient):
    type: Literal["function"]
    function: FunctionName


class LocalToolFields(_Lenient):
    """A chat request's tool fields as the local engine takes them (``tool_calls/``): function
    tools only. Validated there, not with the request: an upstream gets any tool OpenAI has
    (custom tools, ``allowed_tools``) as sent."""

    tools: list[Tool] = Field(default_factory=list, max_length=128)
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice] | None = None
    parallel_tool_calls: StrictBool = True


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    # Tool calling, as sent (validated where the local engine takes them: LocalToolFields).
    tools: list[dict] | None = None
    tool_choice: Union[str, dict] | None = None
    parallel_tool_calls: StrictBool | None = None

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def logprob_alternatives(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_tokens_or(self, default: int) -> int:
        # max_completion_tokens is OpenAI's newer name; it wins when both are set.
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().max_tokens_or(default)


class TokenizeRequest(_Lenient):
    """vLLM's ``POST /tokenize``."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    # vLLM's defaults: special tokens (BOS) for a prompt, none for messages (the template has them).
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send either prompt or messages")
        if self.messages is not None and not self.messages:
            raise ValueError("messages must not be empty")
        return self


class DetokenizeRequest(_Lenient):
    """vLLM's ``POST /detokenize``."""

    model: str | None = None
    tokens: list[StrictInt] = Field(max_length=1_000_000)


# Every field name of the request models; anything else in an error location is pydantic naming
# the member of a union it tried ("str", "list[str]", "function-after[...]"): not a param.
_FIELDS = frozenset(name for model in (CompletionRequest, ChatCompletionRequest, ChatMessage,
                                       ChatContentPart, Prediction, TextPart, Speculation, StreamOptions,
                                       ResponseFormat, LocalToolFields, Tool, FunctionDefinition, NamedToolChoice,
                                       ToolCall, CalledFunction)
                    for name in model.model_fields) | {"schema"}


def describe_validation_error(error) -> tuple[str, str | None]:
    """Turn a pydantic ValidationError into (message, param) for the envelope."""
    errors = error.errors()
    # A value that fits no member of a union gets one error per member; the one that got
    # deepest into the value says best what is wrong ("stop.1: holds a lone surrogate" rather
    # than "stop: should be a valid string").
    field = errors[0].get("loc", ())[:1]
    first = max((e for e in errors if e.get("loc", ())[:1] == field), key=lambda e: len(e.get("loc", ())))
    parts = [str(part) for part in first.get("loc", ()) if isinstance(part, int) or part in _FIELDS]
    location = ".".join(parts)
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    return (f"{location}: {message}" if location else message), (location or None)


def validate(schema, body: dict):
    """``body`` as a ``schema`` instance, or APIError 400 (never FastAPI's 422)."""
    try:
        return schema.model_validate(body)
    except ValidationError as error:
        message, param = describe_validation_error(error)
        raise APIError(400, message, param=param) from None
