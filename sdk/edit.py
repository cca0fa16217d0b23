"""Edit a file with a model, the file itself as the prediction.

The request is one chat message that shows the file in a fenced block and asks for the whole
edited file in one fenced block. The prediction is the answer as it would look if nothing
changed: the opening fence line and the file. Generation stops at the closing fence (a stop
string), so a model that would ramble after the file costs nothing more.

The fence is longer than any run of backticks in the file (as Markdown allows), so files that
hold fences themselves (Markdown, docs) are handled, and it always carries a language tag, so
the stop string (a bare fence line) never matches the opening fence.

The new text is the content of the first fenced block of the answer (or the whole answer when
it has no fence). An answer cut off by ``max_tokens`` before its closing fence raises
``EditTruncatedError``: a truncated file is never returned as a result.
"""

from __future__ import annotations

import difflib
import os
import re
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Iterator

from foretell.sdk._deadline import Deadline
from foretell.sdk.errors import EditTruncatedError
from foretell.sdk.types import SpeculationReport, Usage

LANGUAGES = {
    ".py": "python", ".pyi": "python", ".js": "javascript", ".mjs": "javascript",
    ".ts": "typescript", ".tsx": "tsx", ".jsx": "jsx", ".go": "go", ".rs": "rust", ".java": "java",
    ".kt": "kotlin", ".c": "c", ".h": "c", ".cc": "cpp", ".cpp": "cpp", ".hpp": "cpp",
    ".cs": "csharp", ".rb": "ruby", ".php": "php", ".swift": "swift", ".sh": "bash",
    ".sql": "sql", ".html": "html", ".css": "css", ".json": "json", ".yaml": "yaml", ".yml": "yaml",
    ".toml": "toml", ".md": "markdown", ".rst": "rst", ".txt": "text",
}


@dataclass
class EditPrompt:
    messages: list[dict]
    prediction: str
    fence: str
    max_tokens: int
    stop: list[str]


