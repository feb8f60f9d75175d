"""The README's promises: CI runs its test command, and its file list covers the package."""
import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command():
    ci_commands = [l.strip() for l in (ROOT / ".ci" / "run").read_text().splitlines()
                   if l.strip() and not l.startswith("#") and not l.startswith(("set ", "cd "))]
    assert ci_commands == ["bash setup.sh --test && .venv/bin/python -m pytest"]
    assert ci_commands[0] in README


def test_readme_gives_the_main_training_command():
    assert "bash setup.sh && .venv/bin/python -m manual_dp.train" in README


def test_every_module_is_listed_in_the_readme():
    listed = set(re.findall(r"`(manual_dp/[\w/]+\.py)`", README))
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "manual_dp").rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert modules <= listed, f"missing from README: {sorted(modules - listed)}"


def test_every_notebook_is_listed_in_the_readme():
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        assert nb.name in README, nb.name
