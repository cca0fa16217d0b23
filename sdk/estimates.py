"""Token and cost estimates for predictions sent to OpenAI, and OpenAI's documented limits.

OpenAI bills prediction tokens that do not end up in the completion ("rejected") at the output
price, so the worst case of a prediction is all of it rejected: its token count times the output
price. foretell bills nothing; these estimates matter only for OpenAI targets.

Prices are an estimate: OpenAI's list prices per 1M output tokens as of ``PRICES_AS_OF``. Check
the current pricing page before relying on a figure.

Tokens are counted with tiktoken. tiktoken downloads an encoding on first use; without internet
it reads ``$TIKTOKEN_CACHE_DIR`` and otherwise ``TokenizerUnavailableError`` is raised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from foretell.sdk.errors import TokenizerUnavailableError
from foretell.sdk.prediction import PredictionInput, normalize_prediction, prediction_text

PRICES_AS_OF = "2025-06-01"

# USD per 1M output tokens (list prices, standard tier) of the models that support predictions.
OUTPUT_PRICE_PER_MILLION = {
    "gpt-4o": 10.00,
    "gpt-4o-2024-05-13": 15.00,  # the first gpt-4o snapshot kept its higher price
    "gpt-4o-mini": 0.60,
    "gpt-4.1": 8.00,
    "gpt-4.1-mini": 1.60,
    "gpt-4.1-nano": 0.40,
}

# OpenAI's Predicted Outputs guide: the models that accept ``prediction`` (dated snapshots too).
_SUPPORTED = re.compile(r"^(gpt-4o|gpt-4o-mini|gpt-4\.1|gpt-4\.1-mini|gpt-4\.1-nano)(-\d{4}-\d{2}-\d{2})?$")
# Names that are OpenAI's own models (so OpenAI's limits are worth a warning for them).
_OPENAI_NAME = re.compile(r"^(gpt-|chatgpt-|o\d|ft:gpt-|text-|davinci|babbage)")

FALLBACK_ENCODING = "o200k_base"  # the encoding of every prediction-capable model


def _bare(model: str) -> str:
    """The model's OpenAI name ('openai/gpt-4o' as routers write it -> 'gpt-4o')."""
    return model.removeprefix("openai/")


def model_family(model: str) -> str | None:
    """'gpt-4.1-mini' for 'gpt-4.1-mini-2025-04-14'; None when predictions are unsupported."""
    match = _SUPPORTED.match(_bare(model))
    return match.group(1) if match else None


def output_price_per_million(model: str) -> float | None:
    bare = _bare(model)
    if bare in OUTPUT_PRICE_PER_MILLION:
        return OUTPUT_PRICE_PER_MILLION[bare]
    family = model_family(bare)
    return OUTPUT_PRICE_PER_MILLION.get(family) if family else None


_ENCODINGS: dict[str, Any] = {}


def get_encoding(model: str):
    """(tiktoken encoding, exact): the model's own encoding, or o200k_base as an approximation
    for models tiktoken does not know (exact=False)."""
    import tiktoken

    try:
        name, exact = tiktoken.encoding_name_for_model(_bare(model)), True
    except KeyError:
        name, exact = FALLBACK_ENCODING, False
    if name not in _ENCODINGS:
        try:
            _ENCODINGS[name] = tiktoken.get_encoding(name)
        except Exception as error:  # network errors, a bad cache file, ...
            raise TokenizerUnavailableError(
                f"tiktoken could not load the {name} encoding ({type(error).__name__}: {error}). "
                f"It is downloaded on first use; without internet, put the encoding file in a "
                f"directory and point TIKTOKEN_CACHE_DIR at it (see docs/sdk.md).") from None
    return _ENCODINGS[name], exact


def count_tokens(text: str, model: str = "gpt-4o") -> int:
    """Tokens of ``text`` for an OpenAI model (o200k_base for models tiktoken does not know)."""
    return _count(get_encoding(model)[0], text)


def _count(encoding, text: str) -> int:
    return len(encoding.encode(text, disallowed_special=()))


@dataclass
class PredictionEstimate:
    model: str
    encoding: str
    exact_tokenizer: bool  # False: the model is unknown to tiktoken, counted with o200k_base
    prediction_tokens: int
    output_price_per_million: float | None  # USD; None for models without a known price
    worst_case_extra_cost: float | None  # USD if every prediction token is rejected
    prices_as_of: str = PRICES_AS_OF
    warnings: list[str] = field(default_factory=list)


def estimate_prediction(prediction: PredictionInput, model: str, **params: Any) -> PredictionEstimate:
    """Count the prediction's tokens and the most it can add to an OpenAI bill. ``params`` are
    the other request parameters, checked against OpenAI's documented limits (``warnings``)."""
    text = prediction_text(normalize_prediction(prediction))
    encoding, exact = get_encoding(model)
    tokens = _count(encoding, text)
    price = output_price_per_million(model)
    return PredictionEstimate(
        model=model, encoding=encoding.name, exact_tokenizer=exact, prediction_tokens=tokens,
        output_price_per_million=price,
        worst_case_extra_cost=None if price is None else tokens * price / 1_000_000,
        warnings=prediction_issues(model, params, openai_target=True),
    )


def prediction_issues(model: str, params: dict, *, endpoint: str = "chat",
                      openai_target: bool = False) -> list[str]:
    """Why OpenAI would refuse or ignore a prediction with these parameters (its Predicted
    Outputs guide: supported models only; no tools, n > 1, logprobs, presence or frequency
    penalty > 0, max_completion_tokens, audio or non-text modalities; chat completions only).
    The model check applies to OpenAI targets and to names of OpenAI models."""
    issues = []
    bare = _bare(model)
    if (openai_target or _OPENAI_NAME.match(bare)) and model_family(bare) is None:
        issues.append(f"OpenAI documents predictions only for gpt-4o, gpt-4o-mini, gpt-4.1, "
                      f"gpt-4.1-mini and gpt-4.1-nano, not {model!r}")
    if endpoint != "chat" and (openai_target or _OPENAI_NAME.match(bare)):
        issues.append("OpenAI accepts predictions on chat completions only")
    if params.get("tools") or params.get("functions"):
        issues.append("OpenAI does not support predictions with tools / function calling")
    if (params.get("n") or 1) > 1:
        issues.append("OpenAI does not support predictions with n > 1")
    if params.get("logprobs"):
        issues.append("OpenAI does not support predictions with logprobs")
    for penalty in ("presence_penalty", "frequency_penalty"):
        if (params.get(penalty) or 0) > 0:
            issues.append(f"OpenAI does not support predictions with {penalty} > 0")
    if params.get("max_completion_tokens") is not None:
        issues.append("OpenAI does not support predictions with max_completion_tokens "
                      "(use max_tokens)")
    modalities = params.get("modalities") or ["text"]
    if params.get("audio") or any(m != "text" for m in modalities):
        issues.append("OpenAI supports predictions for text output only (no audio)")
    return issues
