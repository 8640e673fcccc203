"""The Python examples in README.md and docs/ run as written (so the docs cannot drift from the code).

Every ```python block runs. A block whose first line is ``# name.py`` is saved under that name (later
blocks of the same document may import it); a block with ``def test_`` runs under pytest; every other
block runs as a script. A block that cannot run on its own (a fragment of an earlier file) says so
right before its fence, in a comment a reader of the rendered page does not see::

    <!-- docs-test: not run (a fragment of checkout.py) -->

Nothing else is skipped: a block that is neither run nor marked fails the test, and so does Python
code in a block labelled otherwise (it would never run).
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ryusen import AsyncStep, Step

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = sorted(
    [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")],
    key=lambda p: str(p.relative_to(ROOT)),
)
FENCE = re.compile(r"^```(\S*)\n(.*?)^```$", re.S | re.M)
DOCS = ROOT / "docs"
NOT_RUN = re.compile(r"<!-- docs-test: not run \((?P<reason>[^)]+)\) -->\s*\Z")


@dataclass(frozen=True)
class Block:
    line: int
    language: str
    source: str
    not_run: str | None
    """Why the block is not run, as its marker says; None for a block that runs."""


def blocks(doc: Path) -> list[Block]:
    text = doc.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()]
        marker = NOT_RUN.search(before)
        found.append(
            Block(
                line=before.count("\n") + 1,
                language=match.group(1),
                source=match.group(2),
                not_run=marker.group("reason") if marker else None,
            )
        )
    return found


def looks_like_python(source: str) -> bool:
    """Code that parses as Python and imports or defines something: not a shell line or a header."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return False
    return any(isinstance(node, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef) for node in tree.body)


def runnable(doc: Path) -> list[tuple[str, Block]]:
    """The blocks of ``doc`` to run, each with the file name it runs as."""
    found = []
    for index, block in enumerate((b for b in blocks(doc) if b.language == "python"), start=1):
        if block.not_run is not None:
            continue
        first = block.source.splitlines()[0] if block.source.strip() else ""
        named = re.fullmatch(r"# (\S+\.py)", first)
        default = f"test_example_{index:02d}.py" if "def test_" in block.source else f"example_{index:02d}.py"
        found.append((named.group(1) if named else default, block))
    return found


def test_every_python_block_is_run_or_marked() -> None:
    problems = []
    for doc in DOCUMENTS:
        name = doc.relative_to(ROOT)
        for block in blocks(doc):
            if block.language == "python":
                if block.not_run is None and block.source.splitlines()[0].startswith("# in "):
                    problems.append(
                        f"{name}:{block.line}: a fragment, but not marked <!-- docs-test: not run (...) -->"
                    )
            elif block.not_run is not None:
                problems.append(f"{name}:{block.line}: marked not run, but it is a {block.language or 'plain'} block")
            elif looks_like_python(block.source):
                problems.append(f"{name}:{block.line}: Python in a {block.language or 'plain'} block: label it python")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("doc", [str(d.relative_to(ROOT)) for d in DOCUMENTS])
def test_doc_examples_run(doc: str, tmp_path: Path) -> None:
    found = runnable(ROOT / doc)
    if not found:
        assert not [b for b in blocks(ROOT / doc) if b.language == "python" and b.not_run is None]
        return
    for name, block in found:
        (tmp_path / name).write_text(block.source)
    env = {
        **os.environ,
        # the examples import the SDK, the server and the CDK constructs as a user's checkout would
        "PYTHONPATH": os.pathsep.join(
            [str(ROOT / "sdk"), str(ROOT / "handlers"), str(ROOT / "infra"), os.environ.get("PYTHONPATH", "")]
        ),
        # a CDK example synthesizes without bundling its assets (as tests/infra does): no pip install per run
        "CDK_CONTEXT_JSON": json.dumps({"aws:cdk:bundling-stacks": []}),
        "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "1",
        "JSII_SILENCE_WARNING_DEPRECATED_NODE_VERSION": "1",
    }
    failures = []
    for name, block in found:
        if name.startswith("test_"):
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", name]
        else:
            command = [sys.executable, name]
        done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False)
        if done.returncode != 0:
            failures.append(f"{doc}:{block.line} ({name}):\n{(done.stdout + done.stderr)[-2000:]}")
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
    defaults = {p.name: p.default for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    expected = "step.run(step_id, fn, *args, " + ", ".join(f"{k}={defaults[k]!r}" for k in keywords) + ", **kwargs)"
    assert " ".join(block.group(1).split()) == expected
    sentence = re.search(r"The keyword arguments (.*?) belong to `step\.run`", text, re.S)
    assert sentence is not None
    assert re.findall(r"`(\w+)`", sentence.group(1)) == keywords
    assert all(f"\n| `{k}` |" in text for k in keywords)
