"""Import direction (docs/design.md, "Package layout"): the import-linter contracts of pyproject.toml
hold for ``tag``, and they do catch a layer importing upwards or a repository script folder."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("importlinter")

ROOT = Path(__file__).resolve().parents[1]


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` with ``root/pyproject.toml``'s contracts on ``root/tag`` (a fresh process:
    the import graph is built from the files, not from modules already imported here)."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True, no_logo=True))")
    env = dict(os.environ, PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def test_import_contracts_hold():
    r = lint_imports(ROOT)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kept, 0 broken" in r.stdout, r.stdout


@pytest.mark.parametrize("module, source, broken", [
    # the plan format must not reach the cost model (baselines built on it live in tag.cost)
    ("tag/plan/_probe.py", "from ..cost import model\n", "tag.plan is not allowed to import tag.cost"),
    # the searches are below the predictor (tag.gnn.features reads the action space)
    ("tag/search/_probe.py", "from ..gnn import predictor\n", "tag.search is not allowed to import tag.gnn"),
    # the installed package must not import a repository script folder
    ("tag/cli/_probe.py", "import evaluation.planner_bench\n", "tag is not allowed to import evaluation"),
])
def test_contracts_catch_a_violation(tmp_path, module, source, broken):
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    shutil.copytree(ROOT / "tag", tmp_path / "tag", ignore=shutil.ignore_patterns("__pycache__", "*.pt", "*.yaml"))
    (tmp_path / module).write_text(source)
    r = lint_imports(tmp_path)
    assert r.returncode != 0
    assert broken in r.stdout, r.stdout


SIM_ORDER = ("engine", "event_loop", "recorder", "holdings", "program", "flows", "units", "static")
"""The simulator's modules (tag/sim/engine.py's docstring), each importing only those after it."""


def _sim_imports(name: str) -> set[str]:
    """The tag.sim modules ``tag/sim/<name>.py`` imports at run time (``if TYPE_CHECKING:`` blocks
    left out: annotations only), function-level imports included."""
    import ast

    tree = ast.parse((ROOT / "tag" / "sim" / f"{name}.py").read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and getattr(node.test, "id", "") ==
            "TYPE_CHECKING" for b in node.body for n in ast.walk(b)}
    return {node.module for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module and id(node) not in skip}


def test_simulator_modules_import_one_way():
    for i, name in enumerate(SIM_ORDER):
        earlier = set(SIM_ORDER[:i + 1])
        assert not _sim_imports(name) & earlier, (name, _sim_imports(name) & earlier)
    assert {"event_loop", "flows", "program", "holdings", "recorder"} <= _sim_imports("engine")
