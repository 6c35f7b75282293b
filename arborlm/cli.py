"""The `arborlm` command: `arborlm serve [--model PATH] [--host] [--port] [--api-key] ...`.

Every `ServerArgs` field is an option, generated from the dataclass fields and
their `help` metadata (`max_total_tokens` → `--max-total-tokens`; booleans get
`--x` / `--no-x`; tuples take one or more values); options not given keep the
dataclass defaults.

The API keys also come from a file (`--api-key-file`, `--admin-api-key-file`)
or the environment (`ARBORLM_API_KEY`, `ARBORLM_ADMIN_API_KEY`, see `envs`),
because a key on the command line is visible to every user through `ps`. The
option wins over the file, which wins over the variable; the option and the
file together are an error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import typing
from dataclasses import MISSING, Field, fields
from typing import Any

from arborlm.envs import ENVS, Envs
from arborlm.errors import ArborError
from arborlm.runtime.config import ServerArgs, ignored_options

logger = logging.getLogger("arborlm.server")

# Extra spellings: SGLang's `--model-path` is also `--model`.
ALIASES = {"model_path": ["--model"]}
# Secret fields → their environment fallback (an `Envs` attribute of the same name); each
# also gets a `--<field>-file` option.
SECRET_FIELDS = ("api_key", "admin_api_key")


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
            if f.name in SECRET_FIELDS:
                _add_secret_file(group, f.name)


def _add_secret_file(group: argparse._ArgumentGroup, name: str) -> None:
    option = name.replace("_", "-")
    group.add_argument(f"--{option}-file", dest=f"{name}_file", default=None, metavar="PATH",
                       help=f"read --{option} from this file, a trailing newline dropped (ps shows the path, "
                            f"not the key); without either option, ARBORLM_{name.upper()} is read")


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
    if typing.get_origin(types[0]) is tuple:
        group.add_argument(*names, dest=f.name, nargs="+", type=typing.get_args(types[0])[0], default=None,
                           help=help_text)
        return
    group.add_argument(*names, dest=f.name, type=types[0], default=None, help=help_text)


def server_args_from(namespace: argparse.Namespace, envs: Envs = ENVS) -> ServerArgs:
    """The `ServerArgs` of the parsed options (defaults for those not given); each API
    key from its option, else its file, else its variable in `envs`.

    Raises
    ------
    ValueError, TypeError: a value out of range (from the concern's `__post_init__`),
        a key given both as an option and as a file, or a key file that cannot be read.
    """
    given = {name: getattr(namespace, name) for name in ServerArgs.field_names()
             if getattr(namespace, name, None) is not None}
    if isinstance(given.get("allowed_hosts"), list):
        given["allowed_hosts"] = tuple(given["allowed_hosts"])
    for name in SECRET_FIELDS:
        key = _secret(name, given.get(name), getattr(namespace, f"{name}_file", None), getattr(envs, name))
        if key is not None:
            given[name] = key
    return ServerArgs.from_kwargs(**given)


def _secret(name: str, option: str | None, path: str | None, env_value: str | None) -> str | None:
    """The key of the `--<name>` option, else of its file, else of the environment.

    Raises
    ------
    ValueError: both the option and the file given; the file cannot be read.
    """
    flag = "--" + name.replace("_", "-")
    if option is not None and path is not None:
        raise ValueError(f"give {flag} or {flag}-file, not both")
    if option is not None:
        return option
    if path is None:
        return env_value
    try:
        with open(path, encoding="utf-8") as f:
            content = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{name}_file={path!r} is invalid: cannot read it ({e})") from None
    # Only the line end goes: other surrounding spaces are refused by the config, not silently dropped.
    return content.removesuffix("\n").removesuffix("\r")


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `arborlm` console script and `python -m arborlm`; returns the exit status."""
    parser = build_parser()
    namespace = parser.parse_args(argv)
    try:
        server_args = server_args_from(namespace)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    if namespace.command == "serve":
        from arborlm.entrypoints.data_parallel import launch_data_parallel
        from arborlm.entrypoints.launch_server import configure_logging, launch_server

        configure_logging(server_args.server.log_level)
        for message in ignored_options(server_args):
            logger.warning(message)
        try:
            if server_args.parallel.dp_size > 1:
                launch_data_parallel(server_args)
            else:
                launch_server(server_args)
        except KeyboardInterrupt:
            return 130
        except (ArborError, OSError, ValueError) as e:
            print(f"arborlm serve: error: {e}", file=sys.stderr)
            return 1
    return 0
