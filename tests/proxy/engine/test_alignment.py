"""Alignment on the real model: after an edit in the middle of the file, drafting from the
prediction resumes where the output rejoins it, so accepted prediction tokens cover the
unchanged text after the seam."""

from __future__ import annotations

from pathlib import Path

import pytest

from foretell.proxy.engine import GenerationRequest, SpeculativeEngine
from tests.helpers import assert_greedy_equal, greedy_reference

EDIT_DIR = Path(__file__).resolve().parents[3] / "examples" / "edit"
MIN_SHARE_AFTER_SEAM = 0.90


@pytest.fixture(scope="module")
def copy_case(embedded):
    prompt_ids = embedded.tokenizer((EDIT_DIR / "prompt.txt").read_text())["input_ids"]
    output = greedy_reference(embedded.model, prompt_ids, 240)
    return prompt_ids, output, embedded.tokenizer.decode(output, skip_special_tokens=True)


def edits(text: str):
    """(name, prediction, character offset in the output where the prediction resumes)."""
    lines = text.splitlines(keepends=True)
    cut = len("".join(lines[: len(lines) // 3]))
    next_line = cut + len(lines[len(lines) // 3])
    return [
        # The output has a line the prediction lacks (an insertion by the model).
        ("insertion", text[:cut] + text[next_line:], next_line),
        # The prediction has a line the output lacks (a deletion by the model).
        ("deletion", text[:cut] + "        print('debug', locals())\n" + text[cut:], cut),
        # A line changed.
        ("replacement", text[:cut] + "    # TODO: remove this method\n" + text[next_line:], next_line),
    ]


@pytest.mark.embedded
@pytest.mark.parametrize("name", ["insertion", "deletion", "replacement"])
def test_prediction_covers_text_after_the_seam(embedded, copy_case, name):
    prompt_ids, reference, text = copy_case
    _, prediction, seam = next(e for e in edits(text) if e[0] == name)
    engine = SpeculativeEngine(embedded.model, embedded.tokenizer)
    # Prompt lookup off: the prompt holds the same text, and this test is about the prediction.
    result = engine.generate(GenerationRequest(prompt_ids=prompt_ids, max_tokens=len(reference),
                                               prediction=prediction, prompt_lookup=False))
    assert_greedy_equal(embedded.model, prompt_ids, result.token_ids, reference, 5e-3)
    assert result.token_ids == reference  # (no near tie here; the share below needs equality)

    # First output token that ends past the seam.
    decode = embedded.tokenizer.decode
    after = next(i for i in range(len(reference) + 1)
                 if len(decode(reference[:i], skip_special_tokens=True)) > seam) - 1
    origins = result.token_origins[after:]
    share = sum(origin == "prediction" for origin in origins) / len(origins)
    assert len(origins) > 100, "the seam must be in the middle of a long enough output"
    print(f"{name}: {share:.1%} of the {len(origins)} tokens after the seam came from the prediction")
    assert share >= MIN_SHARE_AFTER_SEAM, (
        f"{name}: only {share:.1%} of the {len(origins)} tokens after the seam were accepted "
        "from the prediction"
    )
