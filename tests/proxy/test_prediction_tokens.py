"""A long prediction tokenised in a child process (``proxy/prediction_tokens.py``): the same ids
and token starts as the server's tokenizer gives in process, the child restarted when it died,
and the prediction tokenised in process where there is no tokenizer file for a child to load."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from foretell.proxy.engine.draft_sources import PredictionEncoding
from foretell.proxy.prediction_tokens import CHILD_PROCESS_CHARS, PredictionTokenizer

# Long, and full of characters that split across tokens (byte fallback, combining marks).
LONG = "".join(f"line {i}: naïve café 東京タワー 🗼 e\u0301 \t{i * 7 % 13}\n" for i in range(1200))


@pytest.fixture
def tokens(tokenizer):
    """A fresh PredictionTokenizer whose (process-wide, per tokenizer file) child is not running."""
    encoder = PredictionTokenizer(tokenizer)
    stop_child(encoder)
    yield encoder
    stop_child(encoder)


def stop_child(encoder):
    if encoder.child.process is not None:
        encoder.child.process.kill()
        encoder.child.process.wait()
        encoder.child.process = None


def test_a_long_prediction_comes_back_from_the_child_as_tokenised_here(tokens, tokenizer):
    assert len(LONG) >= CHILD_PROCESS_CHARS
    assert tokens.encode(LONG) == PredictionEncoding.of(tokenizer, LONG)
    assert tokens.usable and tokens.child.process.poll() is None  # the child did it


def test_servers_of_one_model_share_one_child(tokens, tokenizer):
    tokens.encode(LONG)
    other = PredictionTokenizer(tokenizer)  # another server's LocalModel, same tokenizer file
    assert other.child is tokens.child and other.encode(LONG) == tokens.encode(LONG)


def test_a_short_prediction_needs_no_child(tokens, tokenizer):
    assert tokens.encode("x = 1\n") == PredictionEncoding.of(tokenizer, "x = 1\n")
    assert tokens.child.process is None


def test_a_child_that_died_is_started_again(tokens, tokenizer):
    tokens.encode(LONG)
    first = tokens.child.process
    first.kill()
    first.wait()
    assert tokens.encode(LONG[1:]) == PredictionEncoding.of(tokenizer, LONG[1:])
    assert tokens.child.process is not first and tokens.child.process.poll() is None


def test_without_a_tokenizer_file_it_is_tokenised_here(tokenizer, tmp_path):
    elsewhere = copy.copy(tokenizer)
    elsewhere.name_or_path = str(tmp_path)  # a folder without tokenizer.json
    encoder = PredictionTokenizer(elsewhere)
    assert encoder.encode(LONG) == PredictionEncoding.of(tokenizer, LONG)
    assert encoder.usable is False and encoder.child.process is None


def test_the_child_imports_neither_torch_nor_transformers():
    # It must start in a moment and weigh little beside the server.
    imported = subprocess.run([sys.executable, "-c", "import sys, foretell.proxy.prediction_tokens; "
                               "print('torch' in sys.modules, 'transformers' in sys.modules)"],
                              capture_output=True, text=True, check=True).stdout.split()
    assert imported == ["False", "False"]
