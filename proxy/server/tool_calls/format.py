"""How the local model writes a tool call, which tools a request offers, and the grammar that
holds a required call to the functions' parameter schemas."""

from __future__ import annotations

import json
from dataclasses import dataclass

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.schema import LocalToolFields, NamedToolChoice, validate

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class CallFormat:
    """The way calls are written in an answer: ``{"name": ..., "arguments": {...}}`` inside
    ``<tool_call>`` tags (Qwen's and Hermes' templates; foretell's own for a model whose template
    says nothing of tools), or the bare JSON object (Llama 3's templates, whose key is
    ``parameters``)."""

    tagged: bool
    arguments_key: str  # "arguments" or "parameters"
    # The chat template renders the tools itself; else foretell writes them into a system turn.
    template_reads_tools: bool

    def write(self, name: str, arguments: str) -> str:
        """A call as the model would write it (``arguments``: JSON text)."""
        body = f'{{"name": {json.dumps(name)}, "{self.arguments_key}": {arguments}}}'
        return f"{TAG_OPEN}\n{body}\n{TAG_CLOSE}" if self.tagged else body

    def separator(self) -> str:
        return "\n"


def call_format(chat_template: str) -> CallFormat:
    """The call format of a model whose chat template is ``chat_template`` ("" for none: the
    plain transcript)."""
    reads_tools = "tools" in chat_template
    if not reads_tools or TAG_OPEN in chat_template:
        return CallFormat(tagged=True, arguments_key="arguments", template_reads_tools=reads_tools)
    key = "parameters" if '"parameters"' in chat_template else "arguments"
    return CallFormat(tagged=False, arguments_key=key, template_reads_tools=True)


@dataclass(frozen=True)
class ToolPlan:
    """The tools a chat request offers the local model, and what it must do with them."""

    tools: tuple  # schema.Tool each
    required: bool  # a call must be made (tool_choice "required" or a named function)
    function: str | None  # the one function every call names (a named tool_choice)
    parallel: bool  # several calls in one answer (parallel_tool_calls, true by default)

    def names(self) -> frozenset[str]:
        return frozenset(tool.function.name for tool in self.tools)

    def constrained(self) -> bool:
        """Is the answer decoded under ``call_grammar``? A required call is; so is a free one
        where a function is ``strict`` (OpenAI's promise: a call follows its schema)."""
        return self.required or any(tool.function.strict for tool in self.tools)

    def callable(self) -> tuple:
        """The tools a call may name."""
        return tuple(tool for tool in self.tools if self.function in (None, tool.function.name))

    def as_sent(self) -> list[dict]:
        """The tools in OpenAI's shape, for a chat template's ``tools``."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def tool_plan(body: dict) -> ToolPlan | None:
    """The tool plan of a chat request's body; None when it offers no tools or tool_choice is
    "none" (the prompt then shows no tools, and the answer is text). APIError 400 for tool
    fields the local engine does not take (a tool other than a function, a named function that
    is not among the tools)."""
    fields = validate(LocalToolFields, {name: body[name] for name in ("tools", "tool_choice", "parallel_tool_calls")
                                        if body.get(name) is not None})
    names = [tool.function.name for tool in fields.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two functions have the same name", param="tools")
    named = fields.tool_choice.function.name if isinstance(fields.tool_choice, NamedToolChoice) else None
    if (fields.tool_choice == "required" or named is not None) and not names:
        raise APIError(400, "tool_choice: a required call needs tools", param="tool_choice")
    if named is not None and named not in names:
        raise APIError(400, f"tool_choice names {named!r}, which is not one of the tools",
                       param="tool_choice.function.name")
    if not names or fields.tool_choice == "none":
        return None
    return ToolPlan(tools=tuple(fields.tools), required=fields.tool_choice == "required" or named is not None,
                    function=named, parallel=fields.parallel_tool_calls)


# Any text without a call's opening tag, as a Lark lexeme (llguidance's & and ~ on regexes).
_NO_TAG = f"(/[\\s\\S]*/ & ~/[\\s\\S]*{TAG_OPEN}[\\s\\S]*/)"
# Any text that does not open with a JSON object (the bare format's calls come first).
_NO_OBJECT = "(/[\\s\\S]*/ & ~/\\s*\\{[\\s\\S]*/)"


def call_grammar(plan: ToolPlan, form: CallFormat) -> str:
    """llguidance's grammar (Lark, with JSON schemas inside) of an answer's calls: one, or with
    ``plan.parallel`` one or more, each naming a callable function and following its parameter
    schema, key order as written (the name first, so a stream can give it before the arguments).
    A required call is the whole answer; a free one (``plan.constrained()`` by a strict function)
    may be text instead, or text then the calls (tagged) where they are read as calls."""
    one_of = [{"type": "object",
               "properties": {"name": {"const": tool.function.name},
                              form.arguments_key: _parameters(tool.function.parameters)},
               "required": ["name", form.arguments_key], "additionalProperties": False}
              for tool in plan.callable()]
    schema = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
    # Spaced as calls are written (``CallFormat.write``), and no room for runs of whitespace,
    # which a weak model under a mask can fill its whole length with.
    schema["x-guidance"] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    close = json.dumps(chr(10) + TAG_CLOSE)
    call = f'{json.dumps(TAG_OPEN + chr(10))} body {close}' if form.tagged else "body"
    more = f' ({json.dumps(form.separator())} call)*' if plan.parallel else ""
    rules = f"call: {call}\nbody: %json {json.dumps(schema)}\n"
    if plan.required:
        return f"start: call{more}\n" + rules
    if form.tagged:  # text, or text up to the first tag then the calls
        return (f"start: TEXT | OPEN body {close}{more}\nTEXT: {_NO_TAG}\n"
                f"OPEN: {_NO_TAG} {json.dumps(TAG_OPEN + chr(10))}\n" + rules)
    return f"start: TEXT | call{more}\nTEXT: {_NO_OBJECT}\n" + rules


def _parameters(parameters: dict | None) -> dict:
    # OpenAI: a function without parameters takes an empty argument list.
    if not parameters:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return parameters


def grammar_error(error: Exception) -> APIError:
    """A 400 for tools whose calls' grammar cannot be built (a parameter schema the grammar
    engine does not take, or a model whose tokenizer it cannot read)."""
    return APIError(400, f"tools: the grammar of their calls cannot be built: {error}",
                    param="tools", code="invalid_json_schema")
