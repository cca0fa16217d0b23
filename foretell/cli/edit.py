"""``foretell edit``: a file edited through the proxy or any OpenAI-compatible server, the file
as the prediction. Only ``foretell.sdk`` is imported: it works without torch."""

from __future__ import annotations

import argparse
import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path

from foretell.cli.arguments import positive_int, read_file, read_text, seconds
from foretell.origin_colors import CHOICES, legend, paint_within, use_color


def add_parser(commands) -> None:
    env = os.environ.get
    edit = commands.add_parser(
        "edit",
        help="edit a file through the proxy or any OpenAI-compatible server, the file as the prediction",
        description=(
            "Ask a model to apply an instruction to FILE, sending the file as the prediction. "
            "Prints the new file to stdout (or the unified diff with --diff, or writes the file "
            "with --write) and the statistics to stderr, with progress while the answer streams "
            "when stderr is a terminal. Without --model: FORETELL_MODEL, else the first model the "
            "server lists. The server: --base-url, else FORETELL_BASE_URL, else OPENAI_BASE_URL, "
            "else http://127.0.0.1:8000/v1."
        ),
    )
    edit.add_argument("file", metavar="FILE", help="the UTF-8 text file to edit")
    instruction = edit.add_mutually_exclusive_group(required=True)
    instruction.add_argument("--instruction", "-i", metavar="TEXT", help="what to change")
    instruction.add_argument("--instruction-file", metavar="F",
                             help="file holding the instruction ('-' reads stdin)")
    edit.add_argument("--model", default=env("FORETELL_MODEL"), metavar="M",
                      help="model name on the server (env: FORETELL_MODEL; default: the first "
                           "model the server lists)")
    edit.add_argument("--base-url", metavar="URL",
                      help="the server's OpenAI base URL (env: FORETELL_BASE_URL, then "
                           "OPENAI_BASE_URL; default: http://127.0.0.1:8000/v1)")
    edit.add_argument("--api-key", metavar="KEY",
                      help="API key (env: FORETELL_API_KEY, then OPENAI_API_KEY)")
    output = edit.add_mutually_exclusive_group()
    output.add_argument("--write", action="store_true",
                        help="replace FILE with the result (atomically; refused when FILE changed "
                             "meanwhile or the answer was cut off)")
    output.add_argument("--diff", action="store_true", help="print a unified diff instead of the file")
    edit.add_argument("--max-tokens", type=positive_int, metavar="N",
                      help="most tokens to generate (default: enough for the whole file and growth)")
    edit.add_argument("--no-prompt-lookup", action="store_true",
                      help="ask a foretell server not to use prompt lookup as the prediction's fallback")
    edit.add_argument("--color", choices=CHOICES, default="auto",
                      help="colour the printed file by token origin, as the server reports it: green "
                           "from the prediction, cyan from prompt lookup, magenta from the draft cache "
                           "of earlier answers, yellow from a server's draft model, plain the model's "
                           "own (default: auto, when stdout is a terminal and NO_COLOR is unset; not "
                           "with --diff or --write)")
    edit.add_argument("--timeout", type=seconds, default=None, metavar="S",
                      help="seconds the whole edit may take, from connecting to the last token "
                           "(default: no limit; each network wait is still limited to 600 s, "
                           "connecting to 10)")


class FileChangedError(Exception):
    """The file on disk is no longer the text the edit started from."""


def write_atomically(path: Path, text: str, expected: bytes) -> None:
    """Replace ``path`` with ``text`` (UTF-8) only if it still holds ``expected``: write a temporary
    file in the same directory, fsync it, give it the original's mode, check, then ``os.replace``.
    Any failure before the replace leaves the original untouched and removes the temporary file."""
    data = text.encode("utf-8")  # an unencodable result fails here, before anything is touched
    path = Path(os.path.realpath(path))  # edit a symlink's target, keep the link
    mode = stat.S_IMODE(os.stat(path).st_mode)
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".foretell-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, mode)
        if path.read_bytes() != expected:
            raise FileChangedError(f"{path} changed on disk while the edit ran; not written")
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable where the OS allows
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)


