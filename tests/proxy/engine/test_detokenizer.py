"""Incremental detokenisation and stop-string hold-back, with the real Gemma tokenizer (no model).

The invariants: the released pieces, joined, are the text plain decoding gives; nothing released
is ever taken back (every partial join is a prefix of the final text); a piece never shows a
half-written character as U+FFFD when the text has none. Gemma writes rare characters as runs of
byte-fallback tokens, and its decoder turns a whole run into U+FFFDs when the run ends
unfinished, so chunk boundaries inside characters are the cases that matter.
"""

from __future__ import annotations

import random

import pytest

from foretell.proxy.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopStringHold

FRAKTUR = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢"
TEXTS = {
    "fraktur": f"{FRAKTUR} {FRAKTUR}",
    "fraktur_caps": "𝔄𝔅ℭ𝔇𝔈𝔉 and 𝔘𝔫𝔦",
    "zwj_family": "family: 👩\u200d👩\u200d👧 and 👨\u200d👩\u200d👧\u200d👦!",
    "flags": "🇫🇷🇯🇵🇧🇷 flags, 🏳️\u200d🌈",
    "hebrew": "שלום עולם, מה שלומך?",
    "arabic": "مرحبا بالعالم (١٢٣)",
    "rtl_mixed": "x = 'שלום' + \"مرحبا\"  # RTL in code",
    "combining": "cafe\u0301 nai\u0308ve re\u0301sume\u0301 a\u0300\u0301\u0302",
    "cjk": "漢字テスト、中文测试。한국어 텍스트",
    "hieroglyphs": "𓀀𓁐𓂀 ꙮ ꙮ",
    "emoji_runs": "🧬🫠🧑‍💻🤌🏽👍🏿",
    "code": f"def f(x):\n    return x + '{FRAKTUR}'  # ∑ é 😀\n\tprint('漢字')\n",
    "ascii": "plain ASCII text, nothing else.\n",
    "numbers_math": "∀x∈ℝ: x² ≥ 0; ∫₀¹ f(x)dx ≈ π/4 — ½ ⅓",
}

FIXED_SIZES = [1, 2, 3, 4, 5, 6]
IRREGULAR = [[1, 3, 2, 5, 1, 4], [4, 1, 1, 6, 2], [2, 7, 1, 1, 3], [5, 2, 3, 1]]


def chunks(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ``ids`` cycling through ``sizes``."""
    out, start, i = [], 0, 0
    while start < len(ids):
        size = sizes[i % len(sizes)]
        out.append(ids[start:start + size])
        start += size
        i += 1
    return out


def run(tokenizer, parts: list[list[int]]) -> tuple[list[str], str]:
    """Push ``parts``; return the pieces (the flush last) and the detokenizer's own text."""
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(part) for part in parts]
    pieces.append(detok.flush())
    return pieces, detok.text


def check_append_only(pieces: list[str], final: str, source_has_replacement: bool) -> None:
    joined = ""
    for i, piece in enumerate(pieces):
        joined += piece
        assert final.startswith(joined), f"piece {i} {piece!r} contradicts the final text"
        if not source_has_replacement:
            assert REPLACEMENT not in joined, f"U+FFFD streamed after piece {i}: {joined!r}"
    assert joined == final


@pytest.fixture(scope="module")
def encoded(tokenizer):
    return {name: tokenizer(text, add_special_tokens=False)["input_ids"] for name, text in TEXTS.items()}


def test_the_texts_exercise_byte_fallback(tokenizer, encoded):
    pieces = tokenizer.convert_ids_to_tokens([t for ids in encoded.values() for t in ids])
    assert sum(p.startswith("<0x") for p in pieces) > 50


@pytest.mark.parametrize("name", list(TEXTS))
def test_every_chunking_gives_the_decoded_text(tokenizer, encoded, name):
    ids = encoded[name]
    expected = tokenizer.decode(ids)
    assert REPLACEMENT not in expected  # the source round-trips
    for sizes in [[n] for n in FIXED_SIZES] + IRREGULAR:
        pieces, text = run(tokenizer, chunks(ids, sizes))
        check_append_only(pieces, expected, False)
        assert text == expected


def test_random_chunkings_of_everything_joined(tokenizer):
    text = " ".join(TEXTS.values())
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    expected = tokenizer.decode(ids)
    rng = random.Random(1234)
    for _ in range(12):
        sizes = [rng.randint(1, 9) for _ in range(rng.randint(1, 8))]
        pieces, _ = run(tokenizer, chunks(ids, sizes))
        check_append_only(pieces, expected, False)


