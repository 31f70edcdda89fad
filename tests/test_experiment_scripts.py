"""The experiment scripts under docs/experiments stay runnable against the package: every name
they import from it exists, and each parses its options."""

from __future__ import annotations

import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

SCRIPTS = sorted((pathlib.Path(__file__).resolve().parents[1] / "docs" / "experiments").glob("*.py"))


def _package_imports(script: pathlib.Path) -> list[tuple[str, str | None]]:
    """(module, name) for every import from the package anywhere in the script (name None for a
    plain ``import jakiro.x``), including those inside functions."""
    found = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "jakiro":
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.split(".")[0] == "jakiro"]
    return found


def test_there_are_experiment_scripts():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_experiment_script_imports_exist(script):
    imports = _package_imports(script)
    assert imports, f"{script.name} imports nothing from the package"
    missing = []
    for module_name, name in imports:
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name):
            try:
                importlib.import_module(f"{module_name}.{name}")
            except ImportError:
                missing.append(f"{module_name}.{name}")
    assert not missing, f"{script.name} imports names the package no longer has: {missing}"


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_experiment_script_parses_its_options(script):
    run = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300,
                         cwd=script.parent)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.startswith("usage:")
