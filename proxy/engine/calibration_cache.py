"""The start-up calibration, measured once per machine, model and torch version, then reused.

``SpeculativeEngine.calibrate()`` times passes of the model (7-20 s on a 2-core CPU) to get the
prior of the draft-length chooser: the pass cost and the sampling verify's cost. The figures
depend on the machine, the device, torch and the model, not on the run, so they are kept under
the foretell cache folder (``$FORETELL_CACHE_DIR`` or ``~/.cache/foretell``) as
``calibration/<key>.json``, the key a hash of: the host name, the CPU model, the number of torch
threads, the torch version, the device, the model's dtype and the model itself (the sha256 of its
cache manifest, else its folder's path and its files' sizes and times). A later start with the
same key sets the engine's prior from the file instead of measuring; ``recalibrate=True``
(``--recalibrate``) measures again and rewrites it. A file that is unreadable, from another
version or holds no usable figures is measured over.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from foretell.proxy.engine.draft_length import PassCostModel
from foretell.proxy.engine.model_loader import MANIFEST_NAME, _log, cache_root

CACHE_VERSION = 1


@dataclass
class Calibration:
    pass_cost: PassCostModel
    sampling_cost: PassCostModel
    from_cache: bool
    path: Path


def calibration_dir() -> Path:
    return cache_root().parent / "calibration"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def model_identity(folder) -> str:
    """The model's own identity: its sealed manifest when it has one (a converted GGUF file),
    else its folder's path with its files' names, sizes and modification times."""
    folder = Path(folder).resolve()
    manifest = folder / MANIFEST_NAME
    if manifest.is_file():
        return "manifest:" + hashlib.sha256(manifest.read_bytes()).hexdigest()
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    return "folder:" + hashlib.sha256(json.dumps([str(folder), files]).encode()).hexdigest()


def key_parts(engine, model_folder) -> dict:
    """What the measured figures depend on."""
    import torch

    device = engine.device
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {
        "version": CACHE_VERSION,
        "node": platform.node(),
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device_name,
        "precision": engine.precision,
        "model": model_identity(model_folder),
    }


def cache_path(parts: dict) -> Path:
    key = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    return calibration_dir() / f"{key}.json"


def calibrate_with_cache(engine, model_folder, recalibrate: bool = False) -> Calibration:
    """Set ``engine``'s cost prior from the cached calibration, or measure it (and cache it)."""
    parts = key_parts(engine, model_folder)
    path = cache_path(parts)
    if not recalibrate:
        cached = _read(path, parts)
        if cached is not None:
            pass_cost, sampling_cost = cached
            engine.cost.reset(pass_cost)
            engine.sampling_cost = sampling_cost
            _log(f"calibration from cache ({path}; --recalibrate measures again)")
            return Calibration(pass_cost, sampling_cost, True, path)
    _log("calibrating pass cost (cached for next time) ...")
    started = time.perf_counter()
    pass_cost = engine.calibrate()
    _log(f"calibrated in {time.perf_counter() - started:.1f} s")
    _write(path, parts, pass_cost, engine.sampling_cost)
    return Calibration(pass_cost, engine.sampling_cost, False, path)


def _cost(entry) -> PassCostModel:
    fixed, per_position = float(entry["fixed"]), float(entry["per_position"])
    if not (math.isfinite(fixed) and math.isfinite(per_position) and fixed > 0 and per_position > 0):
        raise ValueError("not a usable cost")
    return PassCostModel(fixed=fixed, per_position=per_position)


def _read(path: Path, parts: dict) -> tuple[PassCostModel, PassCostModel] | None:
    try:
        stored = json.loads(path.read_text())
        if stored.get("key") != parts:
            return None
        return _cost(stored["pass_cost"]), _cost(stored["sampling_cost"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        _log(f"calibration cache {path} is unusable; measuring again")
        return None


def _write(path: Path, parts: dict, pass_cost: PassCostModel, sampling_cost: PassCostModel) -> None:
    entry = {"key": parts, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "pass_cost": {"fixed": pass_cost.fixed, "per_position": pass_cost.per_position},
             "sampling_cost": {"fixed": sampling_cost.fixed, "per_position": sampling_cost.per_position}}
    try:
        write_json(path, entry)
    except OSError as error:  # a read-only cache folder: calibrate again next time
        _log(f"could not cache the calibration at {path}: {error}")


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON aside and rename it into place: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(data, file, indent=1)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
