"""The Python examples in docs/ run as written (so the docs cannot drift from the code).

A block whose first line is ``# name.py`` is saved under that name (later
blocks may import it); a block with ``def test_`` runs under pytest; a block
whose first line starts with ``# in `` is a fragment of an earlier file and is
skipped. Every other block runs as a script.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ryusen import AsyncStep, Step

DOCS = Path(__file__).resolve().parents[2] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def examples(doc: Path) -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for index, block in enumerate(BLOCK.findall(doc.read_text()), start=1):
        first = block.splitlines()[0] if block.strip() else ""
        if first.startswith("# in "):
            continue
        named = re.fullmatch(r"# (\S+\.py)", first)
        default = f"test_example_{index:02d}.py" if "def test_" in block else f"example_{index:02d}.py"
        found.append((named.group(1) if named else default, block))
    return found


@pytest.mark.parametrize("doc", ["quickstart.md", "concepts.md", "testing.md"])
def test_doc_examples_run(doc: str, tmp_path: Path) -> None:
    blocks = examples(DOCS / doc)
    assert blocks, f"{doc} has no runnable examples"
    for name, source in blocks:
        (tmp_path / name).write_text(source)
    failures = []
    for name, _ in blocks:
        if name.startswith("test_"):
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
        else:
            command = [sys.executable, name]
        done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            failures.append(f"{doc} {name}:\n{(done.stdout + done.stderr)[-2000:]}")
    assert not failures, "\n\n".join(failures)


def test_concepts_states_step_run_as_the_sdk_defines_it() -> None:
    """The signature in "Runs and steps", the sentence naming ``step.run``'s own keyword arguments, and the
    table list every keyword argument of ``Step.run`` (issue 23: ``compensate_timeout`` was missing)."""
    text = (DOCS / "concepts.md").read_text()
    parameters = inspect.signature(Step.run).parameters.values()
    keywords = [p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == [
        p.name for p in inspect.signature(AsyncStep.run).parameters.values() if p.kind is p.KEYWORD_ONLY
    ]
    block = re.search(r"```text\n(step\.run\(.*?\))\n```", text, re.S)
    assert block is not None
    expected = "step.run(step_id, fn, *args, " + ", ".join(f"{k}=None" for k in keywords) + ", **kwargs)"
    assert " ".join(block.group(1).split()) == expected
    sentence = re.search(r"The keyword arguments (.*?) belong to `step\.run`", text, re.S)
    assert sentence is not None
    assert re.findall(r"`(\w+)`", sentence.group(1)) == keywords
    assert all(f"\n| `{k}` |" in text for k in keywords)
