"""Draft sources on their own: the prediction aligner and prompt lookup (no model needed)."""

from __future__ import annotations

import pytest

from foretell.proxy.engine.draft_sources import PredictionSource, PromptLookupSource

FILE = """def load(path):
    with open(path) as handle:
        return handle.read()


def save(path, text):
    with open(path, "w") as handle:
        handle.write(text)


def main():
    text = load("in.txt")
    save("out.txt", text.upper())
"""


def follow(source: PredictionSource, tokenizer, output_text: str, step: int = 7):
    """Feed ``output_text`` to the source a few characters at a time, as rounds would."""
    cursors = []
    for end in range(step, len(output_text) + step, step):
        text = output_text[:end]
        source.observe(tokenizer.encode(text, add_special_tokens=False), text)
        cursors.append(source.cursor)
    return cursors


def draft_text(source, tokenizer, n=8):
    return tokenizer.decode(source.propose(n))


def test_perfect_prediction_drafts_its_own_tokens(tokenizer):
    source = PredictionSource(tokenizer, FILE)
    assert source.propose(5) == tokenizer.encode(FILE, add_special_tokens=False)[:5]
    follow(source, tokenizer, FILE[:40])
    assert source.cursor == 40
    assert FILE[40:].startswith(draft_text(source, tokenizer))


@pytest.mark.parametrize("name,output", [
    ("insertion", FILE.replace("def main():\n", "def main():\n    print('starting')\n")),
    ("deletion", FILE.replace('        handle.write(text)\n', '')),
    ("replacement", FILE.replace('def save(path, text):', 'def store(path, text, mode):')),
])
def test_rejoins_within_a_few_tokens_of_the_seam(tokenizer, name, output):
    source = PredictionSource(tokenizer, FILE)
    seam_end = len(output) - len(_common_suffix(output, FILE))
    follow(source, tokenizer, output[: seam_end + 16], step=4)
    # 16 characters past the seam the cursor sits at the same text in the prediction...
    assert source.cursor is not None
    rest_output = output[seam_end + 16 :]
    assert FILE[source.cursor :].startswith(rest_output[:20])
    # ...and the draft continues the output.
    assert rest_output.startswith(draft_text(source, tokenizer, 6))


def test_repeated_lines_do_not_send_the_cursor_back(tokenizer):
    block = "    x = compute(x)\n    log(x)\n"
    prediction = "def f(x):\n" + block * 4 + "    return x\n"
    output = "def f(x):\n" + block * 2 + "    check(x)\n" + block * 2 + "    return x\n"
    source = PredictionSource(tokenizer, prediction)
    cursors = [c for c in follow(source, tokenizer, output, step=3) if c is not None]
    assert cursors == sorted(cursors), "the cursor moved backwards"
    assert cursors[-1] == len(prediction)


def test_useless_prediction_stays_silent(tokenizer):
    source = PredictionSource(tokenizer, "Completely unrelated prose about weather and tea.\n" * 3)
    follow(source, tokenizer, FILE)
    assert source.propose(8) == []


def test_seam_inside_a_token_is_retokenised(tokenizer):
    source = PredictionSource(tokenizer, "handle.write(text)\n")
    output = "handle.wri"  # ends inside the token of "write"
    source.observe(tokenizer.encode(output, add_special_tokens=False), output)
    assert source.cursor == len(output)
    assert draft_text(source, tokenizer, 4).startswith("te(")


def _common_suffix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return a[len(a) - n :]


@pytest.mark.parametrize("prompt,output,expected", [
    # Longest match wins: "c d" occurs twice, but "b c d" only once, followed by "E".
    ([1, 2, 3, 4, 5, 9, 3, 4, 6, 7], [2, 3, 4], [5, 9, 3]),
    # Equal lengths: the most recent occurrence wins.
    ([3, 4, 5, 8, 3, 4, 6], [3, 4], [6, 3, 4]),
    # No match at all.
    ([1, 2, 3], [7, 8], []),
    # The match may come from the output itself.
    ([1, 2], [5, 6, 7, 5, 6], [7, 5, 6]),
])
def test_prompt_lookup_table(prompt, output, expected):
    source = PromptLookupSource(prompt)
    source.observe(output, "")
    assert source.propose(3) == expected


def test_prompt_lookup_respects_max_tokens():
    source = PromptLookupSource([1, 2, 3, 4, 5, 6, 1, 2])
    assert source.propose(2) == [3, 4]
    assert source.propose(0) == []
