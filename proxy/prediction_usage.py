"""OpenAI's prediction usage figures for a finished completion.

``accepted_prediction_tokens``: prediction tokens whose text appears in the completion;
``rejected_prediction_tokens``: the prediction tokens that do not. Matching is done on text (lines
first, then characters inside changed regions) so that an insertion in the middle of a file
rejects nothing, even though the tokens around the seam differ.
"""

from __future__ import annotations

import pickle
from difflib import SequenceMatcher

from foretell.proxy.child_process import Child, serve


def _matched_character_mask(prediction: str, completion: str) -> list[bool]:
    """For each character of the prediction: does it belong to text that the completion kept?"""
    mask = [False] * len(prediction)
    pred_lines = prediction.splitlines(keepends=True)
    comp_lines = completion.splitlines(keepends=True)
    pred_offsets = _line_offsets(pred_lines)
    comp_offsets = _line_offsets(comp_lines)
    lines = SequenceMatcher(None, pred_lines, comp_lines, autojunk=False)
    for tag, p1, p2, c1, c2 in lines.get_opcodes():
        p_start, p_end = pred_offsets[p1], pred_offsets[p2]
        if tag == "equal":
            mask[p_start:p_end] = [True] * (p_end - p_start)
        elif tag == "replace":
            # A changed line usually keeps most of its characters.
            chars = SequenceMatcher(None, prediction[p_start:p_end],
                                    completion[comp_offsets[c1]:comp_offsets[c2]], autojunk=False)
            for block in chars.get_matching_blocks():
                start = p_start + block.a
                mask[start:start + block.size] = [True] * block.size
    return mask


def _line_offsets(lines: list[str]) -> list[int]:
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    return offsets


def prediction_token_usage(prediction: str, token_starts: list[int], completion: str) -> tuple[int, int]:
    """Return (accepted, rejected) prediction tokens; token i spans token_starts[i] up to the
    next token's start."""
    if not token_starts:
        return 0, 0
    mask = _matched_character_mask(prediction, completion)
    ends = token_starts[1:] + [len(prediction)]
    accepted = 0
    for start, end in zip(token_starts, ends):
        if all(mask[start:max(end, start + 1)]):
            accepted += 1
    return accepted, len(token_starts) - accepted


# Predictions at least this long are counted in a child process (``child_process.py``): the diff
# is pure Python, and in a thread of the server's process it would hold the GIL that the engine's
# thread needs between every tensor operation (measured: one decoding step waited out a whole 3 s
# diff).
CHILD_PROCESS_CHARS = 32 * 1024

_child = Child(__name__)


def expect(prediction: str) -> None:
    """A caller that will count ``prediction``'s usage later says so now: a long one starts the
    child meanwhile, so that the count does not wait for it."""
    if len(prediction) >= CHILD_PROCESS_CHARS:
        _child.start()


def count_away(prediction: str, token_starts: list[int], completion: str) -> tuple[int, int]:
    """``prediction_token_usage``, computed in the child process for a long prediction (blocks
    the calling thread, not the GIL); here for a short one, or where the child cannot run."""
    if len(prediction) >= CHILD_PROCESS_CHARS:
        try:
            return _child.ask(prediction, token_starts, completion)
        except (OSError, EOFError, pickle.PickleError):
            pass
    return prediction_token_usage(prediction, token_starts, completion)


if __name__ == "__main__":
    serve(prediction_token_usage)
