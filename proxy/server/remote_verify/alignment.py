"""How one request's tokens line up with the upstream's: by token ids (exact) or by text (best
effort), and whether its context is still known to be exact.

*Token ids*: the route has a local tokenizer and the upstream answers vLLM's
``return_tokens_as_token_ids``; prompts then go as token ids too (``id_prompts``: the prompt's
ids, the very ids the upstream chose, the draft's ids), unless the upstream refused one, when
the local tokenizer must re-tokenise ``prompt + output`` into exactly those ids (checked before
each verify). *Text*: the echo's token strings are laid over the text sent and compared as
strings; the prompt's tokens are learnt from the first answer.
"""

from __future__ import annotations

import asyncio
import logging

from foretell.proxy.server.remote_verify.echo_protocol import EchoAnswer, RemoteFailure, trusted

log = logging.getLogger("foretell.server")

# A mismatch this close to the end of the context is the draft merging with it (a token that
# spans the seam), not a context that re-tokenises differently.
BOUNDARY_TOKENS = 3


class Alignment:
    """One request's alignment with its upstream, over the request's ``output``."""

    def __init__(self, state, prompt: str, special: bool | None):
        self.state, self.prompt, self.special = state, prompt, special
        self.output = None  # the request's Output, set by its session (whose tokenizer depends on ``ids``)
        self.tokenizer = state.tokenizer
        # Token ids when a local tokenizer can read them and the upstream has not been seen
        # ignoring return_tokens_as_token_ids...
        self.ids = self.tokenizer is not None and state.token_ids is not False
        # ...and then prompts as token ids (the context exactly as decoded, never re-tokenised),
        # unless the upstream has refused them.
        self.id_prompts = self.ids and state.id_prompts is not False
        self.prompt_keys: list | None = None  # text alignment: learnt from the first answer
        self.checkpoint = (0, 0)  # (tokens, characters) of output whose context is known exact

    def describe(self) -> dict:
        return {"alignment": "token_ids" if self.ids else "text",
                "prompts": "token_ids" if self.id_prompts else "text"}

    # ---- the tokenizer ----------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        special = True if self.special is None else self.special
        return list(self.tokenizer(text, add_special_tokens=special)["input_ids"])

    def decode_after(self, context: list, ids: list) -> str | None:
        """The text ``ids`` add after ``context`` (None where decoding them there changes it)."""
        head = self.tokenizer.decode(context, skip_special_tokens=True)
        full = self.tokenizer.decode(list(context) + list(ids), skip_special_tokens=True)
        return full[len(head):] if full.startswith(head) else None

    async def learn_prompt_ids(self) -> None:
        if self.ids:
            self.prompt_keys = await asyncio.to_thread(self.encode, self.prompt)

    # ---- the context --------------------------------------------------------------------------

    def context(self) -> list:
        return self.prompt_keys + self.output.keys

    def prompt_tokens(self) -> int:
        """The prompt's tokens (a guess of four characters a token before they are known)."""
        return len(self.prompt_keys) if self.prompt_keys is not None else len(self.prompt) // 4

    def context_tokens(self) -> int:
        return self.prompt_tokens() + len(self.output.keys)

    def mark_exact(self) -> None:
        self.checkpoint = (len(self.output.keys), len(self.output.raw))

    async def context_exact(self) -> bool:
        """Is ``prompt + output`` still what the upstream decoded (token ids: does it re-tokenise
        into the tokens actually chosen)?"""
        out = self.output
        if self.id_prompts:
            return True  # the context is sent as the very tokens chosen
        if not out.exact():
            return False
        if not self.ids:
            return True  # checked on each echo answer instead
        ids = await asyncio.to_thread(self.encode, self.prompt + out.raw)
        if ids != self.context():
            return False
        self.mark_exact()
        return True

    def echo_prompt(self, draft) -> str | list[int]:
        """What an echo request sends: the context and ``draft`` (None: the context alone)."""
        if self.id_prompts:
            return self.context() + (draft.ids if draft else [])
        return self.prompt + self.output.raw + (draft.text if draft else "")

    def plain_start(self, verifying: bool) -> tuple[int, str | list[int]]:
        """Where a plain stream starts: (output tokens it continues from, its prompt). While
        verifying, or with prompts of token ids, that is the output's end; once verification is
        given up, the last exact point (what follows is replayed)."""
        out = self.output
        tokens, chars = (len(out.keys), len(out.raw)) if verifying or self.id_prompts else self.checkpoint
        if self.id_prompts:
            return tokens, self.prompt_keys + out.keys[:tokens]
        return tokens, self.prompt + out.raw[:chars]

    # ---- answers --------------------------------------------------------------------------------

    def learn_prompt_keys(self, answer: EchoAnswer, sent) -> bool:
        """Text alignment: the prompt's tokens from an echo answer laid over the text sent;
        False where the prompt's end falls inside a token (or a token would not lay)."""
        starts = answer.starts
        boundary = next((j for j, start in enumerate(starts) if start == len(self.prompt)), None)
        if boundary is None and sent == self.prompt and starts and starts[-1] is not None \
                and starts[-1] + len(answer.strings[len(starts) - 1]) == len(sent):
            boundary = len(starts)  # nothing after the prompt: all of it
        if boundary is None or any(s is None for s in starts[:boundary]):
            return False
        self.prompt_keys = answer.keys[:boundary]
        return True

    def check_spelling(self, context: list, drafted: list, draft) -> None:
        """Token ids over a text prompt: the echoed draft tokens must spell the draft sent."""
        if (self.ids and not self.id_prompts and draft is not None
                and self.decode_after(context[-BOUNDARY_TOKENS:], drafted) != draft.text):
            raise RemoteFailure("the echo answer's tokens do not spell the draft sent")

    def lookup_text(self, proposal: list) -> str | None:
        """The text of a prompt-lookup proposal as sent ("" with prompts of token ids), or None
        where it cannot be spelled safely."""
        if self.id_prompts:
            return ""
        if self.ids:
            return self.decode_after(self.context()[-BOUNDARY_TOKENS:], proposal) or None
        return "".join(proposal) if all(trusted(p) for p in proposal) else None

    def refuse_id_prompts(self, failure: RemoteFailure) -> None:
        """A 4xx to a prompt of token ids before the upstream has ever taken one: it does not take
        them. It gets text prompts from now on (re-tokenised context, checked)."""
        state = self.state
        if not (self.id_prompts and state.id_prompts is not True and failure.status is not None
                and 400 <= failure.status < 500):
            return
        state.id_prompts = self.id_prompts = False
        failure.id_prompts_refused = True
        log.warning("upstream %r: refused a prompt of token ids (%s); remote verification sends it text "
                    "prompts", state.upstream.name, failure)
