"""The tool executor's HTTP API over real HTTP against `rstar serve tool-executor`: ordinary
code, validation, batches, sessions, metrics."""

from __future__ import annotations

import time

import httpx
import pytest

from services.tool_executor.testing import NOT_ROOT_ENV, running_server


@pytest.fixture(scope="module")
def server():
    env = {
        "RSTAR_TOOL_EXECUTOR_WORKERS": "1",
        "RSTAR_TOOL_EXECUTOR_SLOTS_PER_WORKER": "4",
        "RSTAR_TOOL_EXECUTOR_UID_BASE": "320000",
        "RSTAR_TOOL_EXECUTOR_MAX_TIMEOUT_S": "20",
        "RSTAR_TOOL_EXECUTOR_MAX_MEMORY_MB": "2048",
        "RSTAR_TOOL_EXECUTOR_MAX_OUTPUT_CHARS": "1000",
        "RSTAR_TOOL_EXECUTOR_MAX_BATCH_ITEMS": "50",
        "RSTAR_TOOL_EXECUTOR_SESSION_TTL_S": "2",
        "RSTAR_TOOL_EXECUTOR_SESSION_MAX_CELLS": "3",
    }
    with running_server({**env, **NOT_ROOT_ENV}) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def run(http, code, **kw):
    resp = http.post("/v1/execute", json={"code": code, **kw})
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_ordinary_code(http):
    r = run(http, "import math\nprint(math.comb(10, 3))\nprint('warn', file=__import__('sys').stderr)")
    assert r["status"] == "ok" and r["stdout"] == "120\n" and r["stderr"] == "warn\n" and r["exit_code"] == 0
    assert r["truncated"] is False and r["duration_ms"] > 0 and r["queue_ms"] >= 0 and r["kind"] == "light"


def test_stdin(http):
    r = run(http, "import sys\nlines = sys.stdin.read().split()\nprint(sum(map(int, lines)))\n", stdin="1 2\n3\n")
    assert r["stdout"] == "6\n"
    r = run(http, "print(input().upper())", stdin="héllo\n")
    assert r["stdout"] == "HÉLLO\n"


def test_syntax_error(http):
    r = run(http, "def f(:\n    pass")
    assert r["status"] == "error" and r["exit_code"] == 1
    assert 'File "<cell>", line 1' in r["stderr"] and "SyntaxError" in r["stderr"]


def test_exception_with_traceback(http):
    r = run(http, "def f(x):\n    return 1 / x\nprint('before')\nf(0)")
    assert r["status"] == "error" and r["stdout"] == "before\n"
    tb = r["stderr"]
    assert tb.startswith("Traceback (most recent call last):")
    assert 'File "<cell>", line 4' in tb and 'File "<cell>", line 2, in f' in tb and "return 1 / x" in tb
    assert tb.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "zygote" not in tb  # the sandbox's own frames are not shown


def test_non_utf8_output(http):
    r = run(http, "import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe end\\n')")
    assert r["status"] == "ok" and r["stdout"] == "ok \ufffd\ufffd end\n"


def test_long_output_is_capped_with_the_middle_elided(http):
    r = run(http, "print('A' * 3000 + 'B' * 3000)")
    assert r["status"] == "ok" and r["truncated"] and r["stdout_truncated"] and not r["stderr_truncated"]
    assert r["stdout"].startswith("A" * 500) and r["stdout"].endswith("B" * 499 + "\n")
    assert "[5001 characters elided]" in r["stdout"]


def test_heavy_libraries(http):
    r = run(http, "import sympy\nprint(sympy.factorint(2**64 - 1))")
    assert r["status"] == "ok" and r["stdout"] == "{3: 1, 5: 1, 17: 1, 257: 1, 641: 1, 65537: 1, 6700417: 1}\n"
    assert r["kind"] == "heavy"
    r = run(http, "import numpy as np\nprint(int(np.arange(10).sum()))")
    assert r["stdout"] == "45\n"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"stdin": "x"}, "code"),
        ({"code": "1", "bogus": 1}, "bogus"),
        ({"code": "1", "timeout_s": 21}, "exceeds the service maximum 20"),
        ({"code": "1", "memory_mb": 4096}, "exceeds the service maximum 2048"),
        ({"code": "1", "timeout_s": -1}, "timeout_s"),
        ({"code": 5}, "code"),
    ],
)
def test_invalid_requests_get_422_with_a_reason(http, body, reason):
    resp = http.post("/v1/execute", json=body)
    assert resp.status_code == 422
    assert reason in str(resp.json()["detail"])


