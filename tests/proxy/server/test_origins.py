"""``OriginSpans``: a stream's released text split by the origins of the tokens that wrote it,
against a reference that pushes one token at a time through the engine's own detokenizer."""

from __future__ import annotations

import random

import pytest

from foretell.proxy.engine.detokenizer import IncrementalDetokenizer, StopStringHold
from foretell.proxy.server.origins import OriginSpans

ORIGINS = ["prediction", "prompt_lookup", None]
TEXTS = [
    "def total(items):\n    return sum(item.price for item in items)\n",
    "Grüße aus Köln: naïve café, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and emoji 🙂🚀 mixed with 漢字 and ﷽.",
    "  leading spaces\n\n\ttabs\t and    runs   of spaces  ",
    "🙂🙂🙂🙂🙂🙂🙂🙂 only emoji 🧑‍🧑‍🧒‍🧒",
]


def reference_origins(tokenizer, ids: list[int], origins: list) -> list:
    """Per character of the text: the origin of the token whose push released it (the token that
    completes a character owns it)."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    per_char = []
    for token, origin in zip(ids, origins):
        per_char += [origin] * len(detokenizer.push([token]))
    per_char += [origins[-1]] * len(detokenizer.flush())
    return per_char


def stream(tokenizer, ids, origins, stops=(), seed=0):
    """Released pieces and their spans, rounds of random sizes as the engine makes them."""
    rng = random.Random(seed)
    detokenizer, hold = IncrementalDetokenizer(tokenizer), StopStringHold(stops)
    spans, streamed, pieces, at = OriginSpans(tokenizer, stops), 0, [], 0
    while at < len(ids):
        size = rng.randint(1, 6)
        round_ids, round_origins = ids[at:at + size], origins[at:at + size]
        at += size
        hold.feed(detokenizer.push(round_ids))
        final = at >= len(ids) or hold.stop_at is not None
        if final:
            hold.feed(detokenizer.flush())
        end = len(hold.text) if final else hold.releasable
        piece, streamed = hold.text[streamed:end], max(streamed, end)
        spans.add(round_ids, round_origins)
        pieces.append((piece, spans.split(piece)))
        if final:
            break
    return pieces


# Characters written as bytes (Gemma's vocabulary holds most emoji whole, not these).
BYTES_U = ["<0xF0>", "<0x9D>", "<0x94>", "<0x98>"]  # 𝔘
BYTES_E = ["<0xC3>", "<0xA9>"]  # é


def token_ids(tokenizer, text: str) -> list[int]:
    """``text`` tokenised, with characters written as byte tokens between its words."""
    ids = []
    for index, word in enumerate(text.split(" ")):
        ids += tokenizer(" " + word if index else word, add_special_tokens=False)["input_ids"]
        if index % 3 == 1:
            ids += tokenizer.convert_tokens_to_ids(BYTES_U if index % 2 else BYTES_E)
    return ids


def test_the_cases_hold_byte_written_characters(tokenizer):
    pieces = tokenizer.convert_ids_to_tokens(token_ids(tokenizer, TEXTS[0]))
    assert sum(p.startswith("<0x") for p in pieces) >= 6


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_spans_rebuild_each_chunk_and_match_the_per_token_reference(tokenizer, text, seed):
    ids = token_ids(tokenizer, text)
    rng = random.Random(seed)
    origins = [rng.choice(ORIGINS) for _ in ids]
    expected = reference_origins(tokenizer, ids, origins)
    got = []
    for piece, spans in stream(tokenizer, ids, origins, seed=seed):
        assert "".join(span["text"] for span in spans) == piece
        assert all(span["text"] for span in spans)  # no empty runs
        assert all(a["origin"] != b["origin"] for a, b in zip(spans, spans[1:]))  # runs merged
        for span in spans:
            got += [span["origin"]] * len(span["text"])
    assert got == expected


def test_byte_fallback_characters_go_to_the_token_that_completes_them(tokenizer):
    ids = tokenizer("a", add_special_tokens=False)["input_ids"] + tokenizer.convert_tokens_to_ids(BYTES_U)
    spans = OriginSpans(tokenizer)
    spans.add(ids[:-1], ["prompt_lookup"] * (len(ids) - 1))  # 'a' and 3 bytes of 𝔘
    assert spans.split("a") == [{"text": "a", "origin": "prompt_lookup"}]
    spans.add(ids[-1:], ["prediction"])
    assert spans.split("𝔘") == [{"text": "𝔘", "origin": "prediction"}]


def test_text_held_back_by_a_stop_string_keeps_its_origin_for_later(tokenizer):
    ids = tokenizer("alpha END beta", add_special_tokens=False)["input_ids"]
    origins = ["prediction"] * len(ids)
    pieces = stream(tokenizer, ids, origins, stops=("END",), seed=3)
    text = "".join(piece for piece, _ in pieces)
    assert text == "alpha "
    assert all(span["origin"] == "prediction" for _, spans in pieces for span in spans)


def test_special_tokens_count_no_characters(tokenizer):
    spans = OriginSpans(tokenizer)
    ids = tokenizer("done", add_special_tokens=False)["input_ids"]
    spans.add(ids + [tokenizer.eos_token_id], [None] * len(ids) + ["prediction"])
    assert spans.split("done") == [{"text": "done", "origin": None}]


def test_a_miscount_never_carries_past_what_can_be_held_back(tokenizer):
    spans = OriginSpans(tokenizer)  # no stop strings: nothing may be held back
    ids = tokenizer("one two three", add_special_tokens=False)["input_ids"]
    spans.add(ids, ["prediction"] * len(ids))
    # The server released less text than the tokens' (a decoder that strips): the rest is
    # dropped, so the next chunk's text goes to its own tokens.
    assert spans.split("one two") == [{"text": "one two", "origin": "prediction"}]
    more = tokenizer(" four", add_special_tokens=False)["input_ids"]
    spans.add(more, [None] * len(more))
    assert spans.split(" four") == [{"text": " four", "origin": None}]
    # More text than counted: the extra characters go to the latest token's origin.
    spans.add(ids[:1], ["prompt_lookup"])
    assert spans.split("one!!") == [{"text": "one!!", "origin": "prompt_lookup"}]


def test_report_counts_tokens_and_passes_since_the_last_chunk(tokenizer):
    spans = OriginSpans(tokenizer)
    ids = tokenizer("a b c", add_special_tokens=False)["input_ids"]
    spans.add(ids[:1], [None])
    spans.add(ids[1:], ["prediction"] * (len(ids) - 1))
    report = spans.report("a b c")
    assert report["tokens"] == len(ids) and report["passes"] == 2
    assert "".join(s["text"] for s in report["origins"]) == "a b c"
    assert spans.report("") == {"origins": [], "tokens": 0, "passes": 0}
