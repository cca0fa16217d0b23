"""The remote protocol as pure functions: the bodies sent to an upstream (an echo request, a plain
greedy stream) and the checks that turn its answers into tokens we can trust, or a
``RemoteFailure``. No state and no I/O here: the session (``session.py``) decides what to send."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import httpx

TOKEN_ID = re.compile(r"token_id:(\d+)")
# Token strings that may be a special token (EOS, BOS, end of turn): never emitted as text.
SPECIAL_LOOKING = re.compile(r"<[^<>\s]{1,40}>|<\|[^|\s]{1,40}\|>")


class RemoteFailure(Exception):
    """The upstream failed or answered something the loop cannot trust."""

    def __init__(self, message: str, *, unsupported: bool = False, status: int | None = None):
        super().__init__(message)
        self.unsupported = unsupported  # the upstream does not do echo with prompt logprobs
        self.status = status  # the upstream's HTTP status, when it answered one
        self.id_prompts_refused = False  # the request may go on with text prompts


def trusted(text) -> bool:
    """A token string that is plain text (never a possible special token or a broken byte)."""
    return isinstance(text, str) and bool(text) and "\ufffd" not in text and not SPECIAL_LOOKING.fullmatch(text)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _token_id(string: str) -> int:
    return int(string[len("token_id:"):])


# ---- what is sent -----------------------------------------------------------------------------

def echo_body(model: str, sent: str | list[int], *, token_ids: bool, special: bool | None) -> dict:
    """One echo request scoring ``sent`` (text or token ids): every prompt token with the model's
    best alternative, and one generated token."""
    body = {"model": model, "prompt": sent, "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0}
    return _with_alignment(body, sent, token_ids, special)


def plain_body(model: str, prompt: str | list[int], max_tokens: int, *, token_ids: bool,
               special: bool | None) -> dict:
    """A plain greedy stream continuing ``prompt``, each chunk with its tokens and the usage at the end."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": 0}
    return _with_alignment(body, prompt, token_ids, special)


def _with_alignment(body: dict, prompt, token_ids: bool, special: bool | None) -> dict:
    if token_ids:
        body["return_tokens_as_token_ids"] = True
    if special is not None and isinstance(prompt, str):  # a prompt of ids holds its specials already
        body["add_special_tokens"] = special
    return body


# ---- the echo answer --------------------------------------------------------------------------

@dataclass
class EchoAnswer:
    ids: bool  # tokens came as "token_id:<id>"
    keys: list  # every token of the answer (ids, or strings); the prompt's first
    strings: list[str]  # the raw token strings
    best: list  # per token: the most likely key at that position (None where absent)
    starts: list  # text mode: each prompt token's start in the text sent (None: not laid)
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the upstream says it reused (its prefix cache)
    completion_tokens: int
    generated: object  # the generated token's key, or None
    generated_text: str
    finish_reason: str | None

    def bonus(self) -> tuple[list[tuple], str | None]:
        """The token generated after a fully accepted draft as (key, text), or the end of the
        output: ([tokens], reason the output ends or None)."""
        if self.generated is not None:
            if self.ids:
                return [(self.generated, "")], None
            string = self.strings[self.prompt_tokens]
            if trusted(string) and string == self.generated_text:
                return [(string, string)], None
        if self.finish_reason == "stop" and not self.generated_text:
            # The end-of-sequence token: counted, no text (token ids: the id itself ends it).
            return ([] if self.ids else [(None, "")]), "stop"
        if self.finish_reason == "length" and self.completion_tokens == 0:
            return [], "length"  # no room left in the upstream's context
        return [], None


