"""Request fields that would change the generated text and that the local engine does not
implement: one table, and the one check that answers such a field with a 400 naming it (the
project's rule: a field we do not honour is refused, never ignored silently).

Each field has its *neutral* values, the ones that ask for nothing beyond what the engine does
anyway; they are accepted, because real clients send them with every request (``presence_penalty:
0``, ``tools: []``, ...). ``response_format`` is implemented (``engine/grammar.py``), so it is
not here; ``tools`` and ``tool_choice`` are implemented on the local engine's chats
(``tool_calls/``), so they are here for completions and for remote verification. A field sent as
null never gets here: null means not sent (``schema.py``).

``dispatch.py`` checks where the route is known: the local engine refuses such a field; remote
verification never takes a request carrying one (it is forwarded plainly instead); a plain
forward relays every field to its upstream unchanged, and the upstream honours it.

Not in the table, so accepted and ignored as before, are fields that leave the tokens alone:
``store``, ``metadata``, ``service_tier``, ``user``, ``prompt_cache_key``, ``safety_identifier``,
``parallel_tool_calls`` (implemented with tools; nothing to call without them), ``logprobs`` and
``n`` (implemented), ...
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from foretell.proxy.server.api_error import APIError


@dataclass(frozen=True)
class RequestContext:
    """What a neutrality test may need besides the field's value."""

    body: dict
    is_chat: bool
    # The chat template a chat prompt is rendered with ("" for none: the plain transcript);
    # None when it is not known here (an upstream's model).
    chat_template: str | None


@dataclass(frozen=True)
class UnsupportedField:
    neutral: Callable[[object, RequestContext], bool]
    what: str  # what the field asks for, in the refusal
    accepted: str | None  # its neutral values, in the refusal; None: none (leave it out)
    chat_only: bool = False  # a field about the chat prompt: meaningless (ignored) on completions
    local_chat: bool = False  # the local engine implements it on chats (not on completions)


# ---- neutrality tests ------------------------------------------------------------------------------

def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _equals(neutral: float):
    return lambda value, context: _number(value) and value == neutral


def _is(*neutral):
    # Exact JSON values (a boolean is not the number 0 here, nor 0 the boolean false).
    return lambda value, context: any(type(value) is type(n) and value == n for n in neutral)


def _empty(value, context) -> bool:
    return isinstance(value, (list, dict, str)) and len(value) == 0


def _never(value, context) -> bool:
    return False


def _zero_biases(value, context) -> bool:
    return isinstance(value, dict) and all(_number(bias) and bias == 0 for bias in value.values())


def _text_modalities(value, context) -> bool:
    return isinstance(value, list) and all(modality == "text" for modality in value)


def _no_tool_choice(value, context) -> bool:
    # "auto" with tools would let the model call them: tools are refused on their own.
    return value in ("none", "auto")


def _unless_the_template_reads(name: str):
    """Neutral unless the chat prompt's template reads ``name`` (as gpt-oss's reads
    reasoning_effort): the prompt is rendered without it, so only a template that reads it
    would have written other tokens. A completion prompt is raw text: no template to read it."""
    def neutral(value, context: RequestContext) -> bool:
        if not context.is_chat:
            return True
        return context.chat_template is not None and name not in context.chat_template
    return neutral


def _template_reads_none(value, context: RequestContext) -> bool:
    # chat_template_kwargs are variables for the template: ones it never reads change nothing
    # (Qwen 3's enable_thinking sent to another model).
    return (isinstance(value, dict) and context.chat_template is not None
            and not any(name in context.chat_template for name in value))


def _best_of_n(value, context) -> bool:
    # best_of candidates, the n best returned: best_of == n selects nothing.
    return _number(value) and value == (context.body.get("n") or 1)


def _the_max_tokens(value, context) -> bool:
    # llama.cpp's name for the length; the same number as max_tokens asks for nothing else.
    body = context.body
    length = body.get("max_completion_tokens")
    return _number(value) and value == (length if length is not None else body.get("max_tokens"))


# ---- the table ------------------------------------------------------------------------------------

