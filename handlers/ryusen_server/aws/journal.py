"""A run's changes as small JSON deltas (the DynamoDB store's journal entries), and their application.

A decision changes a handful of things: a step or two, an attempt, a few run
fields. :func:`diff` finds them, comparing the state the decision started from
with the one it produced (field by field; identical objects, which the core's
copy-on-write shares between the two, are skipped without looking inside), and
:func:`apply` puts a delta onto the older state. So a delta's size depends on
what the decision changed, not on how long the run is.

A delta names fields by the models' own field names. The lists that grow with a
run (``RunState.steps``, ``RunState.unwind`` and ``StepState.attempts``) are
diffed element by element, by position: ``{"len": n, "set": {"i": change}}``,
where a change is ``{"new": element}`` or ``{"diff": delta of the element}``.
Every other changed field is its whole new value.

Pure: no I/O. ``apply(old, diff(old, new)) == new`` for any two states of one run
(the suite checks it on every save when ``CHECK_PURITY`` is on).
"""

from __future__ import annotations

from datetime import datetime
from functools import cache
from typing import Any

import pydantic_core
from pydantic import BaseModel, TypeAdapter

from ..core.model import Attempt, RunState, StepState, UnwindEntry

_LISTS: dict[tuple[type[BaseModel], str], type[BaseModel]] = {
    (RunState, "steps"): StepState,
    (RunState, "unwind"): UnwindEntry,
    (StepState, "attempts"): Attempt,
}
"""The fields diffed element by element, and their element model."""

Delta = dict[str, Any]

_TYPED: frozenset[type[BaseModel]] = frozenset((Attempt, UnwindEntry))
"""Elements compared with ``==`` first (fast: a step's attempts are all copied when the step is); their typed
fields are the same JSON when equal, and ``_same_untyped`` checks the untyped ones."""


def _same_untyped(was: BaseModel, item: BaseModel) -> bool:
    """An attempt's error data is untyped JSON (``1 == True`` in Python); stale submissions' outcomes are only
    ever appended, never replaced."""
    if isinstance(was, Attempt) and isinstance(item, Attempt) and was.error is not None and item.error is not None:
        if was.error.data is None and item.error.data is None:
            return True
        return not _differs(was.error.data, item.error.data)
    return True


def diff(old: RunState, new: RunState) -> Delta:
    """What changed from ``old`` to ``new`` (JSON-ready). When ``new`` is the core's working copy of
    ``old``, only the steps it replaced or added are looked at."""
    delta = _diff_model(RunState, old, new, new.replaced_steps(old), new.replaced_unwind(old))
    if "unwind" in delta:
        _plan_ranges(new, delta["unwind"])
    return delta


def apply(old: RunState, delta: Delta) -> RunState:
    """``old`` with ``delta`` applied: a new state sharing every unchanged step with ``old``."""
    if "unwind" in delta and "plan" in delta["unwind"]:
        steps = _apply_list(StepState, old.steps, delta["steps"]) if "steps" in delta else old.steps
        delta = {**delta, "unwind": _expand_plan(steps, delta["unwind"])}
    state = _apply_model(old, delta)
    assert isinstance(state, RunState)
    state.forget_hints()  # not a working copy of anything, and its unwind may have changed
    return state


def _plan_ranges(new: RunState, change: Delta) -> None:
    """New pending unwind entries, written as ranges of step positions: the plan that starts an unwind
    names every completed step, newest first, which for most runs is one descending range (so the write
    that starts compensating a 10,000-step run is as small as any other). A range ``[i, first, last]``
    stands for entries ``i, i + 1, ...`` naming the steps at positions ``first, first - 1, ..., last``."""
    ranges: list[list[int]] = []
    planned: list[str] = []
    for key in sorted(change["set"], key=int):
        i = int(key)
        if "new" not in change["set"][key] or new.unwind[i] != UnwindEntry(step_id=new.unwind[i].step_id):
            continue  # not a fresh pending entry
        position = new.step_index(new.unwind[i].step_id)
        if position is None:
            continue
        if ranges and ranges[-1][0] + ranges[-1][1] - ranges[-1][2] + 1 == i and ranges[-1][2] - 1 == position:
            ranges[-1][2] = position
        else:
            ranges.append([i, position, position])
        planned.append(key)
    for key in planned:
        del change["set"][key]
    if ranges:
        change["plan"] = ranges


