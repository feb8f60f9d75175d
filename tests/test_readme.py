"""The README's promises: CI runs its test command, and the README is a front door: it names every
package folder and few files, and each folder's docstring lists that folder's own modules."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
FOLDERS = sorted(p.parent for p in (ROOT / "manual_dp").rglob("__init__.py"))
MAX_LINES, MAX_FILES = 130, 20


def rel(path):
    return path.relative_to(ROOT).as_posix()


def listed(folder):
    """The names the folder's __init__.py docstring lists: the first word of each indented line
    (`    name.py  what it holds`, or `    sub/  ...` for a subfolder)."""
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()), clean=False) or ""
    return set(re.findall(r"^[ \t]+([\w./]+)", doc, re.M))


def test_ci_runs_the_readme_test_command():
    ci_commands = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
                   if l.strip() and not l.startswith("#") and not l.startswith(("set ", "cd "))]
    assert ci_commands == ["bash setup.sh --test && .venv/bin/python -m pytest"]
    assert ci_commands[0] in README


def test_readme_gives_the_main_training_command():
    assert "bash setup.sh && .venv/bin/python -m manual_dp.train" in README


@pytest.mark.parametrize("folder", FOLDERS, ids=rel)
def test_every_module_is_listed_in_its_folders_docstring(folder):
    names = listed(folder)
    modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
    missing = [p.name for p in modules if p.name not in names and p.stem not in names]
    missing += [f"{p.parent.name}/" for p in folder.glob("*/__init__.py") if f"{p.parent.name}/" not in names]
    assert not missing, f"{rel(folder)}/__init__.py's docstring does not list {sorted(missing)}"


def test_every_package_folder_is_named_in_the_readme():
    missing = [f"{rel(f)}/" for f in FOLDERS if f"{rel(f)}/" not in README]
    assert not missing, f"missing from README: {missing}"


def test_the_readme_is_a_front_door():
    lines = len(README.splitlines())
    files = set(re.findall(r"manual_dp/[\w/]+\.py", README))
    assert lines <= MAX_LINES, f"README has {lines} lines (at most {MAX_LINES})"
    assert len(files) <= MAX_FILES, f"README names {len(files)} files (at most {MAX_FILES}): {sorted(files)}"


def test_every_notebook_is_listed_in_the_readme():
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert nb.name in README, nb.name