def parse_echo(payload, sent: str | list[int]) -> EchoAnswer:
    """Check and unpack an echo answer to the prompt ``sent`` (text, or token ids: then the
    caller checks the echoed ids); RemoteFailure when it is not one we can trust."""
    try:
        choice = payload["choices"][0]
        logprobs = choice["logprobs"]
        tokens, tops = logprobs["tokens"], logprobs["top_logprobs"]
        prompt_tokens = payload["usage"]["prompt_tokens"]
        completion_tokens = payload["usage"].get("completion_tokens", 1)
        text, finish = choice["text"], choice.get("finish_reason")
    except (KeyError, IndexError, TypeError):
        raise RemoteFailure("the echo answer has no prompt logprobs", unsupported=True) from None
    if not (isinstance(tokens, list) and isinstance(tops, list) and len(tokens) == len(tops)
            and all(isinstance(t, str) for t in tokens) and isinstance(text, str)
            and isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool)):
        raise RemoteFailure("the echo answer's logprobs are malformed", unsupported=True)
    if not 1 <= prompt_tokens <= len(tokens) <= prompt_tokens + 1:
        raise RemoteFailure(f"the echo answer covers {len(tokens)} tokens for {prompt_tokens} prompt tokens",
                            unsupported=True)
    if isinstance(sent, str) and not text.startswith(sent):
        raise RemoteFailure("the echo answer's text does not start with the prompt sent", unsupported=True)
    ids = all(TOKEN_ID.fullmatch(t) for t in tokens)
    keys = [_token_id(t) for t in tokens] if ids else list(tokens)
    best = _best_keys(tops, ids)
    starts: list = []
    if not ids and isinstance(sent, str):
        starts = lay_tokens(tokens[:prompt_tokens], sent)
        _check_offsets(logprobs.get("text_offset"), tokens, starts)
    generated = keys[prompt_tokens] if len(tokens) > prompt_tokens else None
    if not isinstance(completion_tokens, int):
        completion_tokens = 1
    details = payload["usage"].get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and not isinstance(cached, bool) and 0 <= cached <= prompt_tokens else 0
    # A prompt of token ids echoes as the upstream decodes it: the generated text is not split off.
    generated_text = text[len(sent):] if isinstance(sent, str) else ""
    return EchoAnswer(ids, keys, list(tokens), best, starts, prompt_tokens, cached, completion_tokens,
                      generated, generated_text, finish)


def _best_keys(tops: list, ids: bool) -> list:
    """Per token, the most likely key of its top_logprobs (None where there are none)."""
    best = []
    for top in tops:
        if not isinstance(top, dict) or not top:
            best.append(None)  # absent (the first token has none); fatal only where it is needed
            continue
        if not all(isinstance(k, str) and _number(v) for k, v in top.items()):
            raise RemoteFailure("the echo answer's top_logprobs are malformed")
        key = max(top, key=top.get)  # the first of equal values, in the order given
        if ids:
            if not TOKEN_ID.fullmatch(key):
                raise RemoteFailure("the echo answer mixes token ids and token strings")
            key = _token_id(key)
        best.append(key)
    return best


def _check_offsets(offsets, tokens: list[str], starts: list) -> None:
    """The answer's ``text_offset`` (where it sends one) must agree with where its tokens were
    laid, up to one constant shift (a ``<bos>`` the upstream counts)."""
    if offsets is None:
        return
    if not (isinstance(offsets, list) and len(offsets) == len(tokens) and all(_number(o) for o in offsets)):
        raise RemoteFailure("the echo answer's text_offset is malformed")
    shifts = {offsets[j] - start for j, start in enumerate(starts)
              if start is not None and tokens[j] and not (start == 0 and SPECIAL_LOOKING.fullmatch(tokens[j]))}
    if len(shifts) > 1:
        raise RemoteFailure("the echo answer's text_offset disagrees with its tokens")


def lay_tokens(strings: list[str], text: str) -> list:
    """Each token string's start in ``text``, laid end to end (a special token at the very start,
    such as ``<bos>``, spans nothing); None from the first one that does not fit."""
    starts, position, broken = [], 0, False
    for string in strings:
        if broken:
            starts.append(None)
        elif text.startswith(string, position):
            starts.append(position)
            position += len(string)
        elif position == 0 and SPECIAL_LOOKING.fullmatch(string):
            starts.append(0)
        else:
            broken = True
            starts.append(None)
    return starts


# ---- a plain stream ----------------------------------------------------------------------------

async def sse_events(response: httpx.Response):
    """The JSON payloads of an event stream, up to ``[DONE]``."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        try:
            yield json.loads(data)
        except ValueError:
            raise RemoteFailure("the upstream's stream holds an event that is not JSON") from None


def stream_token_keys(strings: list, text: str, ids: bool) -> list[tuple] | None:
    """(key, text) per token of a plain stream chunk; None where its token strings do not spell
    its text (a character split across tokens: the text wins, see ``unspelled_keys``)."""
    if ids:
        if not all(isinstance(s, str) and TOKEN_ID.fullmatch(s) for s in strings):
            raise RemoteFailure("the upstream ignores return_tokens_as_token_ids")
        return [(_token_id(s), "") for s in strings]
    if all(isinstance(s, str) for s in strings):
        if "".join(strings) == text:
            return [(s, s) for s in strings]
        # An end-of-sequence token shown by its name beside no text: counted, no text.
        named = [bool(SPECIAL_LOOKING.fullmatch(s)) for s in strings]
        if "".join(s for s, special in zip(strings, named) if not special) == text:
            return [(None, "") if special else (s, s) for s, special in zip(strings, named)]
    return None


def unspelled_keys(strings: list, text: str) -> list[tuple]:
    """A chunk whose tokens do not spell its text, as keys that can never be compared."""
    return [(None, text)] + [(None, "") for _ in strings[1:]]
