"""Text out, incremental and append-only.

Decoding the whole output every round is quadratic, and with byte-fallback tokens it is not even
append-only: Gemma's decoder turns a run of byte tokens that ends in an unfinished character into
replacement characters *as a whole*, so ``decode(<4 bytes of 𝔘> + <0xF0>)`` loses the complete 𝔘
too. ``IncrementalDetokenizer`` decodes a short window of recent tokens and releases text only at
token boundaries where the window's text ends with a complete character; the released pieces are
the text, so a stream and the final answer are the same string by construction.

``StopStringHold`` sits on top: it finds stop strings as text arrives and holds back the longest
suffix that could still grow into one, so nothing streamed is ever taken back.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# A character is at most 4 UTF-8 bytes, so at most 3 trailing byte tokens can be unfinished.
MAX_UNFINISHED_TOKENS = 3


class IncrementalDetokenizer:
    """Turns token ids, pushed a few at a time, into append-only text."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        # The window decoded each time starts at the previous release point: context so that the
        # first new token renders as inside the text (leading spaces), and a character boundary,
        # so the window never starts inside a byte-fallback character.
        self.prefix_offset = 0
        self.read_offset = 0  # tokens whose text has been released
        self.text = ""  # all text released so far

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: list[int]) -> str:
        """Add tokens; return the text they complete (possibly empty)."""
        self.ids.extend(ids)
        return self._release(final=False)

    def flush(self) -> str:
        """The output has ended: release whatever is left, unfinished characters included."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.read_offset >= len(self.ids):
            return ""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        # The longest run of new tokens whose text ends with a complete character.
        lowest = self.read_offset + 1 if final else max(self.read_offset + 1,
                                                        len(self.ids) - MAX_UNFINISHED_TOKENS)
        for end in range(len(self.ids), lowest - 1, -1):
            text = self._decode(self.ids[self.prefix_offset:end])
            if text.startswith(prefix_text):
                piece = text[len(prefix_text):]
            else:
                # The decoder merged the new bytes with the context's (a stray byte after a
                # character written as bytes turns the whole run into U+FFFDs): the new tokens
                # on their own, which start at a character boundary.
                piece = self._decode(self.ids[self.read_offset:end])
            if final or not piece.endswith(REPLACEMENT):
                self.prefix_offset, self.read_offset = self.read_offset, end
                self.text += piece
                return piece
        return ""


class StopStringHold:
    """Stop strings over append-only text: where one completes, and what is safe to stream.

    ``feed(piece)`` adds text; ``stop_at`` is then the index in ``text`` where the first stop
    string starts (None while none has completed). ``releasable`` is how much of ``text`` can be
    streamed: all of it, minus the longest suffix that is a proper prefix of a stop string.
    """

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.stop_at: int | None = None

    def feed(self, piece: str) -> None:
        if self.stop_at is not None or not piece:
            return
        searched_from = max(0, len(self.text) - self.longest + 1)
        self.text += piece
        found = [i for i in (self.text.find(s, searched_from) for s in self.stop) if i >= 0]
        if found:
            self.stop_at = min(found)
            self.text = self.text[:self.stop_at]

    @property
    def releasable(self) -> int:
        if self.stop_at is not None or not self.stop:
            return len(self.text)
        hold = 0
        for s in self.stop:
            for length in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:length]):
                    hold = length
                    break
        return len(self.text) - hold
