"""Issue 25, fair sharing on AWS: an app with a dispatch queue of its own (``app_dispatch_concurrency``).

The stack in a box (tests/infra/test_stack_in_a_box.py), synthesized with ``app_dispatch_concurrency={"video": 2}``:
its event sources each run up to their maximum concurrency of dispatch invocations. ``video`` is a Lambda app whose
attempts are answered inline (its replay memory is its container's own, so it takes no events): each of its slow
steps holds a dispatcher for the whole callback. Without a queue of its own, six of them held every dispatcher of
the shared queue, and the example shop's checkout waited behind them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.infra import test_stack_in_a_box as box_tests
from tests.infra.conftest import Synthesized, synthesize
from tests.infra.test_stack_in_a_box import Deployed
from tests.stack import wait_for

VIDEO_RUNS = 6
SLOW_S = 5.0


@pytest.fixture(scope="module")
def synthesized_with_video(tmp_path_factory: pytest.TempPathFactory) -> Synthesized:
    return synthesize(Path(tmp_path_factory.mktemp("cdk-app-queues")), app_dispatch_concurrency={"video": 2})


@pytest.fixture(scope="module")
def deployed(synthesized_with_video: Synthesized) -> Iterator[Deployed]:
    fixture = contextlib.contextmanager(box_tests.deployed.__wrapped__)  # type: ignore[attr-defined]
    with fixture(synthesized_with_video) as made:
        yield made


def video_app(master: str) -> Any:
    from ryusen import Ryusen, Step
    from ryusen._internal.signing import app_key

    app = Ryusen("video", signing_key=app_key(master, "video"))

    def encode(seconds: float) -> dict[str, Any]:
        time.sleep(seconds)
        return {"encoded": seconds}

    @app.function("encode-video")
    def encode_video(data: dict[str, Any], step: Step) -> Any:
        return step.run("encode", encode, data["seconds"], timeout=timedelta(seconds=30))

    return app


def test_an_app_with_a_queue_of_its_own_holds_at_most_its_share_of_dispatchers_and_another_app_goes_past(
    deployed: Deployed,
) -> None:
    from ryusen_server.lambdas import dispatch as dispatch_lambda

    source = deployed.source
    assert source is not None
    box = deployed.box
    [video_queue] = [n for n, q in box.resources("AWS::SQS::Queue").items() if n.startswith("EngineAppQueue")]
    video_arn = box.arns[video_queue]
    master = dispatch_lambda.engine().engine.master_keys()[0]
    app = video_app(master)
    url = box.function_url(app.lambda_handler, who="video")
    assert deployed.api("PUT", "/v1/apps/video", {"url": url}).status_code == 200
    videos = []
    for _ in range(VIDEO_RUNS):
        response = deployed.api("POST", "/v1/functions/encode-video/runs", {"input": {"seconds": SLOW_S}})
        assert response.status_code == 201, response.text
        videos.append(response.json()["id"])
    wait_for(lambda: source.running.get(video_arn, 0) == 2, what="video's tasks to hold its two dispatchers")
    checkout = deployed.finished(deployed.start({"sku": "lamp", "qty": 1, "card": "4242", "amount": 30}))
    finished_then = sum(deployed.run(r)["phase"] == "finished" for r in videos)
    assert checkout["outcome"] == "completed", checkout["summary"]
    # the checkout went past video's slow steps (6 of 5 s, two at a time): it ended before the first two did
    # (on the shared queue, it waited for a dispatcher until four had)
    assert finished_then < 2, f"{finished_then} of video's runs finished before the checkout"
    for run_id in videos:
        assert deployed.finished(run_id, timeout=120)["outcome"] == "completed"
    assert source.most_running[video_arn] == 2  # its share, never more
    handled = {(arn, run_id) for arn, body in source.handled for run_id in videos if run_id in body}
    assert {arn for arn, _ in handled} == {video_arn}  # every task of video's came through its own queue
    shop_queue = deployed.env["RYUSEN_QUEUE_ARN"]
    assert [arn for arn, body in source.handled if checkout["id"] in body] and all(
        arn == shop_queue for arn, body in source.handled if checkout["id"] in body
    )
