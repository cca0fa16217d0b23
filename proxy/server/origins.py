"""Which draft source wrote each character of a stream: the ``report_origins`` extension.

The engine reports an origin per *token* (``"prediction"``, ``"prompt_lookup"``, ``"suffix_cache"``, ``"draft_model"``,
or None for the target's own), but streams *text*, and the two do not line up: the detokenizer
holds back an unfinished character (byte-fallback tokens), stop strings hold back a possible
prefix, and a chunk may end in the middle of a token's text. ``OriginSpans`` keeps a queue of
(origin, characters) for the tokens verified so far and takes characters from its front as text
is released, so each chunk's text is split into runs of one origin that concatenate exactly to
the chunk's text.

A token's characters are counted from its own bytes fed through one incremental UTF-8 decoder:
the 4 byte tokens of an emoji count 0, 0, 0 and 1 (the character goes to the token that
completes it), a special token counts 0 (the detokenizer skips them). Should the count ever
disagree with the released text (a tokenizer whose decoder strips or merges spaces), the chunk
still splits exactly: characters beyond the queue go to the latest token's origin, and a queue
longer than the text that may legitimately be held back is trimmed from its front, so an error
never carries further than one chunk.
"""

from __future__ import annotations

import codecs
from collections import deque

from foretell.proxy.server.logprobs_format import BYTE_PIECE


class OriginSpans:
    """Split a stream's released text by the origins of the tokens that wrote it."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
        self.tokenizer = tokenizer
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()) or ())
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.bytes_of: dict[int, bytes] = {}
        self.queue: deque[list] = deque()  # [origin, characters not yet released]
        self.queued = 0  # characters in the queue
        # Released text may lag the tokens by a stop string's proper prefix, never more.
        self.hold = max((len(stop) - 1 for stop in stops if stop), default=0)
        self.last_origin: str | None = None
        self.tokens = 0  # verified since the last chunk
        self.passes = 0

    def _token_bytes(self, token_id: int) -> bytes:
        cached = self.bytes_of.get(token_id)
        if cached is None:
            if token_id in self.special:
                cached = b""
            else:
                piece = self.tokenizer.convert_ids_to_tokens(token_id)
                match = BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) else None
                cached = (bytes([int(match.group(1), 16)]) if match else
                          self.tokenizer.decode([token_id], skip_special_tokens=True).encode("utf-8"))
            self.bytes_of[token_id] = cached
        return cached

    def add(self, token_ids: list[int], origins: list[str | None]) -> None:
        """A round's verified tokens and the origin of each."""
        self.tokens += len(token_ids)
        self.passes += 1
        for token_id, origin in zip(token_ids, origins):
            self.last_origin = origin
            chars = len(self.decoder.decode(self._token_bytes(token_id)))
            if not chars:
                continue
            if self.queue and self.queue[-1][0] == origin:
                self.queue[-1][1] += chars
            else:
                self.queue.append([origin, chars])
            self.queued += chars

    def split(self, text: str) -> list[dict]:
        """``text`` (just released) as ``[{"text", "origin"}, ...]``: runs of one origin, in
        order, whose texts concatenate to ``text``."""
        spans: list[dict] = []

        def emit(piece: str, origin: str | None) -> None:
            if not piece:
                return
            if spans and spans[-1]["origin"] == origin:
                spans[-1]["text"] += piece
            else:
                spans.append({"text": piece, "origin": origin})

        at = 0
        while at < len(text) and self.queue:
            head = self.queue[0]
            take = min(head[1], len(text) - at)
            emit(text[at:at + take], head[0])
            at += take
            head[1] -= take
            self.queued -= take
            if head[1] == 0:
                self.queue.popleft()
        emit(text[at:], self.last_origin)  # more text than counted: the latest token wrote it
        while self.queued > self.hold:  # more counted than can be held back: drop the oldest
            head = self.queue[0]
            drop = min(head[1], self.queued - self.hold)
            head[1] -= drop
            self.queued -= drop
            if head[1] == 0:
                self.queue.popleft()
        return spans

    def report(self, text: str) -> dict:
        """The chunk's extension field: its text's origin runs, and the tokens and target passes
        verified since the previous chunk (their text may still be held back)."""
        report = {"origins": self.split(text), "tokens": self.tokens, "passes": self.passes}
        self.tokens = self.passes = 0
        return report
