"""Notebooks import the library's functions and never define one of the same name (house style)."""
import ast
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def defined_names(source):
    return {n.name for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


LIBRARY = set().union(*(defined_names(p.read_text()) for p in (ROOT / "manual_dp").rglob("*.py")))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_redefines_no_library_function(path):
    nb = nbformat.read(path, as_version=4)
    cells = [c.source for c in nb.cells if c.cell_type == "code"]
    clashes = set().union(set(), *(defined_names(s) for s in cells)) & LIBRARY
    assert not clashes, f"{path.name} redefines {sorted(clashes)}: import them from manual_dp"
    assert any("from manual_dp import" in s for s in cells)
    assert any("MANUAL_DP_SMOKE" in s for s in cells)


def test_the_check_sees_library_names():
    assert {"lenet", "fit", "AsyncDataParallel", "gpipe_schedule"} <= LIBRARY
