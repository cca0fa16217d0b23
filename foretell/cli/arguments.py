"""What every command's options share: value types that say what they expect, defaults read from
the environment after parsing (``FromEnv``), the precision and kernel options of the commands
that load the model, file reading, and the message for a missing proxy extra."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any, Callable

from foretell.proxy.options import DTYPE_CHOICES, KERNEL_CHOICES, QUANTIZE_CHOICES


def read_file(path: str, what: str) -> tuple[bytes, str]:
    """A file's bytes and its UTF-8 text, or a clear exit."""
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"foretell: {what} {path!r} does not exist or is not a file")
    raw = file.read_bytes()
    try:
        return raw, raw.decode("utf-8")
    except UnicodeDecodeError:
        raise SystemExit(f"foretell: {what} {path!r} is not valid UTF-8 text") from None


def read_text(path: str, what: str) -> str:
    if path == "-":
        return sys.stdin.read()
    return read_file(path, what)[1]


def positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def temperature_value(value: str) -> float:
    number = float(value)
    if not 0.0 <= number <= 2.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 2], got {value}")
    return number


def top_p_value(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in (0, 1], got {value}")
    return number


def log_level(value: str) -> str:
    level = value.strip().lower()
    if level not in ("debug", "info", "warning", "error"):
        raise argparse.ArgumentTypeError(f"must be debug, info, warning or error, got {value}")
    return level


def log_format(value: str) -> str:
    fmt = value.strip().lower()
    if fmt not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"must be text or json, got {value}")
    return fmt


def one_of(choices: tuple[str, ...]) -> Callable[[str], str]:
    def convert(value: str) -> str:
        name = value.strip().lower()
        if name not in choices:
            raise argparse.ArgumentTypeError(f"must be {', '.join(choices[:-1])} or {choices[-1]}, got {value}")
        return name
    return convert


def switch(value: str) -> bool:
    name = value.strip().lower()
    if name not in ("1", "0", "true", "false", "on", "off", "yes", "no"):
        raise argparse.ArgumentTypeError(f"must be 1 or 0 (on or off), got {value}")
    return name in ("1", "true", "on", "yes")


def add_precision_options(command: argparse.ArgumentParser) -> None:
    """--dtype, --fp32-head / --no-fp32-head and --quantize, the same on generate and serve.
    Each is None when neither the command line nor the environment sets it (serve then takes
    the configuration file's local route, else the default)."""
    command.add_argument("--dtype", type=one_of(DTYPE_CHOICES),
                         default=FromEnv("FORETELL_DTYPE", None, one_of(DTYPE_CHOICES)),
                         help="weights' dtype: auto (default: float32 beside --quantize auto's int8, "
                              "else bfloat16 on CUDA and on a CPU with native bf16, else float32), "
                              "float32 (text identical to plain greedy decoding but at near ties; "
                              "with --quantize auto it keeps float32 throughout), bfloat16 or "
                              "float16 (identical to this engine's own plain decoding except at near "
                              "ties; see the README) (env: FORETELL_DTYPE)")
    head = command.add_mutually_exclusive_group()
    head.add_argument("--fp32-head", dest="fp32_head", action="store_true",
                      default=FromEnv("FORETELL_FP32_HEAD", None, switch),
                      help="score each row's leading tokens in float32 over an approximate head "
                           "(bf16/fp16 or int8), so that rounding does not decide between them "
                           "(default: on for int8, and for bf16/fp16 unquantized; with int4 it keeps "
                           "the head in bf16) (env: FORETELL_FP32_HEAD=1 or 0)")
    head.add_argument("--no-fp32-head", dest="fp32_head", action="store_false",
                      help="take the logits at the head's own precision")
    command.add_argument("--quantize", type=one_of(QUANTIZE_CHOICES),
                         default=FromEnv("FORETELL_QUANTIZE", None, one_of(QUANTIZE_CHOICES)),
                         help="quantization of the linear layers: auto (default: int8 on a CPU where "
                              "it measures faster than float32 on the output head, timed once per "
                              "machine; none on CUDA or beside a --dtype given by name), none, int8 "
                              "(int8 weights x int8 activations in exact integer sums through FBGEMM "
                              "on x86: one text per request, speculative text identical to its own "
                              "plain text; weight-only elsewhere) or int4 (torchao weight-only, "
                              "groups of 128; identical to its own plain decoding except at near "
                              "ties) (env: FORETELL_QUANTIZE)")


def add_kernels_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--kernels", type=one_of(KERNEL_CHOICES),
                         default=FromEnv("FORETELL_KERNELS", None, one_of(KERNEL_CHOICES)),
                         help="attention and verification kernels: auto (default: Triton on CUDA, "
                              "each checked against its torch reference at start-up and replaced "
                              "by it if it fails; the torch references elsewhere), triton (also on "
                              "a CPU under TRITON_INTERPRET=1: slow, for tests) or reference "
                              "(env: FORETELL_KERNELS)")


def seconds(value: str) -> float:
    number = float(value)
    if not number > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return number


# What a converter wants, for a value it refuses with a bare ValueError.
_EXPECTED = {int: "must be an integer", positive_int: "must be a positive integer",
             float: "must be a number"}


class FromEnv:
    """An option's default that comes from an environment variable, read after parsing (by
    ``resolve_env``) rather than when the parser is built: a bad value then fails only the
    command that uses it (not ``--help``, not the other commands), and is reported by name."""

    def __init__(self, variable: str, fallback: Any, convert: Callable[[str], Any]):
        self.variable, self.fallback, self.convert = variable, fallback, convert

    def resolve(self) -> Any:
        raw = os.environ.get(self.variable, "")
        if not raw:
            return self.fallback
        try:
            return self.convert(raw)
        except argparse.ArgumentTypeError as error:
            reason = str(error)
        except ValueError:  # int() or float() refused it
            reason = _EXPECTED.get(self.convert, "is not a valid value")
        print(f"foretell: environment variable {self.variable}={raw!r}: {reason}", file=sys.stderr)
        raise SystemExit(2)  # as argparse exits for a bad option


def resolve_env(args: argparse.Namespace) -> None:
    for name, value in vars(args).items():
        if isinstance(value, FromEnv):
            setattr(args, name, value.resolve())


@contextlib.contextmanager
def needs_proxy_extra(command: str):
    """A bare install (the SDK alone) has no torch, transformers, fastapi or uvicorn: say which
    install the command needs instead of a ModuleNotFoundError traceback."""
    try:
        yield
    except ModuleNotFoundError as error:
        if error.name and error.name.split(".")[0] == "foretell":
            raise  # one of our own modules: a bug, not an install
        what = f"missing module {error.name!r}" if error.name else str(error)
        raise SystemExit(f"foretell: `foretell {command}` needs the proxy extra ({what}): "
                         "pip install 'foretell[proxy]' (from a checkout: pip install -e '.[proxy]')"
                         ) from None


def non_negative_float(value: str) -> float:
    number = float(value)
    if number < 0:
        raise argparse.ArgumentTypeError("must be 0 or more")
    return number