def build_edit_prompt(text: str, instruction: str, *, filename: str | None = None,
                      language: str | None = None, max_tokens: int | None = None) -> EditPrompt:
    name = filename or "the file"
    language = language or LANGUAGES.get(os.path.splitext(filename or "")[1].lower(), "text")
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    body = text if text.endswith("\n") or not text else text + "\n"
    opening = f"{fence}{language}\n"
    content = (f"Edit {name}. {instruction.strip()}\n\n"
               f"{name} before the edit:\n{opening}{body}{fence}\n\n"
               f"Reply with {name} after the edit, the whole file in one {fence}{language} block.")
    if max_tokens is None:
        # Room for the whole file and some growth; code averages well over 3 characters a token.
        max_tokens = int((len(opening + body) // 3 + 1) * 1.5) + 64
    return EditPrompt(messages=[{"role": "user", "content": content}], prediction=opening + body,
                      fence=fence, max_tokens=max_tokens, stop=[f"\n{fence}\n"])


def extract_edited_text(output: str, fence: str, finish_reason: str | None,
                        keep_final_newline: bool) -> tuple[str, bool]:
    """(new text, complete). Complete: the closing fence was seen, or the model stopped by itself
    (stop string or end of text) rather than at the token limit."""
    opening = re.search(rf"^[ \t]*{re.escape(fence)}[^`\n]*\n", output, re.MULTILINE)
    if opening is None:
        body, closed = output.strip("\n"), False
        body = body + "\n" if body else body
    else:
        rest = output[opening.end():]
        closing = re.search(rf"^[ \t]*{re.escape(fence)}[ \t]*$", rest, re.MULTILINE)
        closed = closing is not None
        body = rest[:closing.start()] if closing else rest
        if not closed and body and not body.endswith("\n"):
            body += "\n"  # the stop string ("\n" + fence + "\n") took the last newline
    complete = closed or finish_reason == "stop"
    if not keep_final_newline and body.endswith("\n"):
        body = body[:-1]
    return body, complete


def unified_diff(before: str, after: str, filename: str | None = None) -> str:
    """A unified diff (``a/NAME`` -> ``b/NAME``), marking a missing final newline as git does."""
    name = filename or "file"
    lines = []
    for line in difflib.unified_diff(before.splitlines(keepends=True), after.splitlines(keepends=True),
                                     f"a/{name}", f"b/{name}"):
        lines.append(line if line.endswith("\n") else line + "\n\\ No newline at end of file\n")
    return "".join(lines)


@dataclass
class EditResult:
    text: str  # the file after the edit
    original: str
    diff: str  # unified diff from original to text ('' when unchanged)
    output: str  # the model's whole answer
    finish_reason: str | None
    complete: bool
    seconds: float  # wall time of the request
    model: str | None = None
    usage: Usage | None = None
    speculation: SpeculationReport | None = None  # foretell servers only
    request_id: str | None = None

    @property
    def changed(self) -> bool:
        return self.text != self.original

    @property
    def completion_tokens(self) -> int | None:
        return self.usage.completion_tokens if self.usage else None

    @property
    def accepted_prediction_tokens(self) -> int:
        return self.usage.accepted_prediction_tokens if self.usage else 0

    @property
    def rejected_prediction_tokens(self) -> int:
        return self.usage.rejected_prediction_tokens if self.usage else 0

    @property
    def tokens_per_second(self) -> float | None:
        tokens = self.completion_tokens
        return tokens / self.seconds if tokens is not None and self.seconds > 0 else None


@dataclass
class EditProgress:
    """One step of a streamed edit."""

    delta: str  # text that arrived in this chunk
    output: str  # the answer so far
    approx_tokens: int  # estimate from the characters (exact counts come with the result)
    seconds: float
    # ``delta`` in runs of (text, origin): "prediction", "prompt_lookup", or None for the target
    # model's own tokens. Only from a foretell server asked with ``report_origins=True``, else None.
    origins: list[tuple[str, str | None]] | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.approx_tokens / self.seconds if self.seconds > 0 else 0.0


class _EditCall:
    """What the four edit functions share: the prompt, the request, the result."""

    def __init__(self, text: str, instruction: str, model: str, filename: str | None,
                 language: str | None, max_tokens: int | None, temperature: float | None,
                 prompt_lookup: bool | None, stream: bool, extra: dict, report_origins: bool = False):
        self.text, self.filename = text, filename
        self.report_origins = report_origins
        self.prompt = build_edit_prompt(text, instruction, filename=filename, language=language,
                                        max_tokens=max_tokens)
        self.kwargs = dict(model=model, messages=self.prompt.messages, prediction=self.prompt.prediction,
                           max_tokens=self.prompt.max_tokens, stop=self.prompt.stop,
                           temperature=temperature, prompt_lookup=prompt_lookup, **extra)
        if stream:
            self.kwargs.update(stream=True, stream_options={"include_usage": True})
        self.started = time.perf_counter()
        self.output = ""
        self.finish_reason = self.usage = self.speculation = self.model = self.request_id = None

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def take_response(self, response) -> None:
        choice = response.choices[0] if response.choices else None
        self.output = (choice.message.content or "") if choice and choice.message else ""
        self.finish_reason = choice.finish_reason if choice else None
        self.usage, self.speculation, self.model = response.usage, response.speculation, response.model
        self.request_id = response.request_id

    def ask_for_origins(self, server_kind: str | None) -> None:
        """Ask a foretell server (only: others do not know the field) for each chunk's origins."""
        if self.report_origins and server_kind == "foretell":
            extra_body = dict(self.kwargs.get("extra_body") or {})
            extra_body["speculation"] = {**extra_body.get("speculation", {}), "report_origins": True}
            self.kwargs["extra_body"] = extra_body

    def take_chunk(self, chunk) -> EditProgress | None:
        self.model = chunk.model or self.model
        self.usage = chunk.usage or self.usage
        self.speculation = chunk.speculation or self.speculation
        for choice in chunk.choices:
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        delta = chunk.text
        if not delta:
            return None
        self.output += delta
        return EditProgress(delta, self.output, max(1, round(len(self.output) / 4)), self.elapsed(),
                            _origins(chunk))

    def result(self) -> EditResult:
        seconds = self.elapsed()
        new_text, complete = extract_edited_text(self.output, self.prompt.fence, self.finish_reason,
                                                 keep_final_newline=self.text.endswith("\n") or not self.text)
        result = EditResult(
            text=new_text, original=self.text, diff=unified_diff(self.text, new_text, self.filename),
            output=self.output, finish_reason=self.finish_reason, complete=complete, seconds=seconds,
            model=self.model, usage=self.usage, speculation=self.speculation, request_id=self.request_id)
        if not complete:
            raise EditTruncatedError(
                f"the edit stopped ({self.finish_reason}) before the whole file was written; "
                f"raise max_tokens (was {self.prompt.max_tokens})", result)
        return result


def edit(client, text: str, instruction: str, *, model: str, filename: str | None = None,
         language: str | None = None, max_tokens: int | None = None, temperature: float | None = 0,
         prompt_lookup: bool | None = None, **extra: Any) -> EditResult:
    """Apply ``instruction`` to ``text`` with ``client`` (a ``Client``), the text as the
    prediction. ``extra``: more ``create()`` arguments (``extra_body``, ``timeout``, ...).
    Raises ``EditTruncatedError`` when the answer was cut off before the file's end."""
    call = _EditCall(text, instruction, model, filename, language, max_tokens, temperature,
                     prompt_lookup, False, extra)
    call.take_response(client.chat.completions.create(**call.kwargs))
    return call.result()


async def aedit(client, text: str, instruction: str, *, model: str, filename: str | None = None,
                language: str | None = None, max_tokens: int | None = None,
                temperature: float | None = 0, prompt_lookup: bool | None = None,
                **extra: Any) -> EditResult:
    """``edit`` with an ``AsyncClient``."""
    call = _EditCall(text, instruction, model, filename, language, max_tokens, temperature,
                     prompt_lookup, False, extra)
    call.take_response(await client.chat.completions.create(**call.kwargs))
    return call.result()


def _origins(chunk) -> list[tuple[str, str | None]] | None:
    """The chunk's ``foretell.origins`` runs (the report_origins extension), if it has them."""
    report = chunk._raw.get("foretell") if isinstance(chunk._raw, dict) else None
    spans = report.get("origins") if isinstance(report, dict) else None
    if not isinstance(spans, list):
        return None
    return [(span.get("text") or "", span.get("origin")) for span in spans if isinstance(span, dict)]


def _probe_deadline(client, call: _EditCall) -> Deadline | None:
    seconds = call.kwargs.get("deadline") or client._deadline
    return Deadline(seconds) if seconds else None


def _run_once(stream) -> None:
    # A second run would send the request again and splice two answers into one output.
    if stream._ran:
        raise RuntimeError("an edit stream runs once: read .result, or start a new edit_stream()")
    stream._ran = True


class EditStream:
    """Iterate for ``EditProgress`` steps; ``result`` holds the ``EditResult`` once the iteration
    ends (``EditTruncatedError`` is raised at the end when the answer was cut off)."""

    def __init__(self, client, call: _EditCall):
        self._client, self._call = client, call
        self.result: EditResult | None = None
        self._ran = False

    def __iter__(self) -> Iterator[EditProgress]:
        _run_once(self)
        if self._call.report_origins:
            self._call.ask_for_origins(self._client._transport.server_kind(
                _probe_deadline(self._client, self._call)))
        self._call.started = time.perf_counter()  # time the request, not the wait before iterating
        with self._client.chat.completions.create(**self._call.kwargs) as stream:
            self._call.request_id = stream.request_id
            for chunk in stream:
                progress = self._call.take_chunk(chunk)
                if progress is not None:
                    yield progress
        self.result = self._call.result()

    def until_done(self) -> EditResult:
        """Consume the stream (if not done yet) and return the result."""
        if self.result is None:
            for _ in self:
                pass
        return self.result


class AsyncEditStream:
    """``EditStream`` for an ``AsyncClient``: ``async for`` steps, then ``result``."""

    def __init__(self, client, call: _EditCall):
        self._client, self._call = client, call
        self.result: EditResult | None = None
        self._ran = False

    async def __aiter__(self) -> AsyncIterator[EditProgress]:
        _run_once(self)
        if self._call.report_origins:
            self._call.ask_for_origins(await self._client._transport.server_kind(
                _probe_deadline(self._client, self._call)))
        self._call.started = time.perf_counter()
        async with await self._client.chat.completions.create(**self._call.kwargs) as stream:
            self._call.request_id = stream.request_id
            async for chunk in stream:
                progress = self._call.take_chunk(chunk)
                if progress is not None:
                    yield progress
        self.result = self._call.result()

    async def until_done(self) -> EditResult:
        if self.result is None:
            async for _ in self:
                pass
        return self.result


def edit_stream(client, text: str, instruction: str, *, model: str, filename: str | None = None,
                language: str | None = None, max_tokens: int | None = None,
                temperature: float | None = 0, prompt_lookup: bool | None = None,
                report_origins: bool = False, **extra: Any) -> EditStream:
    """``edit``, streamed: progress while the file is written, then ``.result``.
    ``report_origins``: each step's ``origins`` tells which draft source wrote its text (foretell
    servers only; the field is never sent to others)."""
    return EditStream(client, _EditCall(text, instruction, model, filename, language, max_tokens,
                                        temperature, prompt_lookup, True, extra, report_origins))


def aedit_stream(client, text: str, instruction: str, *, model: str, filename: str | None = None,
                 language: str | None = None, max_tokens: int | None = None,
                 temperature: float | None = 0, prompt_lookup: bool | None = None,
                 report_origins: bool = False, **extra: Any) -> AsyncEditStream:
    """``edit_stream`` with an ``AsyncClient``."""
    return AsyncEditStream(client, _EditCall(text, instruction, model, filename, language,
                                             max_tokens, temperature, prompt_lookup, True, extra,
                                             report_origins))
