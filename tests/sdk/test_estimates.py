"""Token and cost estimates with tiktoken (o200k_base provisioned offline), and OpenAI's limits."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from foretell.sdk import count_tokens, estimate_prediction, prediction_issues
from foretell.sdk.estimates import OUTPUT_PRICE_PER_MILLION, PRICES_AS_OF, model_family


def test_counts_tokens_with_o200k_base(tiktoken_cache):
    assert count_tokens("hello world", "gpt-4o") == 2
    assert count_tokens("", "gpt-4.1-mini") == 0
    # Special-token text in a file is counted as text, not refused.
    assert count_tokens("<|endoftext|>", "gpt-4o") > 1


def test_worst_case_cost_of_a_rejected_prediction(tiktoken_cache):
    text = "def area(width, height):\n    return width * height\n" * 20
    estimate = estimate_prediction(text, "gpt-4o-2024-08-06")
    tokens = count_tokens(text, "gpt-4o")
    assert estimate.prediction_tokens == tokens > 100
    assert estimate.encoding == "o200k_base" and estimate.exact_tokenizer
    assert estimate.output_price_per_million == OUTPUT_PRICE_PER_MILLION["gpt-4o"]
    assert estimate.worst_case_extra_cost == pytest.approx(tokens * 10.0 / 1e6)
    assert estimate.prices_as_of == PRICES_AS_OF and estimate.warnings == []
    mini = estimate_prediction(["def area", {"type": "text", "text": "(w, h): ..."}], "gpt-4.1-nano")
    assert mini.worst_case_extra_cost == pytest.approx(mini.prediction_tokens * 0.40 / 1e6)


def test_unknown_models_get_tokens_only(tiktoken_cache):
    estimate = estimate_prediction("some text", "gemma-3-270m")
    assert estimate.prediction_tokens == count_tokens("some text")
    assert not estimate.exact_tokenizer
    assert estimate.output_price_per_million is None and estimate.worst_case_extra_cost is None
    assert any("documents predictions only" in w for w in estimate.warnings)


def test_estimate_reports_openai_parameter_limits(tiktoken_cache):
    estimate = estimate_prediction("x", "gpt-4o-mini", n=2, presence_penalty=0.5, max_completion_tokens=9)
    assert len(estimate.warnings) == 3


def test_model_families():
    assert model_family("gpt-4.1-mini-2025-04-14") == "gpt-4.1-mini"
    assert model_family("openai/gpt-4o") == "gpt-4o"
    assert model_family("gpt-4.5-preview") is None and model_family("o3-mini") is None


@pytest.mark.parametrize("params,needle", [
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"functions": [{}]}, "tools"),
    ({"n": 3}, "n > 1"),
    ({"logprobs": True}, "logprobs"),
    ({"presence_penalty": 0.1}, "presence_penalty"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"max_completion_tokens": 100}, "max_completion_tokens"),
    ({"modalities": ["text", "audio"]}, "text output only"),
])
def test_each_documented_limit_is_reported(params, needle):
    issues = prediction_issues("gpt-4o", params)
    assert len(issues) == 1 and needle in issues[0]


def test_allowed_parameters_and_non_openai_models_raise_nothing():
    assert prediction_issues("gpt-4o", {"n": 1, "presence_penalty": 0, "temperature": 0, "stop": ["x"]}) == []
    assert prediction_issues("llama-3-8b", {}) == []  # not an OpenAI model, not OpenAI's host
    assert prediction_issues("llama-3-8b", {}, openai_target=True) != []
    assert prediction_issues("gpt-4o", {}, endpoint="completions") == [
        "OpenAI accepts predictions on chat completions only"]


def test_without_an_encoding_a_clear_error_names_tiktoken_cache_dir(tmp_path):
    # A fresh process, an empty cache and a proxy that refuses: tiktoken cannot fetch the file.
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path), "HTTPS_PROXY": "http://127.0.0.1:9",
           "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
    code = ("from foretell.sdk import count_tokens, TokenizerUnavailableError\n"
            "try:\n    count_tokens('x', 'gpt-4o')\n"
            "except TokenizerUnavailableError as e:\n    print('ERR', e)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ERR") and "TIKTOKEN_CACHE_DIR" in result.stdout
