"""One request's speculation, whoever verifies it.

A verifier asks the request for its sources' proposals (``draft_options``), chooses a draft with
``draft_length.choose_drafts`` against its own cost (``set_draft``), verifies it its own way and
hands back what it found: ``accept(accepted, new_tokens)``, the accepted prefix of the draft
followed by the target's own token. Plain decoding is ``accept(0, tokens)`` with no draft.
Everything else is done here, once, for every verifier:

- the output (``Output``): tokens, their text, EOS / stop strings / ``max_tokens``, and how much
  of the text may be released (a possible stop string is held back);
- the per-source statistics and the per-position counts of the ``speculation`` report;
- the acceptance estimates: every source's proposal is scored against what the target produced
  each round, used or not, so a source that starts matching again is noticed at no cost;
- how well the weighed drafts' expectations came true (``calibration``), the sources following
  the output, and the prediction's accepted / rejected token counts at the end.

Two verifiers drive it: the engine's batched step (``engine.py``; ``Sequence`` adds the KV cache,
the sampler and log-probabilities) and an upstream's echo answers (``server/remote_verify/``).
Keys are token ids, except where an upstream's tokenizer is unknown here: then they are the
upstream's token strings, and text is what they spell.
"""

from __future__ import annotations

from foretell.proxy.engine.detokenizer import IncrementalDetokenizer, StopStringHold
from foretell.proxy.engine.draft_length import AcceptanceEstimate, DraftOption
from foretell.proxy.engine.draft_sources import PredictionEncoding, PredictionSource, PromptLookupSource
from foretell.proxy.engine.stats import GenerationStats, SourceStats
from foretell.proxy.prediction_usage import prediction_token_usage


def draft_sources(tokenizer, prompt_keys: list | None, prediction: str | None,
                  prompt_lookup: bool | None, prediction_encoding: PredictionEncoding | None = None) -> list:
    """A request's draft sources: its prediction (``prediction_encoding``: already tokenised),
    then prompt lookup (by default on beside a prediction, off without one). Without the prompt's
    keys yet, lookup starts later (``Speculation.start_lookup``)."""
    sources = []
    if prediction:
        sources.append(PredictionSource(tokenizer, prediction, prediction_encoding))
    if wants_lookup(prediction, prompt_lookup) and prompt_keys is not None:
        sources.append(PromptLookupSource(prompt_keys))
    return sources


def wants_lookup(prediction: str | None, prompt_lookup: bool | None) -> bool:
    return prompt_lookup if prompt_lookup is not None else bool(prediction)


class Output:
    """The completion so far: its tokens, its text, where it stops, what may be released.

    With a tokenizer the text comes from the token ids (incrementally, a character split across
    tokens held until it is whole); without one each token brings its own text.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], max_tokens: int, eos_ids: frozenset):
        self.keys: list = []
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self._raw = ""
        self.hold = StopStringHold(stop)
        self.max_tokens = max_tokens
        self.eos_ids = eos_ids
        self.finish_reason: str | None = None
        self.released = 0  # characters of text already handed out

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def raw(self) -> str:
        """The text of every token so far (the context), stop strings included."""
        return self.detokenizer.text if self.detokenizer is not None else self._raw

    @property
    def text(self) -> str:
        """The completion's text: cut before a stop string."""
        return self.hold.text

    def exact(self) -> bool:
        """Is ``raw`` the whole text of the tokens (no unfinished character held back)?"""
        return self.detokenizer is None or self.detokenizer.read_offset == len(self.detokenizer.ids)

    def push(self, key, text: str = "") -> None:
        if self.finished:
            return
        self.keys.append(key)
        if self.detokenizer is not None:
            text = self.detokenizer.push([key])
        else:
            self._raw += text
        self.hold.feed(text)
        if key in self.eos_ids or self.hold.stop_at is not None:
            self.end("stop")
        elif len(self.keys) >= self.max_tokens:
            self.end("length")

    def end(self, reason: str) -> None:
        """Finish (the first reason stands), with the last characters flushed."""
        if self.finish_reason is None:
            self.finish_reason = reason
            if self.detokenizer is not None:
                self.hold.feed(self.detokenizer.flush())

    def release(self) -> str:
        """Text not handed out yet that no stop string can take back."""
        end = len(self.hold.text) if self.finished else self.hold.releasable
        piece = self.hold.text[self.released:end]
        self.released = max(self.released, end)
        return piece