def edit_stats(result) -> str:
    tokens = result.completion_tokens
    speed = result.tokens_per_second
    parts = [f"{tokens if tokens is not None else '?'} tokens ({result.finish_reason or '?'}) in "
             f"{result.seconds:.1f} s" + (f", {speed:.1f} tok/s" if speed else "")]
    if result.usage is not None:
        parts.append(f"prediction tokens: {result.accepted_prediction_tokens} accepted, "
                     f"{result.rejected_prediction_tokens} rejected")
    if result.speculation is not None and result.speculation.target_passes is not None:
        parts.append(f"target passes: {result.speculation.target_passes}")
    lines = result.diff.splitlines()[2:]  # after the '--- a/' and '+++ b/' headers
    added = sum(line.startswith("+") for line in lines)
    removed = sum(line.startswith("-") for line in lines)
    parts.append(f"+{added} -{removed} lines" if result.changed else "no changes")
    return "foretell edit: " + "; ".join(parts)


def run(args: argparse.Namespace) -> int:
    # Only the SDK: `foretell edit` works with the bare `pip install foretell` (no torch).
    from foretell.sdk import Client, EditTruncatedError, ForetellError, edit_stream

    path = Path(args.file)
    original, text = read_file(args.file, "file")
    instruction = args.instruction
    if instruction is None:
        instruction = read_text(args.instruction_file, "instruction file")
    if not instruction.strip():
        raise SystemExit("foretell: the instruction is empty")

    progress = sys.stderr.isatty()
    color = not (args.write or args.diff) and use_color(args.color, sys.stdout)
    spans: list[tuple[str, str | None]] = []  # the answer in runs by origin, when colouring
    try:
        # --timeout is the SDK's deadline (the whole call), not its per-read timeout.
        with Client(args.base_url, args.api_key, deadline=args.timeout) as client:
            model = args.model or _first_model(client)
            stream = edit_stream(client, text, instruction, model=model, filename=path.name,
                                 max_tokens=args.max_tokens,
                                 prompt_lookup=False if args.no_prompt_lookup else None,
                                 report_origins=color)
            try:
                for step in stream:
                    if color:
                        spans.extend(step.origins if step.origins is not None else [(step.delta, None)])
                    if progress:
                        print(f"\rforetell edit: ~{step.approx_tokens} tokens, "
                              f"{step.tokens_per_second:.1f} tok/s", end="", file=sys.stderr, flush=True)
            finally:
                if progress:
                    print(file=sys.stderr)
    except EditTruncatedError as error:
        print(edit_stats(error.result), file=sys.stderr)
        raise SystemExit(f"foretell: {error}; {args.file} was not changed") from None
    except (ForetellError, ValueError) as error:
        raise SystemExit(f"foretell: {error}") from None
    except KeyboardInterrupt:
        raise SystemExit(f"foretell: interrupted; {args.file} was not changed") from None

    result = stream.result
    print(edit_stats(result), file=sys.stderr)
    if args.write:
        if result.changed:
            try:
                write_atomically(path, result.text, original)
            except (FileChangedError, OSError, UnicodeEncodeError) as error:
                raise SystemExit(f"foretell: {error}") from None
            print(f"foretell edit: wrote {args.file}", file=sys.stderr)
    elif args.diff:
        sys.stdout.write(result.diff)
    elif color:
        print(legend() if any(origin for _, origin in spans) else
              "foretell edit: the server reported no token origins (not a foretell server?)",
              file=sys.stderr)
        sys.stdout.write(paint_within(spans, result.text))
    else:
        sys.stdout.write(result.text)
    sys.stdout.flush()
    return 0


def _first_model(client) -> str:
    models = client.models.list().data
    if not models or not models[0].id:
        raise SystemExit("foretell: the server lists no models; pass --model")
    return models[0].id
