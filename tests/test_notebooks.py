"""Every notebook runs top to bottom in smoke mode (MANUAL_DP_SMOKE=1), and is committed with the
outputs of a full run (regenerate: the command in notebooks/README.md)."""
import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes_in_smoke_mode(path, monkeypatch):
    monkeypatch.setenv("MANUAL_DP_SMOKE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors


def test_there_are_notebooks():
    assert any(p.name.startswith("01_") for p in NOTEBOOKS)


def first_output(nb):
    """The text the first code cell printed when the notebook was last run."""
    cell = next(c for c in nb.cells if c.cell_type == "code")
    return "".join(o.get("text", "") for o in cell.get("outputs", []))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_committed_with_the_outputs_of_a_full_run(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"{path.name}: not every cell was run"
    assert sum(bool(c.get("outputs")) for c in code) >= len(code) // 2, f"{path.name}: few outputs"
    assert not any(o.get("output_type") == "error" for c in code for o in c.get("outputs", []))
    said = first_output(nb)
    assert "full" in said and "smoke" not in said, f"{path.name} was last run with {said!r}"


STAMP = re.compile(r"(?P<cpu>[^\n]+), (?P<cores>\d+) cores \([^)]*\); load (?P<load>[\d.]+); commit (?P<commit>[0-9a-f]{7,40})(?P<dirty>\+changes)?")


def stamp(nb):
    """(cpu, cores, load, commit, dirty) printed by one of a notebook's first three code cells."""
    code = [c for c in nb.cells if c.cell_type == "code"][:3]
    text = "".join(o.get("text", "") for c in code for o in c.get("outputs", []))
    m = STAMP.search(text)
    return m and (m["cpu"], int(m["cores"]), float(m["load"]), m["commit"], bool(m["dirty"]))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_names_its_machine_load_and_commit_first(path):
    assert stamp(nbformat.read(path, as_version=4)), f"{path.name}: no 'CPU, N cores (...); load L; commit C' line"


def test_every_notebook_comes_from_one_clean_commit():
    stamps = {p.name: stamp(nbformat.read(p, as_version=4)) for p in NOTEBOOKS}
    commits = {s[3] for s in stamps.values() if s}
    assert len(commits) == 1, f"notebooks from several commits: {stamps}"
    assert not any(s[4] for s in stamps.values() if s), "a notebook ran on a tree with uncommitted changes"
