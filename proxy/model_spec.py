"""What a model spec names, decided without torch: the embedded default model, a ``.gguf`` file
or a local Hugging Face model folder. ``engine/model_loader.py`` resolves it; the command line
checks it first, so that a wrong ``--model`` is refused before seconds of imports."""

from __future__ import annotations

from pathlib import Path

EMBEDDED_MODEL_NAME = "gemma-3-270m"


def model_kind(model: str | None) -> tuple[str, Path | None]:
    """``("embedded", None)``, ``("gguf", file)`` or ``("folder", folder)``; ValueError otherwise."""
    if model in (None, "", EMBEDDED_MODEL_NAME):
        return "embedded", None
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return "gguf", path
    if path.is_dir() and (path / "config.json").is_file():
        return "folder", path
    raise ValueError(
        f"model {model!r} is neither {EMBEDDED_MODEL_NAME!r}, a .gguf file, "
        "nor a local Hugging Face model folder with a config.json"
    )