def test_a_complete_character_is_released_at_once(tokenizer):
    """Text is not held back longer than needed: a finished character streams before flush."""
    ids = tokenizer.convert_tokens_to_ids(["<0xF0>", "<0x9D>", "<0x94>", "<0x98>"])  # 𝔘
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push([t]) for t in ids] == ["", "", "", "𝔘"]
    assert detok.flush() == ""


def test_end_of_sequence_token_adds_no_text(tokenizer):
    ids = tokenizer("ok 𝔘", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    pieces, text = run(tokenizer, [[t] for t in ids])
    assert text == "ok 𝔘" and "".join(pieces) == text


def test_unfinished_character_at_the_end_is_flushed(tokenizer):
    ids = tokenizer("ab", add_special_tokens=False)["input_ids"] + tokenizer.convert_tokens_to_ids(["<0xF0>", "<0x9D>"])
    pieces, text = run(tokenizer, [[t] for t in ids])
    assert REPLACEMENT not in "".join(pieces[:-1])  # held until the end
    assert text == tokenizer.decode(ids) and text.startswith("ab") and text.endswith(REPLACEMENT)


def test_unfinished_character_after_a_byte_written_one_is_flushed(tokenizer):
    """The output ends inside a character right after a character written as bytes (max_tokens
    can cut there): flush must release the unfinished bytes (as U+FFFD, the docstring's promise),
    not drop them, and must keep the complete character released before."""
    ids = tokenizer.convert_tokens_to_ids(["<0xF0>", "<0x9D>", "<0x94>", "<0x98>", "<0xF0>", "<0x9D>"])
    pieces, text = run(tokenizer, [[t] for t in ids])
    assert "".join(pieces) == text
    assert text.startswith("𝔘") and text.endswith(REPLACEMENT), f"unfinished bytes dropped: {text!r}"


@pytest.mark.parametrize("sizes", [[1], [2], [5], [9]])
def test_text_after_an_invalid_byte_is_not_lost(tokenizer, sizes):
    """A complete character written as bytes, then a stray lead byte, then plain text (a model
    can write that). Gemma's decoder renders the whole byte run as U+FFFDs once the stray byte
    joins it, so the text already released no longer matches the window: the detokenizer must
    still release what follows, not drop the rest of the output."""
    byte_ids = tokenizer.convert_tokens_to_ids(["<0xF0>", "<0x9D>", "<0x94>", "<0x98>", "<0xF0>"])
    tail = tokenizer(" and more text", add_special_tokens=False)["input_ids"]
    pieces, text = run(tokenizer, chunks(byte_ids + tail, sizes))
    assert "".join(pieces) == text
    assert text.endswith(" and more text"), f"text after the stray byte lost: {text!r}"
    assert text.count(REPLACEMENT) >= 1  # the stray byte is visible, not silently dropped


def test_random_byte_runs_valid_and_invalid(tokenizer):
    """Random outputs of byte-written characters, stray bytes, EOS and whole tokens, pushed one
    token at a time (as the engine does) or in random chunks: valid UTF-8 gives plain decoding's
    text with no U+FFFD ever streamed; invalid bytes never swallow the whole tokens after them."""
    byte_id = {b: tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)}
    words = [t for ids in tokenizer([" x", "ab", " 漢字", "\n", " é", "👩"], add_special_tokens=False)["input_ids"]
             for t in ids]
    word_text = {t: tokenizer.decode([t]) for t in words}
    rng = random.Random(3)
    for trial in range(400):
        ids = []
        for _ in range(rng.randint(1, 10)):
            r = rng.random()
            if r < 0.4:
                ids += [byte_id[b] for b in rng.choice(["𝔘", "é", "ℭ", "ꙮ", "😀", "a"]).encode()]
            elif r < 0.55:
                ids.append(byte_id[rng.choice([0xF0, 0x9D, 0xC3, 0xE2, 0x80])])  # a stray byte
            elif r < 0.6:
                ids.append(tokenizer.eos_token_id)
            else:
                ids.append(rng.choice(words))
        sizes = [1] if trial % 2 == 0 else [rng.randint(1, 6) for _ in range(3)]
        pieces, text = run(tokenizer, chunks(ids, sizes))
        context = (tokenizer.convert_ids_to_tokens(ids), sizes)
        assert "".join(pieces) == text, context
        expected = tokenizer.decode(ids, skip_special_tokens=True)
        if REPLACEMENT not in expected:
            check_append_only(pieces, expected, False)
        position = 0
        for token in ids:
            if token in word_text:
                found = text.find(word_text[token], position)
                assert found >= 0, (context, text)
                position = found + len(word_text[token])


