"""A chat's messages as turns for the chat template (or the plain transcript), with the tools
offered and the calls and results of earlier rounds.

A template that reads ``tools`` gets them as OpenAI sends them, and the history's calls and tool
results in the shape Hugging Face templates take (arguments as an object). Any other model (no
template: the plain transcript; a template that says nothing of tools) gets foretell's
instructions in a system turn, its earlier calls written in the call format, and each tool
result as a turn of its own.
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.schema import ToolCall, describe_validation_error
from foretell.proxy.server.tool_calls.format import TAG_CLOSE, TAG_OPEN, CallFormat, ToolPlan


def chat_turns(messages, plan: ToolPlan | None, form: CallFormat, has_template: bool) -> list[dict]:
    """The turns to render; ``plan`` None: no tools offered (the history's calls still show)."""
    turns = []
    for index, message in enumerate(messages):
        role = "system" if message.role == "developer" else message.role
        turn = {"role": role, "content": message.text()}
        if message.tool_calls:
            calls = _calls(message.tool_calls, index)
            if form.template_reads_tools:
                turn["tool_calls"] = [{"id": call.id, "type": "function",
                                       "function": {"name": call.function.name,
                                                    "arguments": _arguments_object(call.function.arguments)}}
                                      for call in calls]
            else:
                written = form.separator().join(form.write(call.function.name, call.function.arguments)
                                                for call in calls)
                turn["content"] = f"{turn['content']}\n{written}" if turn["content"] else written
        if role == "tool":
            if form.template_reads_tools:
                turn["tool_call_id"] = message.tool_call_id
                if message.name:
                    turn["name"] = message.name
            elif has_template:  # a template without tools knows users and assistants only
                turn = {"role": "user", "content": f"Result of call {message.tool_call_id}: {turn['content']}"}
        turns.append(turn)
    if plan is not None and not form.template_reads_tools:
        turns = _with_instructions(turns, instructions(plan))
    return turns


def instructions(plan: ToolPlan) -> str:
    """foretell's tool instructions, for a model whose template does not render tools."""
    functions = "\n".join(json.dumps(tool.function.model_dump(exclude_none=True), ensure_ascii=False)
                          for tool in plan.callable())
    example = f'{TAG_OPEN}\n{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}\n{TAG_CLOSE}'
    if plan.function is not None:
        when = f"Call the function {plan.function}."
    elif plan.required:
        when = "Call one of the functions."
    else:
        when = "Call a function when it helps; otherwise answer in text."
    how_many = "You may make several calls, one after another." if plan.parallel else "Make one call at most."
    return f"You can call these functions:\n{functions}\nTo call one, answer with\n{example}\n{when} {how_many}"


def _with_instructions(turns: list[dict], text: str) -> list[dict]:
    if turns and turns[0]["role"] == "system":
        return [{**turns[0], "content": f"{text}\n\n{turns[0]['content']}"}] + turns[1:]
    return [{"role": "system", "content": text}] + turns


def _calls(raw: list[dict], message: int) -> list[ToolCall]:
    calls = []
    for index, call in enumerate(raw):
        try:
            calls.append(ToolCall.model_validate(call))
        except ValidationError as error:
            detail, _ = describe_validation_error(error)
            param = f"messages.{message}.tool_calls.{index}"
            raise APIError(400, f"{param}: {detail} (the local model takes function calls)", param=param) from None
    return calls


def _arguments_object(arguments: str):
    # Hugging Face templates write the arguments with tojson: an object, not its JSON text.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