def _expand_plan(steps: list[Any], change: Delta) -> Delta:
    expanded = dict(change["set"])
    for start, first, last in change["plan"]:
        for offset, position in enumerate(range(first, last - 1, -1)):
            expanded[str(start + offset)] = {"new": {"step_id": steps[position].id}}
    return {"len": change["len"], "set": expanded}


def dump(value: Any) -> Any:
    return pydantic_core.to_jsonable_python(value)


def _diff_model(
    cls: type[BaseModel],
    old: BaseModel,
    new: BaseModel,
    replaced: set[int] | None = None,
    unwind_replaced: set[int] | None = None,
) -> Delta:
    out: Delta = {}
    before, after = old.__dict__, new.__dict__
    for name in cls.model_fields:
        a, b = before[name], after[name]
        if a is b:
            continue
        element = _LISTS.get((cls, name))
        if element is not None:
            hint = replaced if name == "steps" else unwind_replaced if name == "unwind" else None
            change = _diff_list(element, a, b, hint)
            if change is not None:
                out[name] = change
        elif _differs(a, b):
            out[name] = dump(b)
    return out


def _differs(a: Any, b: Any) -> bool:
    """Not the same JSON (``1 == True == 1.0`` in Python, and dicts compare without their key order)."""
    if type(a) is not type(b) or a != b:
        return True
    if isinstance(a, dict | list | tuple | BaseModel | datetime | float):
        return pydantic_core.to_json(a) != pydantic_core.to_json(b)
    return False


def _diff_list(element: type[BaseModel], old: list[Any], new: list[Any], replaced: set[int] | None) -> Delta | None:
    changes: dict[str, Delta] = {}
    common = min(len(old), len(new))
    candidates = range(common) if replaced is None else sorted(i for i in replaced if i < common)
    for i in candidates:
        was, item = old[i], new[i]
        if was is item or (element in _TYPED and was == item and _same_untyped(was, item)):
            continue
        change = _diff_model(element, was, item)
        if change:
            changes[str(i)] = {"diff": change}
    for i in range(common, len(new)):
        changes[str(i)] = {"new": dump(new[i])}
    if not changes and len(old) == len(new):
        return None
    return {"len": len(new), "set": changes}


@cache
def _adapter(cls: type[BaseModel], name: str) -> TypeAdapter[Any]:
    annotation: Any = cls.model_fields[name].annotation
    return TypeAdapter(annotation)


def _apply_model(old: BaseModel, delta: Delta) -> BaseModel:
    cls = type(old)
    update: dict[str, Any] = {}
    for name, change in delta.items():
        if name not in cls.model_fields:
            raise ValueError(f"a journal entry names {cls.__name__}.{name}, which this version does not know")
        element = _LISTS.get((cls, name))
        if element is not None:
            update[name] = _apply_list(element, getattr(old, name), change)
        else:
            update[name] = _adapter(cls, name).validate_python(change)
    return old.model_copy(update=update)


def _apply_list(element: type[BaseModel], old: list[Any], change: Delta) -> list[Any]:
    length = int(change["len"])
    items: list[Any] = list(old[:length])
    items.extend([None] * (length - len(items)))
    for key, item in change["set"].items():
        i = int(key)
        items[i] = element.model_validate(item["new"]) if "new" in item else _apply_model(old[i], item["diff"])
    if any(item is None for item in items):
        raise ValueError("a journal entry leaves a gap in a list")
    return items
