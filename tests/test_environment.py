"""The two Quickstart commands, .ci/run and the two dependency lists stay in step."""

import re
import tomllib
from pathlib import Path

import yaml
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def quickstart_commands():
    """The command lines of every fenced block in the README's Quickstart section (up to the next heading)."""
    readme = (ROOT / "README.md").read_text()
    m = re.search(r"^#+ Quickstart\s*\n(.*?)(?=^#)", readme, re.S | re.M)
    assert m, "README needs a 'Quickstart' section"
    blocks = re.findall(r"```[a-z]*\n(.*?)```", m.group(1), re.S)
    assert blocks, "the Quickstart section needs fenced code blocks with its commands"
    return [line for block in blocks for line in block.splitlines() if line.strip()]


def test_quickstart_has_exactly_two_commands():
    cmds = quickstart_commands()
    assert len(cmds) == 2, cmds
    assert "lab" in cmds[0] and "test" in cmds[1]


def test_ci_runs_the_readme_test_command_verbatim():
    test_cmd = quickstart_commands()[1]
    ci = [ln.strip() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    assert test_cmd in ci


def _normalize(req: str) -> tuple[str, str, str]:
    r = Requirement(req)
    return (r.name.lower().replace("_", "-"), str(r.specifier), str(r.marker or ""))


def test_environment_yml_and_pyproject_agree():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    py = {_normalize(d) for d in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())["dependencies"]
    conda, pip = [], []
    for d in env:
        (pip.extend(d["pip"]) if isinstance(d, dict) else conda.append(d))
    listed = {_normalize(d) for d in conda + pip if not d.startswith(("python", "pip"))}
    assert listed == py, f"only in pyproject: {py - listed}; only in environment.yml: {listed - py}"


def test_layout_matches_the_course_design():
    for name in ("notebooks", "labs", "solutions", "kvlib", "tests", "environment.yml", "README.md",
                 "pyproject.toml", ".ci/run"):
        assert (ROOT / name).exists(), name
