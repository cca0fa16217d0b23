"""Which draft a remotely verified request sends next: every source's offer counted in the
upstream's tokens, the engine's draft choice (``draft_length.choose_drafts``) against the
upstream's measured costs (an echo request over the context and the draft, or a plain token),
and the chosen tokens spelled as they are sent (token ids, or text)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from foretell.proxy.engine.draft_length import DraftOption, choose_drafts

# Prompt lookup drafts only runs at least this long: each verify re-sends the whole context.
LOOKUP_MIN_DRAFT = 8


@dataclass
class Draft:
    text: str
    source: str
    ids: list[int] | None = None  # its token ids (sent as such when the upstream takes id prompts)


def propose(session) -> Draft | None:
    """The draft to verify now, or None: no source has one, or none is worth its round trip."""
    spec = session.spec
    limit = min(spec.max_draft, spec.room - 1)
    if limit < 1:
        return None
    offers = [_in_upstream_terms(session, option, limit) for option in spec.draft_options(limit)]
    source, length, expected = choose(session, [offer for offer in offers if offer is not None])
    if not length:
        return None
    spec.set_draft(source, length, expected)
    draft = _spell(session, source, length)
    if draft is None:
        spec.set_draft(None, 0)
    return draft


def _in_upstream_terms(session, option: DraftOption, limit: int) -> DraftOption | None:
    """A source's offer counted in the upstream's tokens (None: nothing worth sending)."""
    if option.source == "prediction" and session.prediction.scores_on_text:
        # Pieces are not tokens: count by the characters per token of this output.
        chars = session.prediction.chars_ahead()
        if not chars:
            return None
        return replace(option, available=min(limit, max(1, round(chars / _chars_per_token(session)))))
    if option.source == "prompt_lookup" and option.available < LOOKUP_MIN_DRAFT:
        return None
    return option if option.available else None


def _chars_per_token(session) -> float:
    return len(session.out.raw) / len(session.out.keys) if session.out.raw else 4.0


def _spell(session, source: str, length: int) -> Draft | None:
    """The chosen draft as it is sent (token ids, or text), or None where it cannot be."""
    ids = list(session.spec.draft) if session.align.id_prompts else None
    if source == "prediction":
        prediction = session.prediction
        if prediction.scores_on_text:
            text = prediction.text_past_chars_ahead(int(length * _chars_per_token(session)))
        else:
            text = prediction.text_of_tokens_ahead(length)
        return Draft(text, source, ids) if text else None
    text = session.align.lookup_text(list(session.spec.draft))
    return Draft(text, source, ids) if text is not None else None


def choose(session, options: list[DraftOption]) -> tuple[str | None, int, float | None]:
    """(source, draft length, tokens it is expected to yield) for the next round: the
    engine's draft choice (``choose_drafts``) against this upstream's measured costs, an
    echo request over the context and the draft or a plain token; length 0 where plain
    decoding is faster. Before both costs are measured: the most promising source, all of it."""
    if not options:
        return None, 0, None
    prediction = next((option for option in options if option.source == "prediction"), None)
    if prediction is not None and "prediction" not in session.spec.tried:
        # The request's first try of its prediction, presumed right where the output
        # starts: one echo request at most is risked.
        return "prediction", prediction.available, None
    costs = session.state.costs()
    if costs is None or session.upstream.verify_always:
        best = max(options, key=lambda option: option.expected(option.available))
        return best.source, best.available, None
    verify, plain = costs
    context = session.align.context_tokens()
    if session.state.reuses_prompts:  # charged for what the last verify did not already send
        context -= min(context, session.shared_with_last_verify)
    [(source, length)] = choose_drafts([options], lambda drafted: verify.at(context + drafted) if drafted else plain)
    if not length:
        return None, 0, None
    chosen = next(option for option in options if option.source == source)
    return source, length, chosen.expected(length)
