"""The engine's per-token log-probabilities in OpenAI's two response shapes.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}], "refusal": None}``.
Completions (legacy): ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, with
offsets counted in characters from the start of the choice's text; with OpenAI's legacy ``echo``
the prompt's tokens come first (``prompt_logprobs``, ``join_logprobs``).

The values are the model's raw log-probabilities (before temperature, top-k and top-p), as
vLLM reports them by default; they are computed from the verify pass, so they cost no extra pass
even for tokens accepted from a prediction (OpenAI refuses logprobs with predictions).
"""

from __future__ import annotations

import re

# A byte-fallback token's piece in SentencePiece vocabularies (Gemma, Llama): one raw byte.
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenTexts:
    """Each token's own text, decoded once per token id, and its bytes.

    A byte-fallback token (piece ``<0xNN>``) decodes alone to U+FFFD when its byte is part of a
    multi-byte character; its ``bytes`` are the raw byte, so that a client joining the tokens'
    bytes gets the character back (OpenAI's reason for the field)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}
        self.byte_cache: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        if token_id not in self.cache:
            self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self.cache[token_id]

    def bytes(self, token_id: int) -> list[int]:
        if token_id not in self.byte_cache:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            match = BYTE_PIECE.fullmatch(piece) if isinstance(piece, str) else None
            self.byte_cache[token_id] = ([int(match.group(1), 16)] if match
                                         else list(self(token_id).encode("utf-8")))
        return self.byte_cache[token_id]


def chat_logprobs(entries, texts: TokenTexts) -> dict:
    def item(token_id: int, logprob: float) -> dict:
        return {"token": texts(token_id), "logprob": logprob, "bytes": texts.bytes(token_id)}

    content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
               for e in entries]
    return {"content": content, "refusal": None}


def completion_logprobs(entries, texts: TokenTexts, start_offset: int = 0, as_ids: bool = False) -> dict:
    """The legacy object for ``entries``; offsets run on from ``start_offset`` by each token's own
    text. ``as_ids``: tokens named ``token_id:<id>`` (vLLM's ``return_tokens_as_token_ids``)."""
    name = _id_name if as_ids else texts
    tokens, offsets, offset = [], [], start_offset
    for e in entries:
        tokens.append(name(e.token_id))
        offsets.append(offset)
        offset += len(texts(e.token_id))
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{name(t): lp for t, lp in e.top} for e in entries],
        "text_offset": offsets,
    }


class RunningCompletionLogprobs:
    """A stream's legacy logprobs, chunk by chunk: ``text_offset`` runs on across chunks."""

    def __init__(self, texts: TokenTexts, start_offset: int = 0, as_ids: bool = False):
        self.texts, self.offset, self.as_ids = texts, start_offset, as_ids

    def __call__(self, entries) -> dict:
        part = completion_logprobs(entries, self.texts, self.offset, self.as_ids)
        self.offset += sum(len(self.texts(e.token_id)) for e in entries)
        return part


def prompt_logprobs(ids: list[int], offsets: list[int], entries, texts: TokenTexts, as_ids: bool = False) -> dict:
    """The prompt's share of the legacy object (OpenAI's ``echo``): ``entries`` are the engine's
    ``TokenLogprob`` for every prompt token after the first, which has none (``null``). Each
    token's ``top_logprobs`` holds the token itself besides the best ones, as OpenAI and vLLM."""
    name = _id_name if as_ids else texts
    token_logprobs: list[float | None] = [None]
    top: list[dict | None] = [None]
    for token, entry in zip(ids[1:], entries):
        token_logprobs.append(entry.logprob)
        alternatives = {name(t): lp for t, lp in entry.top}
        alternatives.setdefault(name(token), entry.logprob)
        top.append(alternatives)
    return {"tokens": [name(token) for token in ids], "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": list(offsets)}


def join_logprobs(*parts: dict) -> dict:
    """Legacy objects one after the other (the prompt's, then the completion's)."""
    joined = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in joined:
            joined[key] += part[key]
    return joined


def _id_name(token_id: int) -> str:
    return f"token_id:{token_id}"
