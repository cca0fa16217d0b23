"""An answer's text read as it grows into content and tool calls.

The stream and the whole body read the text through the same parser, so a stream's deltas,
concatenated, are the body's message: its content, and for each call its id and name (once) and
its arguments (in pieces, as the model writes them).

What is a call: in the tagged format, ``<tool_call>`` then ``{"name": <a function offered>,
"arguments": {...}`` (``parameters`` for Llama's templates); in the bare format, such an object
at the start of the answer or right after another call. The arguments are the model's own JSON
text. A tag whose body does not start that way is read whole once it closes: a JSON object with a
function's name and arguments is a call, anything else is content. A call cut off (max_tokens)
within its arguments keeps what was written; one cut off before them is dropped. Whitespace
before a call, or after the last one, is not content; an answer without calls is its text exactly.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import regex

from foretell.proxy.server.tool_calls.format import TAG_CLOSE, TAG_OPEN, CallFormat

# A call's head up to its arguments' opening brace; the name is group 1.
_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


class _ValueEnd:
    """Where a JSON value that starts with ``{`` ends, read piece by piece."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def feed(self, text: str) -> int | None:
        """The length of ``text``'s part that belongs to the value (None: all, and more to come)."""
        for i, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char in "{[":
                self.depth += 1
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return None


class ToolCallParser:
    """``feed`` the answer's text as it comes, then ``finish``; each gives the events it found."""

    def __init__(self, form: CallFormat, names: frozenset[str], parallel: bool):
        self.form, self.names, self.parallel = form, names, parallel
        self.state = "text"  # text, head, arguments, tail, whole (a tag read whole), plain (bare: no calls)
        self.buffer = ""
        self.space = ""  # whitespace after content: content only if more content follows
        self.calls = 0
        self.value: _ValueEnd | None = None

    def feed(self, text: str) -> list:
        self.buffer += text
        events: list = []
        while self._step(events):
            pass
        return events

    def finish(self) -> list:
        """The events the end of the text completes (a call cut off, held-back text)."""
        events: list = []
        if self.state in ("text", "plain"):
            self._content(self.buffer, events)
        elif self.state == "head" and _HEAD.match(self.buffer, partial=True) is not None:
            pass  # a call cut off before its arguments (max_tokens): neither a call nor content
        elif self.state in ("head", "whole"):
            self._read_whole(self.buffer, events)
        self.buffer = ""
        if self.calls == 0 and self.space:
            events.append(Content(self.space))  # no call: the text is the content, exactly
        self.space = ""
        return events

    # ---- the states -----------------------------------------------------------------------------

    def _step(self, events: list) -> bool:
        """Advance on the buffer; False when it needs more text."""
        if self.state == "text":
            return self._text(events)
        if self.state == "head":
            return self._head(events)
        if self.state == "arguments":
            end = self.value.feed(self.buffer)
            piece = self.buffer if end is None else self.buffer[:end]
            if piece:
                events.append(Arguments(self.calls - 1, piece))
            self.buffer = "" if end is None else self.buffer[end:]
            if end is not None:
                self.state = "tail"
            return end is not None
        if self.state == "tail":
            return self._tail()
        if self.state == "whole":
            close = self.buffer.find(TAG_CLOSE)
            if close < 0:
                return False
            self._read_whole(self.buffer[:close], events, closed=True)
            self.buffer, self.state = self.buffer[close + len(TAG_CLOSE):], "text"
            return True
        self._content(self.buffer, events)  # plain
        self.buffer = ""
        return False

    def _text(self, events: list) -> bool:
        if not self.parallel and self.calls:
            self.state = "plain"  # one call at most: the rest is content
            return True
        if not self.form.tagged:
            stripped = self.buffer.lstrip()
            if not stripped:
                self.space += self.buffer if not self.calls else ""
                self.buffer = ""
                return False
            if stripped[0] == "{":  # (content before it would have made the answer plain)
                self.state = "head"
            elif self.calls and stripped[0] == ";":  # Llama's separator between calls
                self.buffer = stripped[1:]
                return True
            else:
                self.state = "plain"
            return True
        start = self.buffer.find(TAG_OPEN)
        if start >= 0:
            self._content(self.buffer[:start], events)
            self.buffer, self.state = self.buffer[start + len(TAG_OPEN):], "head"
            return True
        # Hold back what may be the start of a tag.
        keep = next((n for n in range(min(len(TAG_OPEN) - 1, len(self.buffer)), 0, -1)
                     if TAG_OPEN.startswith(self.buffer[-n:])), 0)
        self._content(self.buffer[:len(self.buffer) - keep], events)
        self.buffer = self.buffer[len(self.buffer) - keep:]
        return False

    def _head(self, events: list) -> bool:
        match = _HEAD.match(self.buffer, partial=True)
        if match is not None and match.partial and (not self.form.tagged or TAG_CLOSE not in self.buffer):
            return False  # may still become a call's head
        name = json.loads(match.group(1)) if match is not None and not match.partial else None
        if name not in self.names:
            if self.form.tagged:
                self.state = "whole"
            else:  # not a call: the answer is text
                self.state = "plain"
            return True
        self._start(name, events)
        self.buffer = self.buffer[match.end() - 1:]  # from the arguments' "{"
        self.value, self.state = _ValueEnd(), "arguments"
        return True

    def _tail(self) -> bool:
        """After a call's arguments: to the end of its tag (tagged), or of its object (bare)."""
        if self.form.tagged:
            close = self.buffer.find(TAG_CLOSE)
            if close < 0:
                return False
            self.buffer, self.state = self.buffer[close + len(TAG_CLOSE):], "text"
            return True
        close = self.buffer.find("}")
        if close < 0:
            return False
        self.buffer, self.state = self.buffer[close + 1:], "text"
        return True

    # ---- events --------------------------------------------------------------------------------

    def _start(self, name: str, events: list) -> None:
        self.space = ""  # whitespace before a call is not content
        events.append(CallStart(self.calls, "call_" + uuid.uuid4().hex[:24], name))
        self.calls += 1

    def _content(self, text: str, events: list) -> None:
        body = text.rstrip()
        if body:
            events.append(Content(self.space + body))
            self.space = text[len(body):]
        else:
            self.space += text

    def _read_whole(self, body: str, events: list, closed: bool = False) -> None:
        """A call's text that did not start as expected (or was cut off before its arguments):
        a call if it is one whole, else content."""
        try:
            call = json.loads(body)
        except ValueError:
            call = None
        arguments = None
        if isinstance(call, dict) and call.get("name") in self.names:
            arguments = call.get("arguments", call.get("parameters"))
        if isinstance(arguments, dict):
            self._start(call["name"], events)
            events.append(Arguments(self.calls - 1, json.dumps(arguments, ensure_ascii=False)))
        elif self.form.tagged:
            self._content(TAG_OPEN + body + (TAG_CLOSE if closed else ""), events)
        else:
            self._content(body, events)


def collect(events: list) -> tuple[str, list[dict]]:
    """The content and the calls that ``events`` spell, in the body's shape."""
    content, calls = [], []
    for event in events:
        if isinstance(event, Content):
            content.append(event.text)
        elif isinstance(event, CallStart):
            calls.append({"id": event.id, "type": "function", "function": {"name": event.name, "arguments": ""}})
        else:
            calls[event.index]["function"]["arguments"] += event.text
    return "".join(content), calls


def delta(event) -> dict:
    """A stream's delta for one event."""
    if isinstance(event, Content):
        return {"content": event.text}
    if isinstance(event, CallStart):
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}
