"""Imports only go down (DESIGN.md, issue 15): every module under arborlm/ is parsed, not
imported, and each import is checked against rules stated by package prefix, so modules
added or moved later are held to them too. A subprocess then checks that the front
process (HTTP server, tokenizer manager, launcher) loads none of the scheduler side's
torch-importing modules.

Layers, bottom to top: ground-level modules (errors, envs, sampling_params, version,
chat_template) → kernels/, radix_cache/, constrained/ → runtime/ → entrypoints/ →
frontend_lang/ → the package root `arborlm/__init__.py` (the public API).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE_DIR = Path(__file__).resolve().parents[1] / "arborlm"
ROOT = "arborlm"
GROUND = frozenset(f"{ROOT}.{name}" for name in ("errors", "envs", "sampling_params", "version", "chat_template"))

# Modules the front process (HTTP server, Engine front) is made of.
FRONT_MODULES = (
    "arborlm.entrypoints.http_server",
    "arborlm.entrypoints.engine",
    "arborlm.runtime.tokenizer_manager",
    "arborlm.runtime.launcher",
)
# The scheduler side, by prefix (a package covers its submodules). The front may read a
# torch-free module of it (`runtime/layers/attention/names.py`, the backend names the
# config validates) but load none that imports torch or triton. `runtime.scheduler_process`
# is not on this side: the launcher needs its entry point, which imports the scheduler
# only inside the child process.
SCHEDULER_SIDE = (
    "arborlm.runtime.scheduler",
    "arborlm.runtime.scheduler_output",
    "arborlm.runtime.schedule_batch",
    "arborlm.runtime.schedule_policy",
    "arborlm.runtime.retract",
    "arborlm.runtime.forward_batch_info",
    "arborlm.runtime.model_runner",
    "arborlm.runtime.model_worker",
    "arborlm.runtime.model_loader",
    "arborlm.runtime.kv_manager",
    "arborlm.runtime.sampling",
    "arborlm.runtime.models",
    "arborlm.runtime.layers",
    "arborlm.kernels",
    "arborlm.radix_cache",
)
HEAVY = ("torch", "triton")


def under(module: str, prefixes: tuple[str, ...] | frozenset[str]) -> bool:
    """True when `module` is one of `prefixes` or inside one of them (`a.b` is under `a`, `a.bc` is not)."""
    return any(module == p or module.startswith(p + ".") for p in prefixes)


@dataclass(frozen=True)
class Import:
    """One imported name: the module it comes from (`arborlm.x` for `from arborlm import x`)."""

    target: str
    line: int
    from_root: bool  # `import arborlm` or `from arborlm import ...`: the package root's API


@dataclass(frozen=True)
class Rule:
    """Modules under `sources` may not import anything under `forbidden`."""

    name: str
    sources: tuple[str, ...]
    forbidden: tuple[str, ...]

    def applies_to(self, module: str) -> bool:
        return under(module, self.sources)

    def violated_by(self, module: str, imp: Import) -> bool:
        return under(imp.target, self.forbidden)


class RootRule:
    """Only the package root itself uses the root's public API (`from arborlm import X`);
    everything else imports the module that defines X, so nothing depends on `__init__`'s order."""

    name = "nothing but arborlm/__init__.py imports the package root `arborlm`"

    def applies_to(self, module: str) -> bool:
        return module != ROOT

    def violated_by(self, module: str, imp: Import) -> bool:
        return imp.from_root


class GroundRule:
    """Ground-level modules are what every layer may import, so they import only each other."""

    name = "ground-level modules (errors, envs, sampling_params, version, chat_template) import only each other"

    def applies_to(self, module: str) -> bool:
        return module in GROUND

    def violated_by(self, module: str, imp: Import) -> bool:
        return under(imp.target, (ROOT,)) and not under(imp.target, GROUND)


RULES = (
    Rule("kernels/, radix_cache/ and constrained/ import nothing from runtime/, frontend_lang/ or entrypoints/",
         sources=("arborlm.kernels", "arborlm.radix_cache", "arborlm.constrained"),
         forbidden=("arborlm.runtime", "arborlm.frontend_lang", "arborlm.entrypoints")),
    Rule("runtime/ imports nothing from entrypoints/ or frontend_lang/",
         sources=("arborlm.runtime",), forbidden=("arborlm.entrypoints", "arborlm.frontend_lang")),
    Rule("entrypoints/ imports nothing from frontend_lang/",
         sources=("arborlm.entrypoints",), forbidden=("arborlm.frontend_lang",)),
    RootRule(),
    GroundRule(),
)


# ---- reading imports -----------------------------------------------------------


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    """`arborlm/runtime/scheduler.py` → `arborlm.runtime.scheduler`; a package's `__init__.py` → the package."""
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, module: str, is_package: bool) -> list[Import]:
    """Every import in `source`, at any depth (a lazy import inside a function counts too).

    Relative imports are resolved against `module` (`is_package`: it is an `__init__.py`).
    """
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(a.name, node.lineno, from_root=a.name == ROOT) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module, node.level, package)
            found += [Import(f"{base}.{a.name}" if a.name != "*" else base, node.lineno, from_root=base == ROOT)
                      for a in node.names]
    return found


