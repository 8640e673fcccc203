"""``ryusen dev`` shares its dispatch workers fairly between apps (issue 25).

Issue 25 measured it: ten runs of one app, each with a 40 s step, held all eight dispatch workers, and another
app's checkout took 37.2 s instead of 0.3 s. Each task message carries its run's app as its message group
(SQS's ``MessageGroupId``, as on the deployment's fair queue); the dispatch loop lets no app hold more than its
share of the workers, and hands a freed worker to the apps with waiting work in turn. These tests drive the
loop with a queue that hands out messages in the order they were sent and a handler that holds a slow app's
tasks until released, and check structure (who ran while whom held what), never timings.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from ryusen_server.local.dev import DevError, DevStack
from ryusen_server.local.fair import FairShare
from tests.stack import wait_for


class GroupedQueue:
    """A standard queue in miniature: messages come out in the order sent, each with its message group, and
    stay out (invisible) until deleted; visibility changes are recorded."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: list[dict[str, Any]] = []
        self.out: dict[str, dict[str, Any]] = {}
        self.visibility: list[tuple[str, int]] = []
        self.asked_for_groups = True

    def put(self, body: str, group: str | None) -> None:
        attributes = {"MessageGroupId": group} if group is not None else {}
        with self.lock:
            self.waiting.append({"Body": body, "ReceiptHandle": f"r-{body}", "Attributes": attributes})

    def receive_message(self, *, MaxNumberOfMessages: int, **kwargs: Any) -> dict[str, Any]:
        names = kwargs.get("MessageSystemAttributeNames", [])
        with self.lock:
            self.asked_for_groups = self.asked_for_groups and "MessageGroupId" in names
            taken, self.waiting = self.waiting[:MaxNumberOfMessages], self.waiting[MaxNumberOfMessages:]
            for message in taken:
                self.out[message["ReceiptHandle"]] = message
        if not taken:
            time.sleep(0.02)  # a long poll that found nothing (no busy loop)
        return {"Messages": taken}

    def change_message_visibility(self, *, ReceiptHandle: str, VisibilityTimeout: int, **_: Any) -> None:
        with self.lock:
            self.visibility.append((ReceiptHandle, VisibilityTimeout))


class Tasks:
    """Runs the dev stack's dispatch loop over a :class:`GroupedQueue` with a fake ``_handle``: a message of a
    slow app holds its worker until ``release`` is set."""

    def __init__(self, stack: DevStack, queue: GroupedQueue, slow: set[str]) -> None:
        self.lock = threading.Lock()
        self.release = threading.Event()
        self.running: dict[str, int] = {}
        self.most_running: dict[str, int] = {}
        self.started: list[tuple[str, dict[str, int]]] = []
        """Each task's body when it started, with how many tasks each app was running at that moment."""
        self.finished: list[str] = []
        self.slow = slow
        self.stack, self.queue = stack, queue
        stack.wired = SimpleNamespace(  # type: ignore[assignment]
            sqs=queue,
            engine=SimpleNamespace(
                settings=SimpleNamespace(engine=SimpleNamespace(attempt_timeout_s=30, lease_grace_s=5))
            ),
        )
        stack.resources = SimpleNamespace(queue_url="q")  # type: ignore[assignment]
        stack._handle = self.handle  # type: ignore[method-assign]
        self.loop = threading.Thread(target=stack._dispatch_loop, daemon=True)

    def handle(self, message: dict[str, Any], **_: Any) -> None:
        app = message["Body"].split("/")[0]
        with self.lock:
            self.started.append((message["Body"], dict(self.running)))
            self.running[app] = self.running.get(app, 0) + 1
            self.most_running[app] = max(self.most_running.get(app, 0), self.running[app])
        if app in self.slow:
            self.release.wait(60)
        with self.lock:
            self.running[app] -= 1
            self.finished.append(message["Body"])

    def __enter__(self) -> Tasks:
        self.loop.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.release.set()
        self.stack._stop.set()
        self.loop.join(20)
        assert not self.loop.is_alive()

    def wait(self, done: Callable[[], bool], what: str) -> None:
        wait_for(done, what=what, timeout=30)


def stack_with(env: dict[str, str] | None = None) -> DevStack:
    return DevStack(port=0, out=lambda _: None, env=env or {})


def test_another_apps_checkout_runs_while_one_apps_slow_steps_hold_their_share() -> None:
    """Issue 25's scenario: ten slow tasks of ``video`` are queued before ``shop``'s checkout. The checkout
    starts while the slow tasks still hold their workers, and ``video`` never holds more than its share."""
    queue = GroupedQueue()
    for i in range(10):
        queue.put(f"video/{i}", "video")
    queue.put("shop/checkout", "shop")
    stack = stack_with()
    with Tasks(stack, queue, slow={"video"}) as tasks:
        tasks.wait(lambda: "shop/checkout" in tasks.finished, "shop's checkout to finish")
        assert not tasks.release.is_set()  # ...while every one of video's tasks is still held
        [(_, running_then)] = [(b, r) for b, r in tasks.started if b == "shop/checkout"]
        assert running_then.get("video", 0) == stack.dispatch.app_workers  # video held its whole share
        assert tasks.most_running["video"] == stack.dispatch.app_workers < stack.dispatch.workers
        tasks.release.set()
        tasks.wait(lambda: len(tasks.finished) == 11, "every task to finish")
    assert queue.asked_for_groups  # the loop asks SQS for each message's group


def test_the_default_share_is_half_the_workers() -> None:
    dispatch = stack_with().dispatch
    assert (dispatch.workers, dispatch.app_workers) == (8, 4)


