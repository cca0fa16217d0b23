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

from foretell.proxy.options import PRECISION_OPTIONS, Option


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


def add_option(command, option: Option) -> None:
    """An option of the table in ``proxy/options.py`` on ``command`` (a parser or a group): its
    value type, its default read from its environment variable after parsing, its help."""
    kwargs = {"help": option.full_help()}
    if option.metavar:
        kwargs["metavar"] = option.metavar
    if option.kind == "flag":
        command.add_argument(option.flag, action="store_true", default=FromEnv(option.env, False, env_flag), **kwargs)
    elif option.kind == "switch":
        both = command.add_mutually_exclusive_group()
        both.add_argument(option.flag, dest=option.name, action="store_true",
                          default=FromEnv(option.env, option.default, switch), **kwargs)
        both.add_argument("--no-" + option.flag[2:], dest=option.name, action="store_false",
                          help=option.negative_help)
    elif option.kind == "keys":
        # argparse appends to a list default, so this one is read now (a list needs no checking).
        command.add_argument(option.flag, action="append", default=comma_list(os.environ.get(option.env, "")),
                             **kwargs)
    else:
        convert = one_of(option.choices) if option.kind == "choice" else _CONVERTERS[option.kind]
        command.add_argument(option.flag, type=convert, default=FromEnv(option.env, option.default, convert),
                             **kwargs)


def add_options(command, options: dict[str, Option]) -> None:
    for option in options.values():
        add_option(command, option)


def add_precision_options(command: argparse.ArgumentParser) -> None:
    """--dtype, --fp32-head / --no-fp32-head, --quantize and --kernels, the same on generate and
    serve. Each is None when neither the command line nor the environment sets it (serve then
    takes the configuration file's local route, else the default)."""
    add_options(command, PRECISION_OPTIONS)


def env_flag(raw: str) -> bool:
    return raw not in ("", "0")


def comma_list(raw: str) -> list[str]:
    return [part for part in raw.split(",") if part]


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


_CONVERTERS = {"text": str, "int": int, "positive_int": positive_int, "non_negative_float": non_negative_float}
