"""Terminal colours by token origin for ``foretell generate --color`` and ``foretell edit --color``:
green for text accepted from the prediction, cyan from prompt lookup, magenta from the draft cache
of earlier answers (``suffix_cache``), yellow from the draft model (``draft_model``), the terminal's
own colour for the target model's own tokens.

``--color auto`` (the default) colours when stdout is a terminal and ``NO_COLOR`` is not set
(https://no-color.org); ``always`` and ``never`` decide regardless.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping, TextIO

RESET = "\x1b[0m"
STYLES = {"prediction": "\x1b[32m", "prompt_lookup": "\x1b[36m", "suffix_cache": "\x1b[35m",
          "draft_model": "\x1b[33m"}  # green, cyan, magenta, yellow
CHOICES = ("auto", "always", "never")


def use_color(mode: str, stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    environ = os.environ if environ is None else environ
    if environ.get("NO_COLOR") or environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def paint(text: str, origin: str | None) -> str:
    """``text`` in its origin's colour; the colour is closed before each line break, so no line
    (or pager) inherits it."""
    style = STYLES.get(origin or "")
    if style is None or not text:
        return text
    return "\n".join(style + line + RESET if line else line for line in text.split("\n"))


def legend() -> str:
    return (f"foretell: colours: {paint('prediction', 'prediction')}, "
            f"{paint('prompt lookup', 'prompt_lookup')}, {paint('earlier answers', 'suffix_cache')}, "
            f"{paint('draft model', 'draft_model')}, the target model's own: plain")


def paint_spans(spans: Iterable[tuple[str, str | None]]) -> str:
    return "".join(paint(text, origin) for text, origin in spans)


def paint_within(spans: list[tuple[str, str | None]], text: str) -> str:
    """Colour ``text``, a part of the spans' joined text (the edited file inside the model's
    answer), by the origins at its first occurrence there; text that is not found, or lies past
    the spans, stays plain."""
    whole = "".join(piece for piece, _ in spans)
    core = text.rstrip("\n")  # the answer's copy may lack the final newline (the stop string)
    start = whole.find(core) if core else -1
    if start < 0:
        return text
    out, at, end = [], 0, start + len(core)
    for piece, origin in spans:
        low, high = max(at, start), min(at + len(piece), end)
        if low < high:
            out.append(paint(whole[low:high], origin))
        at += len(piece)
    return "".join(out) + text[len(core):]
