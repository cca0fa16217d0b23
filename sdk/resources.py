"""``client.chat.completions``, ``client.completions`` and ``client.models``.

``create()`` takes OpenAI's parameters by name (checked against the lists below, so a typo is a
``TypeError`` rather than a silently ignored field), plus:

- ``prediction=``: a string, a list of text parts, an ``os.PathLike`` (the file's text) or a
  ready ``{"type": "content", ...}`` dict;
- ``prompt_lookup=`` / ``draft_cache=`` / ``max_draft=``: sent as foretell's ``speculation``
  extension to foretell servers (``draft_cache=False`` keeps the request out of the server's
  draft cache of earlier answers); for other servers they are dropped, with one ``ForetellWarning``
  per client when they asked for something (these only change speed, never the text);
- ``extra_body=`` / ``extra_headers=`` / ``timeout=``: passed through as in the openai package;
- ``deadline=``: seconds the whole call may take (retries and a stream's reading included),
  overriding the client's.

``client.with_raw_response.chat.completions.create(...)`` (or
``client.chat.completions.with_raw_response.create(...)``) returns a ``RawResponse`` instead:
the HTTP status and headers, and ``.parse()`` for the typed object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from foretell.sdk._deadline import Deadline, check_seconds
from foretell.sdk.errors import ForetellError, redact
from foretell.sdk.estimates import prediction_issues
from foretell.sdk.prediction import PredictionInput, normalize_prediction
from foretell.sdk.raw_response import RawResponse
from foretell.sdk.streaming import AsyncStream, Stream
from foretell.sdk.types import ChatCompletion, ChatCompletionChunk, Completion, ModelList

if TYPE_CHECKING:
    from foretell.sdk.client import AsyncClient, Client

# A completion prompt, as OpenAI's legacy API takes it: text or token ids (one prompt per request
# on foretell).
PromptInput = str | list[str] | list[int] | list[list[int]]

CHAT_PARAMS = frozenset({
    "audio", "frequency_penalty", "function_call", "functions", "logit_bias", "logprobs",
    "max_completion_tokens", "max_tokens", "metadata", "modalities", "n", "parallel_tool_calls",
    "presence_penalty", "prompt_cache_key", "reasoning_effort", "response_format",
    "safety_identifier", "seed", "service_tier", "stop", "store", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity", "web_search_options",
})
COMPLETION_PARAMS = frozenset({
    "best_of", "echo", "frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n",
    "presence_penalty", "seed", "stop", "stream_options", "suffix", "temperature", "top_p", "user",
})


@dataclass
class PreparedCall:
    """One request, before the server kind decides what its body finally holds."""

    path: str
    body: dict
    stream: bool
    response_type: type
    chunk_type: type
    extra_headers: dict | None = None
    timeout: Any = None
    deadline: float | None = None  # seconds; None: the client's
    speculation: dict | None = None  # foretell's extension, sent to foretell servers only
    issues: list[str] = field(default_factory=list)  # OpenAI prediction limits this call hits

    @property
    def needs_server_kind(self) -> bool:
        return self.speculation is not None or bool(self.issues)

    def finalize(self, kind: str | None, warn_once) -> None:
        is_foretell = kind == "foretell"
        if self.speculation is not None:
            if is_foretell:
                self.body["speculation"] = {**self.speculation, **self.body.get("speculation", {})}
            elif self.speculation.get("prompt_lookup") or "max_draft" in self.speculation:
                warn_once("prompt_lookup / max_draft were not sent: the server is not foretell "
                          "(no x-foretell-version header); the request goes ahead without them")
        if not is_foretell:
            for issue in self.issues:
                warn_once(f"prediction: {issue}")


def prepare_call(endpoint: str, required: dict, *, prediction: PredictionInput, prompt_lookup: bool | None,
                 max_draft: int | None, draft_cache: bool | None, stream: bool, params: dict, extra_body: dict | None,
                 extra_headers: dict | None, timeout: Any, deadline: float | None,
                 openai_target: bool) -> PreparedCall:
    allowed = CHAT_PARAMS if endpoint == "chat" else COMPLETION_PARAMS
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise TypeError(f"unknown parameter(s) {', '.join(unknown)}; pass fields the SDK does not "
                        "know through extra_body={...}")
    body = {**required, **{k: v for k, v in params.items() if v is not None}}
    normalized = normalize_prediction(prediction)
    if normalized is not None:
        body["prediction"] = normalized
    if stream:
        body["stream"] = True
    body.update(extra_body or {})
    # Checked on the final body, so that fields given through extra_body count too.
    issues = []
    if body.get("prediction") is not None:
        issues = prediction_issues(str(required["model"]), body, endpoint=endpoint,
                                   openai_target=openai_target)
    speculation = None
    if prompt_lookup is not None or max_draft is not None or draft_cache is not None:
        speculation = {}
        if prompt_lookup is not None:
            speculation["prompt_lookup"] = bool(prompt_lookup)
        if draft_cache is not None:
            speculation["draft_cache"] = bool(draft_cache)
        if max_draft is not None:
            speculation["max_draft"] = int(max_draft)
    if endpoint == "chat":
        path, response_type, chunk_type = "/chat/completions", ChatCompletion, ChatCompletionChunk
    else:
        path, response_type, chunk_type = "/completions", Completion, Completion
    return PreparedCall(path, body, stream, response_type, chunk_type, extra_headers, timeout,
                        None if deadline is None else check_seconds(deadline), speculation, issues)


def _parse(call_type: type, response, secrets) -> Any:
    try:
        data = response.json()
    except ValueError:
        text = redact(response.text, secrets)[:200]
        raise ForetellError(f"the server answered {response.status_code} with a body that is not "
                            f"JSON: {text!r}") from None
    parsed = call_type.from_dict(data)
    parsed.request_id = response.headers.get("x-request-id")
    return parsed


class _Resource:
    def __init__(self, client, raw: bool = False):
        self._client = client
        self._raw = raw  # return a RawResponse rather than the parsed object

    @property
    def with_raw_response(self):
        """This resource, its calls returning a ``RawResponse``."""
        return type(self)(self._client, raw=True)

    def _prepare(self, endpoint: str, required: dict, **kwargs) -> PreparedCall:
        return prepare_call(endpoint, required, openai_target=self._client._config.is_openai, **kwargs)

    def _deadline(self, seconds: float | None = None) -> Deadline | None:
        """The call's deadline, starting now (the client's when the call sets none)."""
        seconds = self._client._deadline if seconds is None else seconds
        return None if seconds is None else Deadline(seconds)

    def _result(self, response, parse):
        return RawResponse(response, parse) if self._raw else parse()


class _SyncResource(_Resource):
    _client: "Client"

    def _run(self, call: PreparedCall):
        transport = self._client._transport
        deadline = self._deadline(call.deadline)
        kind = transport.server_kind(deadline) if call.needs_server_kind else transport.kind
        call.finalize(kind, self._client._warn_once)
        response = transport.send("POST", call.path, call.body, stream=call.stream,
                                  extra_headers=call.extra_headers, timeout=call.timeout,
                                  deadline=deadline)
        if call.stream:
            return self._result(response, lambda: Stream(response, call.chunk_type, transport, deadline))
        return self._result(response, lambda: _parse(call.response_type, response, transport.secrets))


class _AsyncResource(_Resource):
    _client: "AsyncClient"

    async def _run(self, call: PreparedCall):
        transport = self._client._transport
        deadline = self._deadline(call.deadline)
        kind = (await transport.server_kind(deadline)) if call.needs_server_kind else transport.kind
        call.finalize(kind, self._client._warn_once)
        response = await transport.send("POST", call.path, call.body, stream=call.stream,
                                        extra_headers=call.extra_headers, timeout=call.timeout,
                                        deadline=deadline)
        if call.stream:
            return self._result(response,
                                lambda: AsyncStream(response, call.chunk_type, transport, deadline))
        return self._result(response, lambda: _parse(call.response_type, response, transport.secrets))


class ChatCompletions(_SyncResource):
    def create(self, *, model: str, messages: list[dict], prediction: PredictionInput = None,
               prompt_lookup: bool | None = None, max_draft: int | None = None,
               draft_cache: bool | None = None, stream: bool = False,
               extra_body: dict | None = None, extra_headers: dict | None = None, timeout: Any = None,
               deadline: float | None = None,
               **params: Any) -> ChatCompletion | Stream[ChatCompletionChunk]:
        """POST /chat/completions. ``params``: OpenAI's chat parameters (``CHAT_PARAMS``).
        With ``stream=True`` returns a ``Stream`` of ``ChatCompletionChunk``."""
        return self._run(self._prepare(
            "chat", {"model": model, "messages": messages}, prediction=prediction,
            prompt_lookup=prompt_lookup, max_draft=max_draft, draft_cache=draft_cache,
            stream=stream, params=params,
            extra_body=extra_body, extra_headers=extra_headers, timeout=timeout,
            deadline=deadline))


class Completions(_SyncResource):
    def create(self, *, model: str, prompt: PromptInput, prediction: PredictionInput = None,
               prompt_lookup: bool | None = None, max_draft: int | None = None,
               draft_cache: bool | None = None, stream: bool = False,
               extra_body: dict | None = None, extra_headers: dict | None = None, timeout: Any = None,
               deadline: float | None = None, **params: Any) -> Completion | Stream[Completion]:
        """POST /completions. ``params``: OpenAI's completion parameters (``COMPLETION_PARAMS``).
        With ``stream=True`` returns a ``Stream`` of ``Completion`` chunks."""
        return self._run(self._prepare(
            "completions", {"model": model, "prompt": prompt}, prediction=prediction,
            prompt_lookup=prompt_lookup, max_draft=max_draft, draft_cache=draft_cache,
            stream=stream, params=params,
            extra_body=extra_body, extra_headers=extra_headers, timeout=timeout,
            deadline=deadline))


class Models(_SyncResource):
    def list(self) -> ModelList:
        transport = self._client._transport
        response = transport.send("GET", "/models", deadline=self._deadline())
        return self._result(response, lambda: _parse(ModelList, response, transport.secrets))


class Chat:
    def __init__(self, client, raw: bool = False):
        self.completions = ChatCompletions(client, raw)


class AsyncChatCompletions(_AsyncResource):
    async def create(self, *, model: str, messages: list[dict], prediction: PredictionInput = None,
                     prompt_lookup: bool | None = None, max_draft: int | None = None, draft_cache: bool | None = None,
                     stream: bool = False, extra_body: dict | None = None,
                     extra_headers: dict | None = None, timeout: Any = None,
                     deadline: float | None = None,
                     **params: Any) -> ChatCompletion | AsyncStream[ChatCompletionChunk]:
        """As ``ChatCompletions.create``; a stream is an ``AsyncStream``."""
        return await self._run(self._prepare(
            "chat", {"model": model, "messages": messages}, prediction=prediction,
            prompt_lookup=prompt_lookup, max_draft=max_draft, draft_cache=draft_cache,
            stream=stream, params=params,
            extra_body=extra_body, extra_headers=extra_headers, timeout=timeout,
            deadline=deadline))


class AsyncCompletions(_AsyncResource):
    async def create(self, *, model: str, prompt: PromptInput, prediction: PredictionInput = None,
                     prompt_lookup: bool | None = None, max_draft: int | None = None, draft_cache: bool | None = None,
                     stream: bool = False, extra_body: dict | None = None,
                     extra_headers: dict | None = None, timeout: Any = None,
                     deadline: float | None = None,
                     **params: Any) -> Completion | AsyncStream[Completion]:
        """As ``Completions.create``; a stream is an ``AsyncStream``."""
        return await self._run(self._prepare(
            "completions", {"model": model, "prompt": prompt}, prediction=prediction,
            prompt_lookup=prompt_lookup, max_draft=max_draft, draft_cache=draft_cache,
            stream=stream, params=params,
            extra_body=extra_body, extra_headers=extra_headers, timeout=timeout,
            deadline=deadline))


class AsyncModels(_AsyncResource):
    async def list(self) -> ModelList:
        transport = self._client._transport
        response = await transport.send("GET", "/models", deadline=self._deadline())
        return self._result(response, lambda: _parse(ModelList, response, transport.secrets))


class AsyncChat:
    def __init__(self, client, raw: bool = False):
        self.completions = AsyncChatCompletions(client, raw)


class RawResources:
    """``client.with_raw_response``: the client's resources, each call returning a
    ``RawResponse``."""

    def __init__(self, client, chat: type, completions: type, models: type):
        self.chat = chat(client, raw=True)
        self.completions = completions(client, raw=True)
        self.models = models(client, raw=True)