def _resolve(name: str | None, level: int, package: str) -> str:
    """The absolute module of `from <level dots><name> import ...` inside `package`."""
    if level == 0:
        return name or ""
    parts = package.split(".")
    base = parts[: len(parts) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def violations(rule, package_dir: Path = PACKAGE_DIR) -> list[str]:
    """'file:line: imports X' for every import under `package_dir` that breaks `rule`."""
    out = []
    for path in sorted(package_dir.rglob("*.py")):
        module = module_name(path, package_dir)
        if not rule.applies_to(module):
            continue
        for imp in imports_of(path.read_text(), module, path.name == "__init__.py"):
            if rule.violated_by(module, imp):
                out.append(f"{path.relative_to(package_dir.parent)}:{imp.line}: imports {imp.target}")
    return out


# ---- the rules ------------------------------------------------------------------


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_imports_only_go_down(rule):
    found = violations(rule)
    assert not found, f"rule broken: {rule.name}\n" + "\n".join(found)


@pytest.mark.parametrize("rule", [r for r in RULES if isinstance(r, Rule)], ids=lambda r: r.name)
def test_every_rule_covers_modules(rule):
    """A rule whose packages were all renamed away would pass without checking anything."""
    modules = [module_name(p) for p in PACKAGE_DIR.rglob("*.py")]
    assert all(any(under(m, (source,)) for m in modules) for source in rule.sources), rule.sources


@pytest.mark.parametrize("module, is_package, source, broken", [
    ("arborlm.kernels.triton_decode", False, "from arborlm.runtime.io_struct import X", [RULES[0].name]),
    ("arborlm.constrained.json_schema.prepare", False, "from ...runtime import config", [RULES[0].name]),
    ("arborlm.constrained.json_schema", True, "from ..base import GrammarError", []),
    ("arborlm.radix_cache.radix_cache", False, "def f():\n    import arborlm.entrypoints.engine", [RULES[0].name]),
    ("arborlm.runtime.scheduler", False, "from arborlm.entrypoints import engine", [RULES[1].name]),
    ("arborlm.runtime.scheduler", False, "from arborlm.constrained.base import GrammarError", []),
    ("arborlm.entrypoints.native_api", False, "import arborlm.frontend_lang.api", [RULES[2].name]),
    ("arborlm.entrypoints.native_api", False, "from arborlm import SamplingParams", [RULES[3].name]),
    ("arborlm.frontend_lang.api", False, "import arborlm as sgl", [RULES[3].name]),
    ("arborlm.frontend_lang.api", False, "from .. import Engine", [RULES[3].name]),
    ("arborlm", True, "from arborlm.entrypoints.engine import Engine", []),
    ("arborlm.sampling_params", False, "from arborlm.errors import InvalidRequestError", []),
    ("arborlm.sampling_params", False, "from .errors import InvalidRequestError", []),
    ("arborlm.chat_template", False, "from arborlm.runtime.config import ServerArgs", [RULES[4].name]),
    ("arborlm.errors", False, "import json", []),
])
def test_the_checker_reads_imports_as_python_does(module, is_package, source, broken):
    imps = imports_of(source, module, is_package)
    assert [r.name for r in RULES if r.applies_to(module) and any(r.violated_by(module, i) for i in imps)] == broken


# ---- the front process --------------------------------------------------------


def heavy_imports_at_load(source: str) -> list[int]:
    """Lines that import torch or triton when the module loads: module level, including under
    `if`/`try`, but not inside functions (a lazy import) nor under `if TYPE_CHECKING:`."""
    lines = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            if isinstance(node, ast.Import) and any(under(a.name, HEAVY) for a in node.names):
                lines.append(node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and under(node.module or "", HEAVY):
                lines.append(node.lineno)
            for field in ("body", "orelse", "finalbody", "handlers"):
                visit([n for n in getattr(node, field, []) if isinstance(n, (ast.stmt, ast.excepthandler))])

    visit(ast.parse(source).body)
    return lines


@pytest.mark.parametrize("source, lines", [
    ("import torch", [1]),
    ("import os\nfrom torch.nn import functional as F", [2]),
    ("try:\n    import triton\nexcept ImportError:\n    triton = None", [2]),
    ("def f():\n    import torch", []),
    ("class A:\n    import torch", [2]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch", []),
    ("import torchvision_like", []),
])
def test_heavy_imports_at_load(source, lines):
    assert heavy_imports_at_load(source) == lines


def test_the_front_process_loads_no_torch_importing_scheduler_module():
    code = (f"import json, sys\nimport {', '.join(FRONT_MODULES)}\n"
            "print(json.dumps({m: getattr(mod, '__file__', None) for m, mod in sys.modules.items()}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=PACKAGE_DIR.parent)
    assert run.returncode == 0, run.stderr
    loaded = {m: f for m, f in json.loads(run.stdout.splitlines()[-1]).items() if under(m, SCHEDULER_SIDE)}
    heavy = [f"{Path(file).relative_to(PACKAGE_DIR.parent)}:{line}"
             for file in sorted(f for f in loaded.values() if f is not None)
             for line in heavy_imports_at_load(Path(file).read_text())]
    assert not heavy, (f"the front process ({', '.join(FRONT_MODULES)}) loads scheduler-side modules "
                       f"that import torch or triton: {heavy}; scheduler-side modules it loads: {sorted(loaded)}")
