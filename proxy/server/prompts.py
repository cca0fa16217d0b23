"""A request's prompt as token ids: the chat template (or a plain transcript), then tokenisation.

This is CPU work in proportion to the request (a 4 MB prompt takes seconds to tokenise), so the
server runs it on a worker thread, never on the event loop, and a prompt far over the context is
refused after tokenising a bounded prefix of it.
"""

from __future__ import annotations

from foretell.proxy.server.api_error import APIError
from foretell.proxy.server.tool_calls.format import call_format
from foretell.proxy.server.tool_calls.prompt import chat_turns

# No token of common vocabularies spans more characters than this (Gemma's longest: 31), so a
# prefix of this many characters per token of the context holds more tokens than the context:
# a longer prompt is refused on its prefix, and only prompts shorter than that are tokenised whole.
PREFIX_CHARS_PER_TOKEN = 32
# Tokens that cutting a text may add at the cut (a word split in two), at most.
CUT_SLACK = 16


def request_prompt_ids(tokenizer, parsed, is_chat: bool, context: int | None, tools=None) -> list[int]:
    """The prompt token ids of a validated request (``tools``: its ``ToolPlan``, where it offers
    tools); APIError 400 when they do not fit the model's context (None: the model names none) or
    the chat template refuses the messages."""
    if not is_chat and isinstance(parsed.prompt, list):
        return given_prompt_ids(tokenizer, parsed.prompt, context)
    text = chat_prompt(tokenizer, parsed.messages, tools) if is_chat else parsed.prompt
    return prompt_ids(tokenizer, text, context, param="messages" if is_chat else "prompt",
                      special=parsed.add_special_tokens)


def given_prompt_ids(tokenizer, ids: list[int], context: int | None) -> list[int]:
    """A prompt sent as token ids, used as sent (no BOS added); APIError 400 for an id outside
    the vocabulary or a prompt that does not fit the context."""
    vocabulary = len(tokenizer)
    bad = next((i for i, token in enumerate(ids) if token >= vocabulary), None)
    if bad is not None:
        raise APIError(400, f"prompt.{bad}: {ids[bad]} is not a token id of this model (0 to {vocabulary - 1})",
                       param=f"prompt.{bad}")
    if context is not None:
        _check_fits(len(ids), context, "prompt")
    return list(ids)


def adds_special_tokens(tokenizer, text: str, asked: bool | None = None) -> bool:
    """Does tokenising ``text`` add the tokenizer's special tokens (its BOS)? ``asked``: the
    request's ``add_special_tokens`` (vLLM's field), None where it sent none: then yes, unless the
    text starts with the BOS already (chat templates write it themselves; not a second one)."""
    if asked is not None:
        return asked
    return not (bool(tokenizer.bos_token) and text.startswith(tokenizer.bos_token))


def prompt_ids(tokenizer, text: str, context: int | None, param: str, special: bool | None = None) -> list[int]:
    """``text``'s ids (``special``: the request's ``add_special_tokens``, ``adds_special_tokens``);
    APIError 400 where they do not fit ``context``."""
    add = adds_special_tokens(tokenizer, text, special)

    def encode(part: str) -> list[int]:
        return tokenizer(part, add_special_tokens=add)["input_ids"]

    if context is None:
        return encode(text)
    prefix_chars = PREFIX_CHARS_PER_TOKEN * context
    if len(text) > prefix_chars:
        # Refused on a prefix: if a prefix alone holds more tokens than the context (less those
        # the cut may have added), so does the whole. Tokenising megabytes whole would take
        # seconds of CPU only to refuse them, and creating and freeing a Python object per
        # token holds the GIL (stalling the event loop) for a tenth of a second.
        _check_fits(len(encode(text[:prefix_chars])) - CUT_SLACK, context, param, at_least=True)
    ids = encode(text)
    _check_fits(len(ids), context, param)
    return ids


def _check_fits(count: int, context: int, param: str, at_least: bool = False) -> None:
    if count >= context:
        raise APIError(400, f"the prompt has {'at least ' if at_least else ''}{count} tokens; this model's "
                       f"context is {context}", param=param, code="context_length_exceeded")


def template_source(tokenizer) -> str:
    """The model's chat template as text ("" without one: the plain transcript)."""
    template = getattr(tokenizer, "chat_template", None)
    return "" if not template else template if isinstance(template, str) else str(template)


def chat_prompt(tokenizer, messages, tools=None, add_generation_prompt: bool = True) -> str:
    """The prompt of a chat: its messages through the model's chat template, or the plain
    transcript (which always ends with the assistant's turn); ``tools``: the ``ToolPlan`` of the
    tools offered (``tool_calls/``)."""
    source = template_source(tokenizer)
    form = call_format(source)
    turns = chat_turns(messages, tools, form, has_template=bool(source))
    if source:
        offered = {"tools": tools.as_sent()} if tools is not None and form.template_reads_tools else {}
        try:
            return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                 **offered)
        except Exception as error:  # a template that rejects this conversation (e.g. roles)
            raise APIError(400, f"the model's chat template rejected the messages: {error}",
                           param="messages") from None
    lines = [f"{turn['role'].capitalize()}: {turn['content']}" for turn in turns]
    return "\n".join(lines) + "\nAssistant:"


# ---- where a chat turn ends ------------------------------------------------------------------------

# The plain transcript's role markers at the start of a line: the model writing one has finished
# its turn and begun inventing the next (a base model continues the conversation otherwise).
PLAIN_TRANSCRIPT_STOPS = ("\nUser:", "\nSystem:", "\nAssistant:", "\nDeveloper:", "\nTool:")
# End-of-turn tokens of common template families, looked for in the template's source when
# rendering a conversation does not show which token closes the assistant's turn.
KNOWN_END_OF_TURN = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>", "<|eot|>")
_SENTINEL = "FORETELLENDOFTURNPROBE"


def implied_chat_stops(tokenizer) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """(stop strings, stop token ids) that end a chat answer besides the request's own stops.

    Without a chat template (the plain transcript): the next role marker. With one: the
    special tokens the template closes an assistant turn with (Gemma 3: ``<end_of_turn>``); they
    end the output as EOS does, and being special they never appear in the text."""
    if not getattr(tokenizer, "chat_template", None):
        return PLAIN_TRANSCRIPT_STOPS, ()
    return (), end_of_turn_ids(tokenizer)


def end_of_turn_ids(tokenizer) -> tuple[int, ...]:
    special = set(tokenizer.all_special_ids) | {
        index for index, token in getattr(tokenizer, "added_tokens_decoder", {}).items() if token.special}
    found: list[int] = []
    # What the template writes right after an assistant's message: its first token, if special.
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _SENTINEL}],
            tokenize=False)
        after = text[text.rindex(_SENTINEL) + len(_SENTINEL):].lstrip()
        ids = tokenizer(after, add_special_tokens=False)["input_ids"] if after else []
        if ids and ids[0] in special:
            found.append(ids[0])
    except Exception:  # a template that refuses this conversation: only the known names below
        pass
    source = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else str(tokenizer.chat_template)
    for name in KNOWN_END_OF_TURN:
        index = tokenizer.convert_tokens_to_ids(name)
        if (name in source and isinstance(index, int) and index in special
                and index != tokenizer.unk_token_id and index not in found):
            found.append(index)
    return tuple(found)
