"""Draft sources: cheap guesses of the next tokens, verified later by the target model.

Each source answers three calls:
- ``propose(max_tokens)``: up to ``max_tokens`` draft token ids continuing the output (may be empty);
- ``observe(output_ids, output_text)``: the output after a round, so the source can follow it;
- ``agreement_run()``: for how many tokens in a row the source has agreed with the output
  (its own evidence for the next proposal), or None when it keeps no such count.

A source that runs a model of its own (``draft_model.DraftModelSource``) cannot propose before it
is chosen, its drafts cost passes: it sets ``drafts_when_chosen``, says what it could draft
(``available(limit)``) and what its passes cost (``pass_cost``), and its tokens arrive once the
step's drafts are chosen (``Speculation.offer``).

Sources never need to be right: the target checks every token. They only need to be right often
and cheap to ask.
"""

from __future__ import annotations

import bisect
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass


class PredictionSource:
    """Drafts from caller-supplied text (the file before an edit, the passages to quote).

    The source keeps a *cursor*: the character offset in the prediction where the output
    currently ends. While the output follows the prediction, the cursor advances with it. When
    the output diverges (an edit), the cursor is lost and the source stays silent until the
    output *rejoins* the prediction: the last characters of the output are looked up in the
    prediction, nearest match at or after the old cursor first, so an insertion (cursor waits)
    and a deletion (cursor jumps forward) both resume within a few tokens of the seam, and a
    repeated line does not send the cursor back to an earlier copy.

    Alignment is done on text, not token ids, because the same text tokenises differently
    around an edit; drafts are re-tokenised from the cursor's character offset.
    """

    name = "prediction"
    # Anchor lengths in characters, most reliable first. The shortest bounds how soon drafting
    # resumes after a seam (12 characters is ~3-4 code tokens).
    ANCHOR_LENGTHS = (48, 24, 12)
    # A jump backwards (the output repeats earlier text) needs stronger evidence.
    BACKWARD_ANCHOR_MIN = 24
    # Agreement credited at the start, where the output is presumed to begin with the prediction.
    INITIAL_RUN_CHARS = 32
    CHARS_PER_TOKEN = 4  # rough, only used to turn agreed characters into a confidence

    def __init__(self, tokenizer, prediction: str, encoding: "PredictionEncoding | None" = None):
        """``encoding``: the prediction already tokenised (``PredictionEncoding.of``), as the server
        does off the engine's thread; None tokenises it here."""
        self.tokenizer = tokenizer
        self.text = prediction
        encoding = encoding or PredictionEncoding.of(tokenizer, prediction)
        self.token_ids: list[int] = encoding.token_ids
        self.token_starts: list[int] = encoding.token_starts
        self.cursor: int | None = 0  # the output starts where the prediction starts
        self.last_cursor = 0  # where the output left the prediction; re-anchoring starts here
        self.observed_chars = 0
        # Characters the output has agreed with the prediction since the last (re-)anchoring.
        self.run_chars = self.INITIAL_RUN_CHARS

    @property
    def scores_on_text(self) -> bool:
        """Are its proposals in other terms than the output's keys (text pieces standing in for
        an unknown tokenizer)? Then it is scored by whether it followed the text."""
        return isinstance(self.tokenizer, TextPieces)

    def agreement_run(self) -> float:
        """Tokens (roughly) the output has followed the prediction since the last anchoring.
        A fresh anchor earns short drafts, a long run long ones, so a false anchor costs
        little and a true one ramps up in a few rounds."""
        return self.run_chars / self.CHARS_PER_TOKEN

    def propose(self, max_tokens: int) -> list[int]:
        if self.cursor is None or max_tokens <= 0 or self.cursor >= len(self.text):
            return []
        index = bisect.bisect_left(self.token_starts, self.cursor)
        if index < len(self.token_starts) and self.token_starts[index] == self.cursor:
            return self.token_ids[index : index + max_tokens]
        # The cursor is inside a prediction token (a seam): tokenise the piece up to the next
        # token boundary on its own, then continue with the prediction's own tokens.
        piece_end = self.token_starts[index] if index < len(self.token_starts) else len(self.text)
        head = self.tokenizer.encode(self.text[self.cursor : piece_end], add_special_tokens=False)
        return (list(head) + self.token_ids[index:])[:max_tokens]

    # ---- the text ahead of the cursor, for a verifier that sends text (remote verification) ----

    def tokens_ahead(self) -> int:
        """The prediction's tokens from the cursor on, as ``propose`` counts them (at a seam the
        piece up to the next token start is one more); 0 when the cursor is lost."""
        if self.cursor is None or self.cursor >= len(self.text):
            return 0
        index = bisect.bisect_left(self.token_starts, self.cursor)
        at_start = index < len(self.token_starts) and self.token_starts[index] == self.cursor
        return len(self.token_starts) - index + (0 if at_start else 1)

    def chars_ahead(self) -> int:
        return 0 if self.cursor is None else max(0, len(self.text) - self.cursor)

    def text_of_tokens_ahead(self, tokens: int) -> str:
        """The text the next ``tokens`` of ``tokens_ahead`` span from the cursor."""
        if self.cursor is None:
            return ""
        index = bisect.bisect_left(self.token_starts, self.cursor)
        at_start = index < len(self.token_starts) and self.token_starts[index] == self.cursor
        stop = index + tokens - (0 if at_start else 1)
        end = self.token_starts[stop] if stop < len(self.token_starts) else len(self.text)
        return self.text[self.cursor:end]

    def text_past_chars_ahead(self, chars: int) -> str:
        """The text from the cursor to the first token start more than ``chars`` characters on
        (for pieces standing in for tokens, whose count says nothing of the upstream's tokens)."""
        if self.cursor is None:
            return ""
        index = bisect.bisect_left(self.token_starts, self.cursor + chars + 1)
        end = self.token_starts[index] if index < len(self.token_starts) else len(self.text)
        return self.text[self.cursor:end]

    def observe(self, output_ids: list[int], output_text: str) -> None:
        new_text = output_text[self.observed_chars :]
        self.observed_chars = len(output_text)
        if not new_text:
            return
        if self.cursor is not None:
            if self.text.startswith(new_text, self.cursor):
                self.cursor += len(new_text)
                self.last_cursor = self.cursor
                self.run_chars += len(new_text)
                return
            # Diverged inside this round: remember how far the output still agreed.
            agreed = common_prefix_length(new_text, self.text[self.cursor : self.cursor + len(new_text)])
            self.last_cursor = self.cursor + agreed
            self.cursor = None
        self.cursor, self.run_chars = self._reanchor(output_text)
        if self.cursor is not None:
            self.last_cursor = self.cursor

    def _reanchor(self, output_text: str) -> tuple[int | None, int]:
        """Find where the output's tail sits in the prediction: (cursor or None, anchor length)."""
        for length in self.ANCHOR_LENGTHS:
            if len(output_text) < length:
                continue
            anchor = output_text[-length:]
            if anchor.isspace():
                continue  # indentation alone matches everywhere
            # Nearest occurrence whose end is at or after the old cursor.
            found = self.text.find(anchor, max(0, self.last_cursor - length))
            if found >= 0:
                return found + length, length
        for length in self.ANCHOR_LENGTHS:
            if length < self.BACKWARD_ANCHOR_MIN or len(output_text) < length:
                continue
            anchor = output_text[-length:]
            if anchor.isspace():
                continue
            found = self.text.rfind(anchor, 0, self.last_cursor)
            if found >= 0:
                return found + length, length
        return None, 0


