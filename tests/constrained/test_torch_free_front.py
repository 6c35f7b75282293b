"""The front's grammar types are torch-free (issue 16): `GrammarError` and `GrammarKey` live in
`constrained/keys.py`, which `base.py` re-exports, so the HTTP process imports no torch to
raise or keep them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from arborlm.constrained import base, keys

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["GrammarError", "GrammarKey", "ANY_JSON", "GRAMMAR_KINDS"])
def test_base_names_the_same_objects_as_keys(name):
    assert getattr(base, name) is getattr(keys, name)


@pytest.mark.parametrize("module", [
    "arborlm.constrained.keys",
    "arborlm.constrained.grammar_spec",
    "arborlm.constrained.json_schema",
    "arborlm.entrypoints.http_server",
])
def test_importing_the_front_loads_no_torch(module):
    code = f"import sys, {module}\nprint('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[-1] == "False", f"importing {module} imports torch"