def test_malformed_json_is_422(http):
    resp = http.post("/v1/execute", content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 422


def test_batch_keeps_order_and_reports_each_result(http):
    items = [{"code": f"print({i} * {i})"} for i in range(20)] + [{"code": "1/0"}, {"code": "while True: pass", "timeout_s": 0.5}]
    resp = http.post("/v1/execute/batch", json={"items": items})
    assert resp.status_code == 200
    results = resp.json()["results"]
    assert [r["stdout"] for r in results[:20]] == [f"{i * i}\n" for i in range(20)]
    assert [r["status"] for r in results[20:]] == ["error", "timeout"]


def test_batch_limits(http):
    resp = http.post("/v1/execute/batch", json={"items": [{"code": "1"}] * 51})
    assert resp.status_code == 422 and "maximum is 50" in resp.json()["detail"]
    resp = http.post("/v1/execute/batch", json={"items": [{"code": "1"}, {"code": "1", "timeout_s": 99}]})
    assert resp.status_code == 422 and "items[1]" in resp.json()["detail"]
    assert http.post("/v1/execute/batch", json={"items": []}).status_code == 422


def test_session_keeps_definitions_and_suppresses_replayed_output(http):
    sid = "s-defs"
    assert run(http, "import math\nx = 41\ndef f(y):\n    return y + 1\nprint('first')", session_id=sid)["stdout"] == "first\n"
    run(http, "undefined_name", session_id=sid)  # a failing cell is not kept
    r = run(http, "print(f(x), math.pi > 3)", session_id=sid)
    assert (r["status"], r["stdout"]) == ("ok", "42 True\n")
    # Other sessions and plain calls do not see it.
    assert run(http, "print(x)", session_id="other")["status"] == "error"
    assert run(http, "print(x)")["status"] == "error"


def test_session_is_refused_when_full_and_can_be_deleted(http):
    sid = "s-full"
    for i in range(3):
        assert run(http, f"v{i} = {i}", session_id=sid)["status"] == "ok"
    resp = http.post("/v1/execute", json={"code": "print(v2)", "session_id": sid})
    assert resp.status_code == 422 and "maximum of 3 cells" in resp.json()["detail"]
    assert http.delete(f"/v1/sessions/{sid}").json() == {"deleted": True}
    assert run(http, "print(1)", session_id=sid)["stdout"] == "1\n"


def test_session_expires(http):
    sid = "s-expire"
    run(http, "y = 7", session_id=sid)
    assert run(http, "print(y)", session_id=sid)["stdout"] == "7\n"
    time.sleep(2.5)  # the server's session TTL is 2 s
    assert run(http, "print(y)", session_id=sid)["status"] == "error"


def test_metrics_and_health(http):
    run(http, "print(1)")
    text = http.get("/metrics").text
    assert 'tool_executor_calls_total{kind="light",status="ok"}' in text
    assert "tool_executor_queue_seconds_bucket" in text and "tool_executor_busy_slots" in text
    assert http.get("/healthz").json()["status"] == "ok"
    assert http.get("/readyz").status_code == 200


def test_a_dead_pool_parent_fails_its_calls_and_is_restarted(http, server):
    import os
    import signal
    import threading
    from pathlib import Path

    def light_parents():
        pids = []
        for pid in server.pool_parent_pids():
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[3] == b"light":
                pids.append(pid)
        return pids

    (victim,) = light_parents()  # the fixture runs one parent per kind
    inflight: dict = {}
    t = threading.Thread(target=lambda: inflight.setdefault("r", run(http, "import time\ntime.sleep(3)\nprint('no')")))
    t.start()
    time.sleep(0.7)
    os.kill(victim, signal.SIGKILL)
    t.join()
    assert inflight["r"]["status"] == "error" and "died" in inflight["r"]["stderr"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (http.get("/readyz").status_code != 200 or victim in light_parents() or not light_parents()):
        time.sleep(0.2)
    assert run(http, "print('back')")["stdout"] == "back\n"
    assert 'tool_executor_worker_restarts_total{kind="light"} 1.0' in http.get("/metrics").text
