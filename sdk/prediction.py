"""Predictions in every form a caller holds them, turned into OpenAI's request field
``{"type": "content", "content": str | [{"type": "text", "text": str}]}``."""

from __future__ import annotations

import os
from typing import Any, Union

PredictionInput = Union[str, "os.PathLike[str]", list, dict, None]


def prediction_from_file(path: str | os.PathLike, encoding: str = "utf-8") -> dict:
    """The prediction field holding a file's current text (read now, newlines kept as they are
    on disk). Raises ``FileNotFoundError`` / ``ValueError`` (not decodable) with the path."""
    try:
        with open(path, encoding=encoding, newline="") as file:
            text = file.read()
    except UnicodeDecodeError as error:
        raise ValueError(f"{os.fspath(path)!r} is not valid {encoding} text: {error}") from None
    return {"type": "content", "content": text}


def normalize_prediction(value: PredictionInput) -> dict | None:
    """``str`` -> the text itself; ``os.PathLike`` -> the file's text; a list of strings or
    ``{"type": "text", "text": ...}`` parts -> text parts; a ready ``{"type": "content", ...}``
    dict -> checked and passed on; None -> None."""
    if value is None:
        return None
    if isinstance(value, str):
        return {"type": "content", "content": value}
    if isinstance(value, os.PathLike):
        return prediction_from_file(value)
    if isinstance(value, dict):
        if value.get("type") != "content" or "content" not in value:
            raise TypeError('a prediction dict must look like {"type": "content", "content": ...}')
        content = value["content"]
        if isinstance(content, str):
            return {"type": "content", "content": content}
        return {"type": "content", "content": _parts(content)}
    if isinstance(value, (list, tuple)):
        return {"type": "content", "content": _parts(value)}
    raise TypeError(f"prediction must be a string, a list of text parts, a path or a dict; "
                    f"got {type(value).__name__}")


def _parts(items: Any) -> list[dict]:
    if not isinstance(items, (list, tuple)):
        raise TypeError("prediction content must be a string or a list of text parts")
    parts = []
    for item in items:
        if isinstance(item, str):
            parts.append({"type": "text", "text": item})
        elif isinstance(item, dict) and item.get("type") == "text" and isinstance(item.get("text"), str):
            parts.append({"type": "text", "text": item["text"]})
        else:
            raise TypeError('each prediction part must be a string or {"type": "text", "text": str}')
    return parts


def prediction_text(prediction: dict | None) -> str:
    """The text a normalised prediction stands for ('' for None)."""
    if prediction is None:
        return ""
    content = prediction["content"]
    if isinstance(content, str):
        return content
    return "".join(part["text"] for part in content)
