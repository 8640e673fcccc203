"""Review of the quick path (issue 25): its setting and its per-process memory, without a stack.

Found and fixed: "nan" turned the quick path off silently; "0.00", "-0" and "0e0" were refused though 0 means off;
a threshold past the listen window (up to 60 s was allowed) kept a step cut every time on the quick path forever.
"""

from __future__ import annotations

import pytest

from ryusen_server.engine import INLINE_LISTEN_S, STEP_DURATIONS_KEPT, StepDurations
from ryusen_server.settings import server_settings


@pytest.mark.parametrize("bad", ["nan", "NaN", "-nan"])
def test_a_setting_that_is_not_a_number_of_seconds_stops_the_cold_start(bad: str) -> None:
    """ "nan" passed both checks (nan <= 0 and nan > 60 are False): the quick path was then silently off
    (max(recent) <= nan is never true), where "soon" names the setting."""
    with pytest.raises(ValueError, match="RYUSEN_INLINE_UP_TO_S"):
        server_settings({"RYUSEN_INLINE_UP_TO_S": bad})


@pytest.mark.parametrize("off", ["0", "0.0", "0.00", "00", "-0", "0e0"])
def test_every_spelling_of_zero_turns_the_quick_path_off(off: str) -> None:
    """The docs say 0 turns it off; only "0" and "0.0" did, the rest failed with "must be positive"."""
    assert server_settings({"RYUSEN_INLINE_UP_TO_S": off}).inline_up_to_s == 0.0


def test_a_threshold_past_the_listen_window_is_refused() -> None:
    """RYUSEN_INLINE_UP_TO_S could be up to 60 s, but an inline attempt is listened for INLINE_LISTEN_S (2 s) only.
    With 5 s, a step that takes 3 s every time was cut every time, and what was seen of it (about 3 s) was within
    5 s: it was never sent as an event again, and paid the wait, the late post and the lease timer each time. Now
    the setting is at most INLINE_UP_TO_MAX_S (1 s): a step seen taking more is sent as an event."""
    from ryusen_server.engine import INLINE_UP_TO_MAX_S

    assert INLINE_UP_TO_MAX_S + 1.0 <= INLINE_LISTEN_S  # the SDK's late margin: a quick answer is posted once
    durations = StepDurations()
    key = ("app", "fn", "work", "forward")
    for _ in range(STEP_DURATIONS_KEPT):
        durations.seen(key, 3.0)  # the step's time, as read from its run (authorized to settled)
    assert not durations.quick(key, INLINE_UP_TO_MAX_S)
    for too_long in ("5", "1.01", "60"):
        with pytest.raises(ValueError, match="RYUSEN_INLINE_UP_TO_S"):
            server_settings({"RYUSEN_INLINE_UP_TO_S": too_long})


def test_the_memory_is_bounded_whatever_the_step_names() -> None:
    durations = StepDurations(capacity=100)
    for i in range(10_000):
        durations.seen(("app", "fn", f"step-{i}", "forward"), 0.01)
    assert len(durations._seen) == 100
    assert all(len(v) <= STEP_DURATIONS_KEPT for v in durations._seen.values())
    recent = ("app", "fn", "step-9999", "forward")
    assert not durations.quick(recent, 0.25)  # one seen: not enough
    assert not durations.quick(None, 0.25)