class Speculation:
    """One request's draft sources, their estimates, its statistics and its output."""

    def __init__(self, output: Output, sources: list, max_draft: int, prompt_tokens: int = 0,
                 prior_accepted: dict[str, float] | None = None):
        self.output = output
        self.max_draft = max_draft
        self.sources: list = []
        self.estimates: dict[str, AcceptanceEstimate] = {}
        # Realised over expected yield of the weighed drafts, per source (1: as expected). A
        # verifier that weighs its drafts (remote verification) lowers its expectations by it.
        self.calibration: dict[str, float] = {}
        self.prior_accepted = prior_accepted or {}
        self.stats = GenerationStats(prompt_tokens=prompt_tokens)
        self.origins: list[str | None] = []  # per output token: the source it was accepted from
        self.tried: set[str] = set()  # sources whose drafts were verified at least once
        self.proposals: dict[str, list] = {}
        self.draft_source: str | None = None
        self.draft: list = []
        self.draft_expected: float | None = None
        for source in sources:
            self.add_source(source)

    def add_source(self, source) -> None:
        prior = self.prior_accepted.get(source.name)
        self.sources.append(source)
        self.estimates[source.name] = AcceptanceEstimate(prior) if prior is not None else AcceptanceEstimate()
        self.calibration[source.name] = 1.0
        self.stats.per_source[source.name] = SourceStats()

    def start_lookup(self, prompt_keys: list) -> None:
        """Prompt lookup once the prompt's keys are known (an upstream's text alignment learns
        them from its first answer), caught up with the output so far."""
        if "prompt_lookup" not in self.estimates:
            self.add_source(PromptLookupSource(prompt_keys))
            self.sources[-1].observe(self.output.keys, self.output.raw)

    def source(self, name: str):
        return next((s for s in self.sources if s.name == name), None)

    # ---- where the request is -----------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    @property
    def room(self) -> int:
        return self.output.max_tokens - len(self.output.keys)

    # ---- drafting -----------------------------------------------------------------------

    def draft_options(self, limit: int | None = None) -> list[DraftOption]:
        """Ask every source for its proposal (kept for scoring) and describe what it offers.
        No draft is set until ``set_draft``."""
        if limit is None:
            limit = min(self.max_draft, self.room - 1)  # a round yields draft + 1 at most
        self.proposals = {s.name: s.propose(limit) for s in self.sources}
        self.draft_source, self.draft, self.draft_expected = None, [], None
        return [DraftOption(s.name, self.estimates[s.name].rate, s.agreement_run(), self._available(s, limit),
                            self.calibration[s.name], getattr(s, "pass_cost", None))
                for s in self.sources]

    def _available(self, source, limit: int) -> int:
        """Tokens a source can draft: its proposal's, or for one that drafts once chosen (the
        draft model: ``drafts_when_chosen``) what it could draft now."""
        if getattr(source, "drafts_when_chosen", False):
            return source.available(limit)
        return len(self.proposals[source.name])

    def offer(self, source: str, tokens: list) -> None:
        """The proposal of a source that drafts once chosen, drafted after ``draft_options``
        (before ``set_draft``): scored like any other."""
        self.proposals[source] = tokens

    def set_draft(self, source: str | None, length: int, expected: float | None = None) -> None:
        """The draft to verify: ``length`` tokens of ``source``'s proposal (``expected``: the
        tokens its round was weighed to yield, for calibration)."""
        self.draft_source = source if length > 0 else None
        self.draft = self.proposals[source][:length] if self.draft_source is not None else []
        self.draft_expected = expected

    # ---- a verified round ---------------------------------------------------------------

    def accept(self, accepted: int, new_tokens: list, texts: list[str] | None = None,
               drafted: int | None = None, passes: int | None = 1) -> list:
        """Take a round's verified tokens up to where plain decoding would have stopped; return
        those kept. ``accepted``: how many lead ``new_tokens`` came from the draft; ``texts``:
        each token's text where the output has no tokenizer; ``drafted``: the draft's length as
        verified (default: the draft set); ``passes``: target passes the round took (None: one a
        token kept, as plain decoding takes)."""
        out = self.output
        before, raw_before = len(out.keys), len(out.raw)
        for index, token in enumerate(new_tokens):
            out.push(token, texts[index] if texts is not None else "")
            if out.finished:
                break
        kept = out.keys[before:]
        accepted = min(accepted, len(kept))  # drafts past a stop do not count
        stats = self.stats
        stats.target_passes += len(kept) if passes is None else passes
        source = self.draft_source
        if source is not None:
            drafted = len(self.draft) if drafted is None else drafted
            record = stats.per_source[source]
            record.rounds += 1
            record.drafted += drafted
            record.accepted += accepted
            stats.drafted_tokens += drafted
            stats.accepted_tokens += accepted
            stats.count_positions(drafted, accepted)
            self.tried.add(source)
            if self.draft_expected:
                self.calibration[source] = min(1.0, 0.5 * self.calibration[source]
                                               + 0.5 * len(kept) / self.draft_expected)
        self._score(kept, accepted, drafted, raw_before)
        self.origins.extend([source] * accepted + [None] * (len(kept) - accepted))
        # The round's draft stays readable until the next one is chosen; its proposals are spent.
        self.draft_expected, self.proposals = None, {}
        return kept

    def _score(self, kept: list, accepted: int, drafted: int | None, raw_before: int) -> None:
        """Score every proposal against what the target produced (``kept``, which grew the
        text from ``raw_before`` characters), then let the sources follow."""
        following = {}
        for source in self.sources:
            if source.name not in self.proposals:
                continue
            if not source.scores_on_text:
                self.estimates[source.name].update(self.proposals[source.name], kept)
            elif source.name == self.draft_source:  # its draft's own outcome
                self.estimates[source.name].credit(accepted, accepted < drafted)
            else:  # proposals not in the keys' terms: did it follow the text?
                following[source.name] = (source, source.cursor)
        for source in self.sources:
            source.observe(self.output.keys, self.output.raw)
        for name, (source, cursor) in following.items():
            if kept and cursor is not None:
                followed = source.cursor == cursor + len(self.output.raw) - raw_before
                self.estimates[name].credit(len(kept) if followed else 0, not followed)

    # ---- the end ------------------------------------------------------------------------

    def close(self, reason: str | None = None, count_usage: bool = True) -> None:
        """End the output (``reason`` where it did not end by itself, e.g. a cancellation) and
        complete the statistics, the prediction's usage included unless ``count_usage`` is False
        (the caller then calls ``count_prediction_usage`` itself, off its hot thread)."""
        if reason is not None:
            self.output.end(reason)
        self.stats.completion_tokens = len(self.output.keys)
        completed = self.output.finish_reason in ("stop", "length")
        for source in self.sources:
            if hasattr(source, "close"):  # a source with shared state (the draft cache) lets go of it
                source.close(completed)
        if count_usage:
            self.count_prediction_usage()

    def count_prediction_usage(self, count=None) -> None:
        """The prediction's accepted / rejected token counts (an estimate where the tokens are
        pieces of text), by ``count(prediction, token_starts, output_text)`` (None:
        ``prediction_token_usage`` here): a diff of two texts, about a second of pure Python for
        a megabyte of prediction."""
        count = count or prediction_token_usage
        for source in self.sources:
            if isinstance(source, PredictionSource):
                accepted, rejected = count(source.text, source.token_starts, self.output.text)
                self.stats.accepted_prediction_tokens, self.stats.rejected_prediction_tokens = accepted, rejected
