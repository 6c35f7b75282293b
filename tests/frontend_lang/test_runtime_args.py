"""`sgl.Runtime` / `sgl.Engine` as SGLang programs start them: a script without the
``if __name__ == "__main__":`` guard gets a clear error, and SGLang's usual keywords are handled."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import arborlm as sgl
from arborlm.entrypoints.sglang_kwargs import sglang_server_kwargs
from arborlm.frontend_lang.runtime import MAIN_GUARD_HINT
from arborlm.runtime.config import ServerArgs

NO_GUARD = textwrap.dedent("""
    import arborlm as sgl
    try:
        sgl.Runtime(model_path="/nonexistent/model", launch_timeout=60)
    except BaseException as e:  # as SGLang's test scripts do; the child must not go on regardless
        print("PARENT", type(e).__name__, e, flush=True)
    print("TOP LEVEL DONE", flush=True)
""")


def test_runtime_at_a_scripts_top_level_says_to_add_the_main_guard(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.stdout.splitlines() == [f"PARENT ArborError {MAIN_GUARD_HINT}", "TOP LEVEL DONE"], out
    assert 'if __name__ == "__main__":' in MAIN_GUARD_HINT
    assert "bootstrapping phase" not in out.stdout + out.stderr  # multiprocessing's own puzzle is gone


class _Launched(Exception):
    """Raised by the stand-in scheduler launch: the server arguments got that far."""


@pytest.fixture
def launched_args(monkeypatch):
    """`Engine(...)`'s `ServerArgs` as it would launch the scheduler (nothing is loaded)."""
    import arborlm.entrypoints.engine as engine_module

    seen = []

    def launch(server_args):
        seen.append(server_args)
        raise _Launched

    monkeypatch.setattr(engine_module, "launch_scheduler", launch)
    return seen


def test_engine_takes_sglangs_usual_keywords(launched_args):
    with pytest.raises(_Launched):
        sgl.Engine(tp_size=1, mem_fraction_static=0.25, trust_remote_code=True)
    [args] = launched_args
    assert args.cache.mem_fraction == 0.25
    with pytest.raises(_Launched):
        sgl.Engine(model_path=None, tp=1, trust_remote_code=False)
    assert launched_args[1].cache.mem_fraction == ServerArgs().cache.mem_fraction


@pytest.mark.parametrize("kwargs, error, words", [
    ({"tp_size": 0}, ValueError, "tp_size=0"),
    ({"tp_size": "1"}, TypeError, "tp_size='1' has the wrong type"),
    ({"tp": 2, "tp_size": 1}, TypeError, "give one of them"),
    ({"trust_remote_code": "yes"}, TypeError, "trust_remote_code must be a bool"),
    ({"mem_fraction_static": 0.5, "mem_fraction": 0.2}, TypeError, "give one of them"),
    ({"mem_fraction_static": 1.5}, ValueError, "mem_fraction"),
])
def test_engine_and_runtime_refuse_what_arborlm_cannot_do_before_starting(launched_args, kwargs, error, words):
    with pytest.raises(error, match=words):
        sgl.Engine(**kwargs)
    with pytest.raises(error, match=words):
        sgl.Runtime(**kwargs)  # refused before any child process starts
    assert launched_args == []


def test_sglang_server_kwargs_leaves_other_keywords_alone():
    given = {"model_path": "m", "dtype": "float32", "tp": 1}
    assert sglang_server_kwargs(given) == {"model_path": "m", "dtype": "float32", "tp_size": 1} and "tp" in given
