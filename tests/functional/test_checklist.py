"""The checklist (docs/design/checklist.md) and the tests that claim its ids agree.

Every id a test marks with ``@pytest.mark.rfd`` must be on the checklist, so a typo in a marker fails
here. Which ids no test claims yet is what ``scripts/checklist`` prints; that is a report, not a
failure.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def load_checklist_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("checklist_script", ROOT / "scripts" / "checklist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


checklist = load_checklist_script()


def test_the_checklist_lists_each_id_once_in_every_group() -> None:
    ids = checklist.checklist_ids()
    assert len(ids) == len(set(ids)), sorted({i for i in ids if ids.count(i) > 1})
    groups = {i.rstrip("0123456789") for i in ids}
    assert groups == {"F", "D", "S", "U", "C", "R", "O", "P", "W", "X", "H", "K"}
    for group in groups:
        numbers = sorted(int(i[len(group) :]) for i in ids if i.rstrip("0123456789") == group)
        assert numbers == list(range(1, len(numbers) + 1)), (group, numbers)


def test_every_id_a_test_marks_is_on_the_checklist() -> None:
    ids = set(checklist.checklist_ids())
    claims = list(checklist.claims())
    assert claims, "no test marks an id: the scan found nothing"
    unknown = [f"{c.id} at {c.path}:{c.line}" for c in claims if c.id not in ids]
    assert not unknown, f"markers name ids that docs/design/checklist.md does not list: {unknown}"


def test_a_marker_with_a_typo_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "docs" / "design" / "checklist.md").write_text("# Checklist\n\n- F1 A run starts.\n- F2 A step runs.\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_x.py").write_text(
        "import pytest\n\n\n@pytest.mark.rfd('F1', 'F22')\ndef test_a() -> None:\n    pass\n"
    )
    assert checklist.checklist_ids(tmp_path) == ["F1", "F2"]
    assert [(c.id, c.path, c.line) for c in checklist.claims(tmp_path)] == [
        ("F1", "tests/test_x.py", 4),
        ("F22", "tests/test_x.py", 4),
    ]


@pytest.mark.parametrize("command", [["bash", "scripts/checklist"], [sys.executable, "scripts/checklist.py"]])
def test_the_script_prints_the_unclaimed_ids(command: list[str]) -> None:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "checklist ids are claimed by a test." in done.stdout
    assert done.stderr == ""
    claimed = {c.id for c in checklist.claims()}
    unclaimed = [i for i in checklist.checklist_ids() if i not in claimed]
    if unclaimed:
        assert "Unclaimed: " + " ".join(unclaimed) in done.stdout
    strict = subprocess.run([*command, "--strict"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False)
    assert strict.returncode == (1 if unclaimed else 0)