class PromptLookupSource:
    """Drafts by copying: find the longest recent n-gram match of the output's tail in the
    prompt and the output so far, and propose what followed it (prompt lookup decoding).

    An index from ``min_ngram``-grams to their end positions is kept up to date as tokens
    arrive, so a lookup costs a dictionary hit plus a short backward extension per candidate.
    Among matches of equal length the one with the longest continuation wins (up to what was
    asked), then the most recent: in a loop the most recent match has only one period of
    continuation before the end of the output, an earlier one a long run of the same loop.
    """

    name = "prompt_lookup"
    scores_on_text = False

    def __init__(self, prompt_ids: list[int], min_ngram: int = 2, max_ngram: int = 16,
                 max_candidates: int = 64):
        if min_ngram < 1 or max_ngram < min_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.min_ngram = min_ngram
        self.max_ngram = max_ngram
        self.max_candidates = max_candidates
        self.tokens: list[int] = []
        self.prompt_length = len(prompt_ids)
        self._ends_by_key: dict[tuple[int, ...], list[int]] = defaultdict(list)
        self._extend(prompt_ids)

    def agreement_run(self) -> None:
        return None  # the engine's running estimate is the better guide for n-gram copies

    def _extend(self, new_tokens: list[int]) -> None:
        n = self.min_ngram
        for token in new_tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            if end >= n:
                self._ends_by_key[tuple(self.tokens[end - n : end])].append(end)

    def propose(self, max_tokens: int) -> list[int]:
        tokens = self.tokens
        total = len(tokens)
        if max_tokens <= 0 or total < self.min_ngram:
            return []
        key = tuple(tokens[total - self.min_ngram :])
        best, best_end = (0, 0), -1  # (match length, usable continuation)
        candidates = self._ends_by_key.get(key, ())
        checked = 0
        # Most recent first; the last entry is the tail itself, which has nothing after it.
        for end in reversed(candidates):
            if end >= total:
                continue
            length = self.min_ngram
            while (length < self.max_ngram and end - length - 1 >= 0
                   and tokens[end - length - 1] == tokens[total - length - 1]):
                length += 1
            score = (length, min(total - end, max_tokens))
            if score > best:
                best, best_end = score, end
                if score == (self.max_ngram, max_tokens):
                    break
            checked += 1
            if checked >= self.max_candidates:
                break
        if best_end < 0:
            return []
        return tokens[best_end : best_end + max_tokens]

    def observe(self, output_ids: list[int], output_text: str) -> None:
        self._extend(output_ids[len(self.tokens) - self.prompt_length :])


@dataclass(frozen=True)
class PredictionEncoding:
    """A prediction's token ids and each token's first character: a megabyte of prediction takes
    most of a second to tokenise, so the server does it once per request, beside the prompt and
    off the thread that runs the engine's passes, and every choice shares it."""

    token_ids: list[int]
    token_starts: list[int]

    @classmethod
    def of(cls, tokenizer, prediction: str) -> "PredictionEncoding":
        encoded = tokenizer(prediction, add_special_tokens=False, return_offsets_mapping=True)
        return cls(list(encoded["input_ids"]), [start for start, _ in encoded["offset_mapping"]])


class TextPieces:
    """A stand-in tokenizer for ``PredictionSource`` where no real one is known (an upstream's
    text alignment): words, spaces and punctuation as pieces. Only the cursor (on text) and the
    prediction's usage figures (then an estimate) use it."""

    PIECE = re.compile(r"\s+|\w+|[^\w\s]")

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        spans = [m.span() for m in self.PIECE.finditer(text)]
        return {"input_ids": list(range(len(spans))), "offset_mapping": spans}

    def encode(self, text, add_special_tokens=False):
        return [0] * len(self.PIECE.findall(text))


def common_prefix_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common prefix of two strings or token lists."""
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length
