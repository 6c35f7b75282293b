"""`arborlm serve` options are generated from `ServerArgs`; no server is started here."""

from __future__ import annotations

import warnings

import pytest

from arborlm.cli import build_parser, main, server_args_from
from arborlm.runtime.config import ServerArgs


def parse(*argv: str) -> ServerArgs:
    return server_args_from(build_parser().parse_args(["serve", *argv]))


def test_every_server_args_field_is_an_option():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    dests = {action.dest for action in serve._actions}
    assert set(ServerArgs.field_names()) <= dests


def test_options_not_given_keep_the_defaults():
    assert parse() == ServerArgs()


@pytest.mark.parametrize("argv, field, value", [
    (["--model", "/m"], "model_path", "/m"),
    (["--model-path", "/m"], "model_path", "/m"),
    (["--port", "8080"], "port", 8080),
    (["--mem-fraction", "0.5"], "mem_fraction", 0.5),
    (["--disable-radix-cache"], "disable_radix_cache", True),
    (["--disable-jump-forward"], "disable_jump_forward", True),
    (["--no-disable-jump-forward"], "disable_jump_forward", False),
    (["--max-queued-requests", "3"], "max_queued_requests", 3),
    (["--api-key", "k"], "api_key", "k"),
    (["--schedule-policy", "fcfs"], "schedule_policy", "fcfs"),
])
def test_option_values(argv, field, value):
    assert parse(*argv).to_dict()[field] == value


@pytest.mark.parametrize("argv", [["--port", "99999"], ["--port", "x"], ["--dtype", "int3"], ["--log-level", "loud"]])
def test_bad_values_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as excinfo:
        main(["serve", *argv])
    assert excinfo.value.code == 2
    assert "error" in capsys.readouterr().err


def test_every_serve_option_has_help():
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    missing = [a.option_strings[0] for a in serve._actions if a.option_strings and not a.help]
    assert missing == []
    assert "model name" in next(a.help for a in serve._actions if "--served-model-name" in a.option_strings)


def test_openapi_operation_ids_are_unique():
    # GET and POST /flush_cache once shared one function and one operation id (FastAPI warned)
    from types import SimpleNamespace

    from arborlm.entrypoints.http_server import create_app

    app = create_app(SimpleNamespace(server_args=ServerArgs()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        schema = app.openapi()
    ids = [op["operationId"] for path in schema["paths"].values() for op in path.values()]
    assert len(ids) == len(set(ids)) and {"flush_cache_get", "flush_cache_post"} <= set(ids)


@pytest.mark.parametrize("command", [["arborlm.launch_server"], ["arborlm", "serve"]])
def test_sglangs_launch_module_spelling_runs_serve(command):
    """`python -m arborlm.launch_server ...` (SGLang's `python -m sglang.launch_server`) is
    `arborlm serve ...`: the same options, the same usage error naming a bad one (here
    before any model loads)."""
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", *command, *args], capture_output=True, text=True, timeout=120)

    out = run("--speculative-algorithm", "BOGUS")
    assert out.returncode == 2 and "speculative_algorithm='BOGUS'" in out.stderr, out.stderr
    helped = run("--help")
    assert helped.returncode == 0 and "--model-path" in helped.stdout and "--speculative-algorithm" in helped.stdout
