"""Plain greedy decoding upstream for a session: one streamed request continuing the output (a
round with no draft per chunk: ``accept(0, tokens)``, every source's proposal scored on it),
closed as soon as the output rejoins a draft source; or, once verification is given up, from the
last exact point to the end, replaying what was already sent."""

from __future__ import annotations

import json
import logging
import time

import httpx

from foretell.proxy.server.remote_verify.echo_protocol import (
    RemoteFailure,
    plain_body,
    sse_events,
    stream_token_keys,
    unspelled_keys,
)

log = logging.getLogger("foretell.server")


class PlainStream:
    """One plain stream of ``session`` (``rejoin``: stop where a draft is worth verifying again)."""

    def __init__(self, session, rejoin: bool):
        self.session, self.rejoin = session, rejoin
        self.start_tokens, self.prompt = session.align.plain_start(session.verifying)
        self.replay = session.out.keys[self.start_tokens:]  # to be written again, and checked
        self.replayed = self.generated = 0
        # Prompt tokens sent: known here (the stream's usage chunk, when read, corrects it; a
        # stream closed early never sends one).
        self.sent = session.align.prompt_tokens() + self.start_tokens
        self.counted = self.upstream_done = self.rejoined = False
        self.last_chunk: float | None = None  # when the previous tokens arrived (the first include the prefill)

    async def pieces(self):
        """The output's new text as the stream confirms it."""
        session, out = self.session, self.session.out
        align = session.align
        body = plain_body(session.request.model, self.prompt, session.request.max_tokens - self.start_tokens,
                          token_ids=align.ids, special=align.special)
        session.requests += 1
        session.prompt_tokens_sent += self.sent
        try:
            response = await session.client.open_stream(session.upstream, "/completions", body)
        except RemoteFailure as failure:
            align.refuse_id_prompts(failure)
            raise
        try:
            async for event in sse_events(response):
                if not isinstance(event, dict) or "error" in event:
                    raise RemoteFailure("the upstream's stream carried an error: "
                                        + session.client.redactor.text(json.dumps(event)[:300]))
                self._count_prompt(event.get("usage"))
                choices = event.get("choices") or []
                if not choices or self.upstream_done:
                    continue  # after the upstream's last token: only its usage is still read
                finish = self._take(choices[0])
                if out.finished:
                    if finish:
                        self.upstream_done = True
                        continue
                    break  # a stop string or max_tokens here: the upstream would go on
                if finish and self.replayed >= len(self.replay):
                    self._end(finish)
                    self.upstream_done = True
                    continue
                if piece := out.release():
                    yield piece
                if (self.rejoin and session.verifying and self.generated >= session.min_plain
                        and session.propose() is not None):
                    self.rejoined = True
                    break  # rejoined: verify again
            else:
                if not out.finished:
                    raise RemoteFailure("the upstream's stream ended before the output did")
        except httpx.HTTPError as error:
            raise RemoteFailure(f"the upstream broke off its stream: {type(error).__name__}") from None
        finally:
            await response.aclose()
        log.debug("%s: plain %d: %d tokens (replayed %d)%s", session.request.request_id, session.requests,
                  self.generated, self.replayed, ", rejoined" if self.rejoined else "")
        if piece := out.release():
            yield piece

    def _count_prompt(self, usage) -> None:
        if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int) and not self.counted:
            self.session.prompt_tokens_sent += usage["prompt_tokens"] - self.sent
            self.counted = True

    def _take(self, choice: dict) -> str | None:
        """Take a chunk's tokens into the output (after checking the replayed ones); its finish."""
        session = self.session
        text = choice.get("text") or ""
        strings = (choice.get("logprobs") or {}).get("tokens") or []
        if text and not strings:
            raise RemoteFailure("a stream chunk came without its tokens")
        keys = self._keys(strings, text)
        now = time.perf_counter()
        fresh = self.replayed >= len(self.replay)
        if keys and self.last_chunk is not None and fresh:
            session.state.plain_token_seconds.append((now - self.last_chunk) / len(keys))
        if keys:
            self.last_chunk = now
        new = []
        for key, string in keys:
            if self.replayed < len(self.replay):
                if key != self.replay[self.replayed]:
                    raise RemoteFailure("the upstream's output differs from what it wrote before")
                self.replayed += 1
                continue
            new.append((key, string))
        if new:
            # A round with no draft: every source's proposal is scored on these tokens.
            session.spec.draft_options(len(new) if fresh else 0)
            self.generated += len(session.spec.accept(0, [key for key, _ in new], [text for _, text in new],
                                                      passes=None))
        return choice.get("finish_reason")

    def _keys(self, strings: list, text: str) -> list[tuple]:
        session = self.session
        try:
            keys = stream_token_keys(strings, text, session.align.ids)
        except RemoteFailure:
            session.state.token_ids = False
            raise
        if keys is None:
            # These token strings cannot be compared later: no more verification.
            session.stop_verifying("token strings that do not spell the text; plain decoding")
            keys = unspelled_keys(strings, text)
        return keys

    def _end(self, finish: str) -> None:
        out = self.session.out
        if finish == "stop":
            if not self.session.align.ids and (not out.keys or out.keys[-1] is not None):
                out.push(None)  # the end-of-sequence token: counted, no text
            out.end("stop")
        else:
            out.end("length")