# ---- stop strings ----------------------------------------------------------------------------

def feed_all(stop: tuple[str, ...], pieces: list[str]) -> tuple[StopStringHold, list[str]]:
    """Feed ``pieces``; return the hold and the text releasable after each piece."""
    hold = StopStringHold(stop)
    released = []
    for piece in pieces:
        hold.feed(piece)
        released.append(hold.text[:hold.releasable])
    return hold, released


def test_stop_spanning_pieces_releases_none_of_it():
    # The case: " the", " capital" were streamed, then the answer was cut to " ".
    hold, released = feed_all(("the capital of",), [" the", " capital", " of", " France"])
    assert released == [" ", " ", " ", " "]
    assert hold.text == " " and hold.stop_at == 1


def test_released_text_never_shrinks_nor_changes():
    hold, released = feed_all(("abcd", "xyz"), ["ab", "c", "x", "ab", "cx", "y", "q", "xy", "z", "tail"])
    for earlier, later in zip(released, released[1:]):
        assert later.startswith(earlier)
    assert hold.text == "abcxabcxyq" and released[-1] == hold.text


def test_several_stops_the_earliest_wins():
    hold, _ = feed_all(("world", "lo w"), ["hello world"])
    assert hold.text == "hel"
    # The stop completed first ends the text, even where a longer one started earlier.
    hold, _ = feed_all(("abcdef", "de"), ["abc", "de", "f"])
    assert hold.text == "abc"
    hold, _ = feed_all(("zzz", "c", "b"), ["a", "bc"])
    assert hold.text == "a"


@pytest.mark.parametrize("stop", [("ab", "abc"), ("abc", "ab")])
def test_a_stop_that_is_a_prefix_of_another(stop):
    hold, released = feed_all(stop, ["x", "a", "b", "c"])
    assert hold.text == "x" and released == ["x", "x", "x", "x"]


def test_hold_back_is_the_longest_possible_stop_start():
    hold = StopStringHold(("abcd", "bcx"))
    hold.feed("zab")
    assert hold.text[:hold.releasable] == "z"  # "ab" could still become "abcd"
    hold.feed("c")
    assert hold.text[:hold.releasable] == "z"  # "abc" / "bc" could still complete
    hold.feed("y")
    assert hold.releasable == len(hold.text) == 5 and hold.stop_at is None


def test_unicode_stop_and_empty_stop():
    hold, released = feed_all(("", "𝔫𝔦"), ["𝔘", "𝔫", "𝔦𝔠"])
    assert hold.text == "𝔘" and released == ["𝔘", "𝔘", "𝔘"]
    no_stop, released = feed_all(("",), ["a", "b"])
    assert released == ["a", "ab"] and no_stop.stop_at is None


def test_random_feeds_match_the_cut_oracle():
    """Random text over a small alphabet fed in random pieces: the final text is the text up to
    where the first stop appeared, and the released text only ever grows inside it."""
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("abc ") for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice("abc ") for _ in range(rng.randint(1, 4)))
                      for _ in range(rng.randint(1, 3)))
        cuts, pieces, start = [], [], 0
        while start < len(text):
            end = start + rng.randint(1, 5)
            pieces.append(text[start:end])
            start = end
        # Oracle: the first piece boundary where some stop appears; cut where the first one starts.
        expected, joined = text, ""
        for piece in pieces:
            joined += piece
            found = [joined.find(s) for s in stops if s in joined]
            if found:
                expected = joined[:min(found)]
                break
        hold, released = feed_all(stops, pieces)
        assert hold.text == expected, (text, stops, pieces)
        for earlier, later in zip([""] + released, released):
            assert later.startswith(earlier) and expected.startswith(later), (text, stops, pieces)
        cuts.append(hold.stop_at)


def test_detokenizer_and_hold_together_on_real_tokens(tokenizer):
    ids = tokenizer(" the capital of France is Paris", add_special_tokens=False)["input_ids"]
    detok, hold = IncrementalDetokenizer(tokenizer), StopStringHold(("the capital of",))
    streamed = ""
    for token in ids:
        hold.feed(detok.push([token]))
        streamed = hold.text[:hold.releasable] if hold.stop_at is None else hold.text
        assert hold.text.startswith(streamed) and "the" not in streamed
        if hold.stop_at is not None:
            break
    assert hold.text == " " and streamed == " "
