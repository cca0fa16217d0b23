"""Where plain decoding would have stopped inside a run of newly accepted tokens.

Plain decoding checks its stop conditions after every token. Speculation accepts many tokens at
once, so the engine must find the first token at which plain decoding would have stopped and cut
the output exactly there: at the first EOS, at ``max_tokens``, or at the first token whose text
completes a stop string (the returned text then ends just before the stop string, as OpenAI's).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopDecision:
    keep: int  # how many of the new tokens to keep
    finish_reason: str | None  # "stop", "length", or None to carry on
    text_end: int | None = None  # cut the completion text here (a stop string starts here)


def stable_text(text: str) -> str:
    """Text without a trailing partial character (an unfinished UTF-8 byte sequence decodes
    to U+FFFD until its last byte arrives)."""
    return text.rstrip("\ufffd")


def find_stop_string(text: str, stop: tuple[str, ...], search_from: int) -> int | None:
    """Earliest start of any stop string in ``text`` that ends after ``search_from``."""
    best = None
    for s in stop:
        position = text.find(s, max(0, search_from - len(s) + 1))
        if position >= 0 and (best is None or position < best):
            best = position
    return best


def decide_stop(
    new_tokens: list[int],
    previous_ids: list[int],
    previous_text_length: int,
    decode,
    *,
    eos_token_ids: frozenset[int],
    stop: tuple[str, ...],
    max_tokens: int,
) -> StopDecision:
    """Decide how many of ``new_tokens`` plain decoding would have produced.

    ``decode(ids) -> str`` turns completion token ids into text; ``previous_ids`` are the
    completion tokens before this round and ``previous_text_length`` the length of their text.
    """
    keep, reason = len(new_tokens), None
    for index, token in enumerate(new_tokens):
        if token in eos_token_ids:
            keep, reason = index + 1, "stop"
            break
    room = max_tokens - len(previous_ids)
    if keep > room or (keep == room and reason is None):
        keep, reason = room, "length"
    if stop:
        text = decode(previous_ids + new_tokens[:keep])
        found = find_stop_string(text, stop, previous_text_length)
        if found is not None:
            # The shortest prefix of the new tokens whose text already holds a stop string.
            low, high = 1, keep
            while low < high:
                middle = (low + high) // 2
                partial = decode(previous_ids + new_tokens[:middle])
                if find_stop_string(partial, stop, previous_text_length) is None:
                    low = middle + 1
                else:
                    high = middle
            return StopDecision(keep=low, finish_reason="stop", text_end=found)
    return StopDecision(keep=keep, finish_reason=reason)
