"""The ``foretell`` command line.

    foretell generate --prompt-file P [--prediction-file F] [--prompt-lookup] [--max-tokens N]
    foretell serve [--model M] [--host H] [--port P] [--config FILE] [--api-key KEY] [--allowed-hosts HOSTS]
    foretell edit FILE --instruction TEXT [--model M] [--base-url URL] [--write | --diff]

``generate`` prints the completion to stdout as it is verified and the statistics to stderr;
``serve`` runs the OpenAI-compatible proxy; ``edit`` edits a file through the proxy or any
OpenAI-compatible server, the file as the prediction (only ``foretell.sdk`` is imported: no torch).
"""

from __future__ import annotations

import argparse

from foretell import __version__
from foretell.cli import edit, generate, serve
from foretell.cli.arguments import resolve_env
from foretell.cli.edit import FileChangedError, edit_stats, write_atomically

__all__ = ["FileChangedError", "build_parser", "edit_stats", "main", "resolve_env", "write_atomically"]
COMMANDS = {"generate": generate, "serve": serve, "edit": edit}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="foretell",
        description="Predicted outputs for everyone: exact speculative decoding with predictions.",
    )
    parser.add_argument("--version", action="version", version=f"foretell {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_env(args)
    return COMMANDS[args.command].run(args)
