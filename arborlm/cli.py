"""The `arborlm` command: `arborlm serve [--model PATH] [--host] [--port] [--api-key] ...`.

Every `ServerArgs` field is an option, generated from the dataclass fields and
their `help` metadata (`max_total_tokens` → `--max-total-tokens`; booleans get
`--x` / `--no-x`); options not given keep the dataclass defaults.
"""

from __future__ import annotations

import argparse
import sys
import typing
from dataclasses import MISSING, Field, fields
from typing import Any

from arborlm.errors import ArborError
from arborlm.runtime.config import ServerArgs

# Extra spellings: SGLang's `--model-path` is also `--model`.
ALIASES = {"model_path": ["--model"]}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arborlm", description="Structured-generation and agent serving.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="serve a model over HTTP (SGLang's native API and the OpenAI API)",
        description="Serve a model over HTTP; with no --model, SmolLM2-135M-Instruct. "
                    "Ready when GET /health answers 200; Ctrl-C or SIGTERM stops it.",
    )
    add_server_args(serve)
    return parser


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One option per `ServerArgs` field, grouped by concern."""
    for member in fields(ServerArgs):
        concern = member.default_factory
        group = parser.add_argument_group(member.name, (concern.__doc__ or "").strip().splitlines()[0])
        hints = typing.get_type_hints(concern)
        for f in fields(concern):
            _add_field(group, f, hints[f.name])


def _add_field(group: argparse._ArgumentGroup, f: Field, hint: Any) -> None:
    names = ["--" + f.name.replace("_", "-"), *ALIASES.get(f.name, [])]
    default = None if f.default is MISSING else f.default
    # default=None: an option not given is left out, so the dataclass default applies.
    help_text = f.metadata.get("help", "") + ("" if default is None else f" (default: {default})")
    types = [t for t in (typing.get_args(hint) or (hint,)) if t is not type(None)]
    if types == [bool]:
        group.add_argument(*names, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                           help=help_text)
        return
    group.add_argument(*names, dest=f.name, type=types[0], default=None, help=help_text)


def server_args_from(namespace: argparse.Namespace) -> ServerArgs:
    """The `ServerArgs` of the parsed options (defaults for those not given).

    Raises
    ------
    ValueError, TypeError: a value out of range (from the concern's `__post_init__`).
    """
    given = {name: getattr(namespace, name) for name in ServerArgs.field_names()
             if getattr(namespace, name, None) is not None}
    return ServerArgs.from_kwargs(**given)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `arborlm` console script and `python -m arborlm`; returns the exit status."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        server_args = server_args_from(namespace)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    if namespace.command == "serve":
        from arborlm.entrypoints.launch_server import launch_server

        try:
            launch_server(server_args)
        except KeyboardInterrupt:
            return 130
        except (ArborError, OSError, ValueError) as e:
            print(f"arborlm serve: error: {e}", file=sys.stderr)
            return 1
    return 0
