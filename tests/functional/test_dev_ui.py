"""The dev UI's script (``local/ui.py``): it parses, and an attempt's last heartbeat is shown with a progress bar
where its details carry a fraction (decision 33, issue 25). Run with Node.js, which README requires."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from ryusen_server.local.ui import UI_HTML

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="Node.js is not installed")


def script() -> str:
    return "\n".join(re.findall(r"<script[^>]*>(.*?)</script>", UI_HTML, re.S))


def function(name: str) -> str:
    """The source of the script's function (or arrow function constant) ``name``."""
    found = re.search(rf"function {name}\(.*?\n}}", script(), re.S) or re.search(
        rf"const {name} = .*?;\n", script(), re.S
    )
    assert found, f"no function {name} in the dev UI"
    return found.group(0)


def test_the_dev_ui_script_parses(tmp_path: Path) -> None:
    (tmp_path / "ui.js").write_text(script())
    assert NODE is not None
    done = subprocess.run([NODE, "--check", str(tmp_path / "ui.js")], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_a_heartbeat_shows_a_progress_bar_or_its_details() -> None:
    program = f"""{function("esc")}
{function("heartbeat")}
console.log(JSON.stringify([heartbeat({{progress: 0.4}}), heartbeat("uploading <b>"), heartbeat(null), heartbeat({{progress: 7}})]));
"""
    assert NODE is not None
    done = subprocess.run([NODE, "-e", program], capture_output=True, text=True, check=True)
    bar, text, nothing, odd = json.loads(done.stdout)
    assert bar == '<progress max="1" value="0.4"></progress> 40%'
    assert text == "<code>&quot;uploading &lt;b&gt;&quot;</code>"  # escaped
    assert nothing == ""
    assert odd.startswith("<code>") and "progress" in odd  # not a fraction: shown as it is


def test_an_errors_traceback_is_shown_by_its_innermost_frame_and_opens_to_every_frame() -> None:
    where = {
        "frames": [
            {"file": "shop.py", "line": 12, "function": "checkout", "code": "charge(order)"},
            {"file": "shop.py", "line": 30, "function": "charge", "code": 'order["card"] < 1'},
        ],
        "omitted": 2,
    }
    program = f"""{function("esc")}
{function("trace")}
console.log(JSON.stringify([trace({{type: "KeyError", message: "x", traceback: {json.dumps(where)}}}), trace({{type: "E", message: "m"}})]));
"""
    assert NODE is not None
    done = subprocess.run([NODE, "-e", program], capture_output=True, text=True, check=True)
    shown, nothing = json.loads(done.stdout)
    assert shown.startswith('<details class="trace"><summary>raised at shop.py:30 in charge</summary>')
    assert "shop.py:12 in checkout\n    charge(order)" in shown
    assert "order[&quot;card&quot;] &lt; 1" in shown  # escaped
    assert "2 frames in Ryusen&#39;s SDK" in shown or "2 frames in Ryusen's SDK" in shown
    assert nothing == ""