UNSUPPORTED: dict[str, UnsupportedField] = {
    # OpenAI's
    "tools": UnsupportedField(_empty, "tool calling", "[]", local_chat=True),
    "tool_choice": UnsupportedField(_no_tool_choice, "tool calling", '"none", or "auto" without tools',
                                    local_chat=True),
    "functions": UnsupportedField(_empty, "function calling", "[]"),
    "function_call": UnsupportedField(_no_tool_choice, "function calling", '"none", or "auto" without functions'),
    "logit_bias": UnsupportedField(_zero_biases, "biased token scores", "{} (or biases of 0)"),
    "presence_penalty": UnsupportedField(_equals(0), "a repetition penalty", "0"),
    "frequency_penalty": UnsupportedField(_equals(0), "a repetition penalty", "0"),
    "audio": UnsupportedField(_never, "audio output", None),
    "modalities": UnsupportedField(_text_modalities, "output other than text", '["text"]'),
    "web_search_options": UnsupportedField(_empty, "web search", "{}"),
    "reasoning_effort": UnsupportedField(_unless_the_template_reads("reasoning_effort"),
                                         "a reasoning effort this model's chat template reads", None,
                                         chat_only=True),
    "verbosity": UnsupportedField(_unless_the_template_reads("verbosity"),
                                  "a verbosity this model's chat template reads", None, chat_only=True),
    "best_of": UnsupportedField(_best_of_n, "choosing the best of several completions", "n (1 by default)"),
    "suffix": UnsupportedField(_empty, "insertion (text after the completion)", '""'),
    # vLLM's extensions
    "repetition_penalty": UnsupportedField(_equals(1), "a repetition penalty", "1"),
    "min_p": UnsupportedField(_equals(0), "min-p sampling", "0"),
    "min_tokens": UnsupportedField(_equals(0), "a minimum length", "0"),
    "ignore_eos": UnsupportedField(_is(False), "generating past the end of the text", "false"),
    "stop_token_ids": UnsupportedField(_empty, "stop token ids", "[] (stop strings are supported: stop)"),
    "bad_words": UnsupportedField(_empty, "banned words", "[]"),
    "allowed_token_ids": UnsupportedField(_never, "a restricted vocabulary", None),
    "logits_processors": UnsupportedField(_empty, "logits processors", "[]"),
    "guided_json": UnsupportedField(_never, "structured output", None),
    "guided_regex": UnsupportedField(_never, "structured output", None),
    "guided_choice": UnsupportedField(_never, "structured output", None),
    "guided_grammar": UnsupportedField(_never, "structured output", None),
    "structured_outputs": UnsupportedField(_empty, "structured output", "{}"),
    "use_beam_search": UnsupportedField(_is(False), "beam search", "false"),
    "length_penalty": UnsupportedField(_equals(1), "beam search's length penalty", "1"),
    "include_stop_str_in_output": UnsupportedField(_is(False), "the stop string in the text", "false"),
    "truncate_prompt_tokens": UnsupportedField(_never, "a truncated prompt", None),
    "chat_template": UnsupportedField(_never, "a chat template of the request's own", None, chat_only=True),
    "chat_template_kwargs": UnsupportedField(_template_reads_none, "arguments this model's chat template reads",
                                             "{} (or arguments it does not read)", chat_only=True),
    "add_generation_prompt": UnsupportedField(_is(True), "a chat prompt without the assistant's turn", "true",
                                              chat_only=True),
    "continue_final_message": UnsupportedField(_is(False), "continuing the last message", "false",
                                               chat_only=True),
    # llama.cpp's extensions
    "repeat_penalty": UnsupportedField(_equals(1), "a repetition penalty", "1"),
    "typical_p": UnsupportedField(_equals(1), "locally typical sampling", "1"),
    "tfs_z": UnsupportedField(_equals(1), "tail-free sampling", "1"),
    "mirostat": UnsupportedField(_equals(0), "mirostat sampling", "0"),
    "dynatemp_range": UnsupportedField(_equals(0), "a dynamic temperature", "0"),
    "dry_multiplier": UnsupportedField(_equals(0), "the DRY repetition penalty", "0"),
    "xtc_probability": UnsupportedField(_equals(0), "XTC sampling", "0"),
    "grammar": UnsupportedField(_empty, "a grammar", '""'),
    "json_schema": UnsupportedField(_never, "structured output", None),
    "n_predict": UnsupportedField(_the_max_tokens, "a length under llama.cpp's name",
                                  "the same number as max_tokens (or use max_tokens)"),
}


def first_unsupported(body: dict, *, is_chat: bool, chat_template: str | None, local: bool = False) -> str | None:
    """The first field of ``body`` (in the table's order) with a value that is not neutral.
    ``chat_template``: the one the chat prompt is rendered with ("" for none), None if unknown;
    ``local``: for the local engine (which implements some fields on chats)."""
    context = RequestContext(body, is_chat, chat_template)
    for name, field in UNSUPPORTED.items():
        if name not in body or body[name] is None or (field.chat_only and not context.is_chat):
            continue
        if field.local_chat and local and is_chat:
            continue
        if not field.neutral(body[name], context):
            return name
    return None


def refuse_unsupported(body: dict, *, is_chat: bool, chat_template: str) -> None:
    """APIError 400 naming the first field of ``body`` that the local engine would ignore."""
    name = first_unsupported(body, is_chat=is_chat, chat_template=chat_template, local=True)
    if name is None:
        return
    field = UNSUPPORTED[name]
    accepted = f"; accepted: {field.accepted}, or leave it out" if field.accepted else "; leave it out"
    where = "on completions (use chat completions)" if field.local_chat else "on local models yet"
    raise APIError(400, f"{name} ({field.what}) is not supported {where}{accepted}",
                   param=name, code="unsupported_value" if field.accepted else "unsupported_parameter")