def test_apps_with_waiting_work_take_freed_workers_in_turn() -> None:
    """Twelve tasks each of three apps, queued one app's after another's, with one worker: they start in
    turn (a, b, c, a, b, c, ...), not in the order they were queued."""
    share: FairShare[str] = FairShare(workers=1, app_workers=1)
    for app in "abc":
        for i in range(12):
            share.add(app, f"{app}/{i}")
    order = []
    while (picked := share.next()) is not None:
        key, item = picked
        order.append(item)
        assert share.next() is None  # the one worker is taken
        share.done(key)
    assert order == [f"{app}/{i}" for i in range(12) for app in "abc"]


def test_an_app_at_its_share_waits_while_others_run() -> None:
    share: FairShare[str] = FairShare(workers=4, app_workers=2)
    for i in range(4):
        share.add("video", f"video/{i}")
    share.add("shop", "shop/checkout")
    started = [share.next(), share.next(), share.next()]
    assert [item for _, item in filter(None, started)] == ["video/0", "shop/checkout", "video/1"]
    assert share.next() is None  # a worker is free, but video holds its share and nobody else waits
    assert (share.free, share.waiting) == (1, 2)
    share.done("video")
    assert share.next() == ("video", "video/2")


def test_messages_without_a_group_are_each_their_own() -> None:
    """A Scheduler timer or a message sent before this change has no group: none of them waits for another."""
    queue = GroupedQueue()
    for i in range(6):
        queue.put(f"timer{i}/x", None)
    stack = stack_with({"RYUSEN_DEV_WORKERS": "6", "RYUSEN_DEV_APP_WORKERS": "1"})
    with Tasks(stack, queue, slow={f"timer{i}" for i in range(6)}) as tasks:
        tasks.wait(lambda: len(tasks.started) == 6, "all six to start at once")


def test_a_message_waiting_for_its_apps_share_is_kept_invisible_and_runs_with_what_is_left() -> None:
    """A received message waiting for a worker stays invisible while it waits (it is not delivered twice),
    and is handed the visibility it still has, so the attempt's lease is set from that."""
    queue = GroupedQueue()
    for i in range(3):
        queue.put(f"video/{i}", "video")
    stack = stack_with({"RYUSEN_DEV_WORKERS": "4", "RYUSEN_DEV_APP_WORKERS": "1"})
    clock = [1000.0]
    stack._monotonic = lambda: clock[0]  # type: ignore[method-assign]
    given: dict[str, float | None] = {}
    tasks = Tasks(stack, queue, slow={"video"})

    def handle(message: dict[str, Any], visible_for_s: float | None = None) -> None:
        given[message["Body"]] = visible_for_s
        tasks.handle(message)

    stack._handle = handle  # type: ignore[method-assign]
    with tasks:
        tasks.wait(lambda: len(queue.out) == 3 and len(tasks.started) == 1, "one to run and two to wait")
        clock[0] += 30.0  # past half the visibility (35 s): the waiting ones are made invisible again
        tasks.wait(lambda: {h for h, _ in queue.visibility} >= {"r-video/1", "r-video/2"}, "their visibility kept")
        assert all(seconds == 35 for _, seconds in queue.visibility)
        clock[0] += 10.0
        tasks.release.set()
        tasks.wait(lambda: len(tasks.finished) == 3, "every task to finish")
    assert given["video/0"] == 35  # started at once: as received
    assert given["video/1"] is not None and 20 <= given["video/1"] <= 26  # 35 s kept 10 s ago (it may wait on)


def test_a_named_apps_concurrency_replaces_the_default_share_for_it() -> None:
    """``RYUSEN_DEV_APP_CONCURRENCY=video=1``: video's slow tasks hold one worker, not the default half; an app
    not named keeps the default share."""
    queue = GroupedQueue()
    for i in range(4):
        queue.put(f"video/{i}", "video")
    for i in range(4):
        queue.put(f"reports/{i}", "reports")
    stack = stack_with({"RYUSEN_DEV_WORKERS": "6", "RYUSEN_DEV_APP_CONCURRENCY": "video=1"})
    assert stack.dispatch.app_concurrency == {"video": 1}
    with Tasks(stack, queue, slow={"video", "reports"}) as tasks:
        tasks.wait(lambda: tasks.running.get("reports", 0) == 3, "reports to hold its default share (half of 6)")
        assert tasks.most_running["video"] == 1
        tasks.release.set()
        tasks.wait(lambda: len(tasks.finished) == 8, "every task to finish")
    assert tasks.most_running == {"video": 1, "reports": 3}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RYUSEN_DEV_APP_CONCURRENCY": "video"}, "RYUSEN_DEV_APP_CONCURRENCY must be APP=N pairs"),
        ({"RYUSEN_DEV_APP_CONCURRENCY": "video=0"}, "RYUSEN_DEV_APP_CONCURRENCY must be APP=N pairs"),
        ({"RYUSEN_DEV_WORKERS": "4", "RYUSEN_DEV_APP_CONCURRENCY": "video=5"}, "from 1 to RYUSEN_DEV_WORKERS (4)"),
        ({"RYUSEN_DEV_WORKERS": "0"}, "RYUSEN_DEV_WORKERS must be a positive whole number"),
        ({"RYUSEN_DEV_APP_WORKERS": "half"}, "RYUSEN_DEV_APP_WORKERS must be a positive whole number"),
        ({"RYUSEN_DEV_WORKERS": "4", "RYUSEN_DEV_APP_WORKERS": "5"}, "at most RYUSEN_DEV_WORKERS (4)"),
    ],
)
def test_a_bad_dispatch_setting_is_refused_naming_it(env: dict[str, str], message: str) -> None:
    with pytest.raises(DevError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stack_with(env)
