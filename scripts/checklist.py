"""Which checklist ids no test claims.

docs/design/checklist.md lists one behaviour a line (``- F2 ...``). A test claims an id with
``@pytest.mark.rfd("F2")``. This prints the ids no test under tests/ claims, and the ids tests mark
that the checklist does not list (a typo in a marker). It exits 0; with ``--strict`` it exits 1 when
an id is unclaimed or a marker names an unknown id.

    scripts/checklist              # unclaimed ids, by group
    scripts/checklist --strict     # the same, failing if there is one
    scripts/checklist --claims     # every id with the tests that claim it
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKLIST = Path("docs/design/checklist.md")
TESTS = Path("tests")
ITEM = re.compile(r"^- (?P<id>[A-Z]+[0-9]+) ", re.M)


@dataclass(frozen=True)
class Claim:
    id: str
    path: str
    line: int


def checklist_ids(root: Path = ROOT) -> list[str]:
    """The ids docs/design/checklist.md lists, in its order."""
    return [match.group("id") for match in ITEM.finditer((root / CHECKLIST).read_text())]


def _is_rfd_marker(node: ast.Call) -> bool:
    """``pytest.mark.rfd(...)`` or ``mark.rfd(...)``."""
    func = node.func
    if not (isinstance(func, ast.Attribute) and func.attr == "rfd"):
        return False
    owner = func.value
    return (isinstance(owner, ast.Attribute) and owner.attr == "mark") or (
        isinstance(owner, ast.Name) and owner.id == "mark"
    )


def claims(root: Path = ROOT) -> Iterator[Claim]:
    """Every id a test under tests/ marks with ``rfd``, where it marks it."""
    for path in sorted((root / TESTS).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _is_rfd_marker(node):
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        yield Claim(arg.value, str(path.relative_to(root)), arg.lineno)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="List the checklist ids that no test claims.")
    parser.add_argument("--strict", action="store_true", help="exit 1 if an id is unclaimed or a marker is unknown")
    parser.add_argument("--claims", action="store_true", help="print every id with the tests that claim it")
    args = parser.parse_args(argv)

    ids = checklist_ids()
    by_id: dict[str, list[Claim]] = {}
    for claim in claims():
        by_id.setdefault(claim.id, []).append(claim)

    unknown = sorted(set(by_id) - set(ids))
    for id_ in unknown:
        places = ", ".join(f"{c.path}:{c.line}" for c in by_id[id_])
        print(f"unknown id {id_} (not in {CHECKLIST}): {places}", file=sys.stderr)

    if args.claims:
        for id_ in ids:
            places = ", ".join(f"{c.path}:{c.line}" for c in by_id.get(id_, [])) or "-"
            print(f"{id_}: {places}")

    unclaimed = [id_ for id_ in ids if id_ not in by_id]
    print(f"{len(ids) - len(unclaimed)} of {len(ids)} checklist ids are claimed by a test.")
    if unclaimed:
        print("Unclaimed: " + " ".join(unclaimed))
    return 1 if args.strict and (unclaimed or unknown) else 0


if __name__ == "__main__":
    sys.exit(main())
