"""The pin set installs on a fresh machine: every line is ``name==version``.

A ``name @ file:///...`` line (what ``pip freeze`` writes for a package installed from a local
wheel) points at a file that exists only on the machine that wrote the lock; a fresh clone's
``make setup`` then fails before anything runs.
"""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PIN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9.+!_-]+$")


def test_constraints_are_plain_version_pins():
    bad = []
    for n, line in enumerate((ROOT / "constraints" / "cpu.txt").read_text().splitlines(), start=1):
        line = line.strip()
        if line and not line.startswith("#") and not PIN.match(line):
            bad.append(f"constraints/cpu.txt:{n}: {line}")
    assert not bad, "not a name==version pin:\n" + "\n".join(bad)


def test_project_dependencies_are_pinned():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        deps.extend(extra)
    unpinned = [d for d in deps if "==" not in d or "@" in d]
    assert not unpinned, f"unpinned dependencies: {unpinned}"
