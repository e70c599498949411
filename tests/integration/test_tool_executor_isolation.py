"""Hostile code against a real tool executor (rstar serve, real HTTP, real sandboxes): each
snippet is contained, gets a sensible status, leaves nothing running, and the next ordinary
call succeeds."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.tool_executor.testing import running_server

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the sandbox's isolation needs root (namespaces, uids)")
UID_BASE = 310_000
SECRET = "hunter2-do-not-leak-7f3a"


@pytest.fixture(scope="module")
def server():
    env = {
        "RSTAR_TOOL_EXECUTOR_WORKERS": "1",
        "RSTAR_TOOL_EXECUTOR_SLOTS_PER_WORKER": "4",
        "RSTAR_TOOL_EXECUTOR_UID_BASE": str(UID_BASE),
        "RSTAR_TOOL_EXECUTOR_DEFAULT_TIMEOUT_S": "5",
        "RSTAR_TOOL_EXECUTOR_OUTPUT_HARD_LIMIT_BYTES": str(256 * 1024),
        "TOOL_EXECUTOR_TEST_SECRET": SECRET,
    }
    with running_server(env) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def run(http, code, **kw):
    resp = http.post("/v1/execute", json={"code": code, **kw})
    assert resp.status_code == 200, resp.text
    return resp.json()


def sandbox_processes() -> list[int]:
    """Processes on the host that run as one of the server's sandbox uids."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("Uid:"):
                    uid = int(line.split()[1])
                    if UID_BASE <= uid < UID_BASE + 1000:
                        found.append(int(entry.name))
        except OSError:
            continue
    return found


def assert_contained(http, server):
    """Nothing of the call is left running, the service and its pool parents live, and an
    ordinary call works."""
    deadline = time.monotonic() + 10
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []
    assert server.proc.poll() is None
    assert all(Path(f"/proc/{pid}").exists() for pid in server.pool_parent_pids())
    after = run(http, "print(6 * 7)")
    assert (after["status"], after["stdout"]) == ("ok", "42\n")


def test_infinite_loop_times_out(http, server):
    r = run(http, "while True:\n    pass", timeout_s=1)
    assert r["status"] == "timeout" and r["signal"] == 9
    assert_contained(http, server)


# CPU burnt faster than the wall clock (threads outside the GIL) while ignoring every signal it
# can: the kernel's RLIMIT_CPU ends it with SIGKILL before the supervisor's deadline, and that is
# a timeout, not the out-of-memory end a SIGKILL otherwise means.
CPU_BURN_IGNORING_SIGNALS = """
import hashlib, signal, threading
for s in (signal.SIGTERM, signal.SIGXCPU, signal.SIGINT, signal.SIGHUP):
    signal.signal(s, signal.SIG_IGN)
def burn():
    data = b"x" * (1 << 24)
    while True:
        hashlib.sha256(data).digest()  # releases the GIL: every thread burns a core
for _ in range(7):
    threading.Thread(target=burn, daemon=True).start()
burn()
"""


@pytest.mark.parametrize("code", ["import signal\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nwhile True:\n    pass",
                                  CPU_BURN_IGNORING_SIGNALS], ids=["loop-ignoring-sigterm", "threads-burning-cpu"])
def test_a_call_that_runs_past_its_time_is_a_timeout_whatever_it_ignores(http, server, code):
    r = run(http, code, timeout_s=2)
    assert r["status"] == "timeout", r
    assert_contained(http, server)


def test_fork_bomb_is_bounded_and_killed(http, server):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run(http, code, timeout_s=2)
    assert r["status"] == "timeout"
    assert_contained(http, server)


@pytest.mark.parametrize(
    "code",
    [
        "x = bytearray(64 * 1024**3)",
        "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 1024**2))",
        "import numpy as np\nx = np.ones((1 << 20, 1 << 12))",
    ],
)
def test_memory_bomb(http, server, code):
    r = run(http, code, memory_mb=256)
    assert r["status"] == "memory", r
    assert_contained(http, server)


def test_endless_output_hits_the_output_limit(http, server):
    r = run(http, "while True:\n    print('y' * 100)")
    assert r["status"] == "output_limit"
    assert r["truncated"] and r["stdout_truncated"]
    assert r["stdout"].startswith("y" * 100) and "characters elided" in r["stdout"]
    assert_contained(http, server)


def test_no_network_to_loopback_or_to_a_listening_port(http, server):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        for target in (("127.0.0.1", port), ("127.0.0.1", server.port)):
            r = run(http, f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect({target!r})\nprint('connected')")
            assert r["status"] == "error"
            assert "connected" not in r["stdout"]
            assert "Network is unreachable" in r["stderr"] or "Connection refused" in r["stderr"]
        with pytest.raises(socket.timeout):
            listener.accept()
    finally:
        listener.close()
    assert_contained(http, server)


def test_no_unix_socket_files(http, server, tmp_path):
    """A unix socket file the host can see (databases put world-writable ones in /run) is out
    of reach: the sandbox refuses AF_UNIX sockets (seccomp) and hides /run."""
    host_socket = socket.socket(socket.AF_UNIX)
    path = Path("/var/tmp") / f"te-test-{os.getpid()}.sock"  # visible (read-only) in the sandbox
    host_socket.bind(str(path))
    os.chmod(path, 0o777)
    host_socket.listen(1)
    try:
        targets = [str(path)] + [str(p) for p in Path("/run").glob("*/*") if p.is_socket()]
        for target in targets:
            r = run(http, f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({target!r})\nprint('connected')")
            assert r["status"] == "error" and "connected" not in r["stdout"], (target, r)
            assert "PermissionError" in r["stderr"]
    finally:
        host_socket.close()
        path.unlink()
    # socketpair (asyncio's self-pipe, multiprocessing) still works.
    r = run(http, "import asyncio\nasync def f():\n    await asyncio.sleep(0)\n    return 5\nprint(asyncio.run(f()))")
    assert (r["status"], r["stdout"]) == ("ok", "5\n")
    assert_contained(http, server)


def test_no_dns(http, server):
    r = run(http, "import socket\nprint(socket.getaddrinfo('pypi.org', 443))")
    assert r["status"] == "error" and "gaierror" in r["stderr"]
    assert_contained(http, server)


def test_secrets_and_source_are_not_readable(http, server):
    shadow = Path("/etc/shadow").read_text() if Path("/etc/shadow").exists() else ""
    r = run(http, "print(repr(open('/etc/shadow').read()))")
    if shadow:
        assert r["status"] in ("ok", "error")
        assert "root:" not in r["stdout"]
    source = REPO / "services" / "tool_executor" / "zygote.py"
    r = run(http, f"print(open({str(source)!r}).read()[:200])")
    assert r["status"] == "error" and ("FileNotFoundError" in r["stderr"] or "PermissionError" in r["stderr"])
    r = run(http, f"import os\nprint(os.listdir({str(REPO)!r}))")
    assert "services" not in r["stdout"]
    r = run(http, f"print(open('/proc/1/environ').read())")
    assert r["status"] == "error"
    r = run(http, f"print(open('/proc/{server.pid}/environ').read())")
    assert r["status"] == "error" and SECRET not in r["stdout"]
    # Nothing anywhere in /proc, nor the call's own environment, holds the service's secret.
    code = (
        "import os\nfound = []\nfor p in os.listdir('/proc'):\n    try:\n        data = open(f'/proc/{p}/environ', 'rb').read()\n"
        "    except OSError:\n        continue\n    found.append(data.decode(errors='replace'))\nprint(dict(os.environ))\nprint(found)"
    )
    r = run(http, code)
    assert r["status"] == "ok" and SECRET not in r["stdout"]
    assert "TOOL_EXECUTOR_TEST_SECRET" not in r["stdout"] and "RSTAR_" not in r["stdout"]
    assert_contained(http, server)


@pytest.mark.parametrize("target", ["/work/main/pwned", "/etc/pwned", "/var/tmp/pwned", "/dev/shm/pwned", "/pwned"])
def test_nothing_outside_its_directory_is_writable(http, server, target):
    target = target.replace("/work/main", str(REPO))
    r = run(http, f"open({target!r}, 'w').write('x')")
    assert r["status"] == "error"
    assert not Path(target).exists()
    assert_contained(http, server)


def test_its_own_directory_is_writable_and_fresh(http, server):
    r = run(http, "import os\nprint(os.listdir('.'))\nopen('f.txt', 'w').write('data')\nprint(open('f.txt').read())")
    assert (r["status"], r["stdout"]) == ("ok", "[]\ndata\n")
    r = run(http, "import os\nprint(os.listdir('.'))")
    assert r["stdout"] == "[]\n"
    assert_contained(http, server)


def test_cannot_signal_parent_service_or_other_calls(http, server):
    targets = [server.pid, *server.pool_parent_pids()]
    sleeper: dict = {}

    def long_call():
        sleeper["r"] = run(http, "import time\ntime.sleep(1.5)\nprint('survived')")

    t = threading.Thread(target=long_call)
    t.start()
    time.sleep(0.5)
    code = (
        "import os, signal\nresults = []\n"
        f"for pid in {targets!r} + [os.getppid()]:\n"
        "    for fn in (lambda: os.kill(pid, signal.SIGKILL), lambda: os.killpg(os.getpgid(pid), signal.SIGKILL)):\n"
        "        try:\n            fn()\n            results.append('sent')\n        except OSError as e:\n            results.append(type(e).__name__)\n"
        "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    results.append(type(e).__name__)\n"
        "print(results)"
    )
    r = run(http, code)
    t.join()
    assert "sent" not in r["stdout"]
    assert sleeper["r"]["status"] == "ok" and sleeper["r"]["stdout"] == "survived\n"
    assert_contained(http, server)


def test_leftover_that_keeps_signalling_its_new_parent_cannot_kill_it(http, server):
    """After the call, a leftover daemon is re-parented to the pool parent and spins on
    kill(getppid()): the parent never takes the call's uid, so it survives (same pid)."""
    parents_before = sorted(server.pool_parent_pids())
    code = (
        "import os, time\nfirst = os.getppid()\nmain = os.getpid()\n"
        "if os.fork() == 0:\n    os.setsid()\n    end = time.time() + 3\n"
        # Only once the call's main process is gone (else it would kill that, its parent).
        "    while os.getppid() == main and time.time() < end:\n        time.sleep(0.001)\n"
        "    while time.time() < end:\n        for pid in (first, os.getppid()):\n"
        "            try:\n                os.kill(pid, 9)\n            except OSError:\n                pass\n    os._exit(0)\n"
        "print('spawned')"
    )
    for _ in range(5):
        r = run(http, code)
        assert (r["status"], r["stdout"]) == ("ok", "spawned\n")
    assert_contained(http, server)
    assert sorted(server.pool_parent_pids()) == parents_before


def test_daemonised_child_is_killed_after_the_call(http, server):
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        while True:\n            time.sleep(0.05)\n    os._exit(0)\n"
        "time.sleep(0.2)\nprint('parent done')"
    )
    r = run(http, code)
    assert (r["status"], r["stdout"]) == ("ok", "parent done\n")
    assert_contained(http, server)


@pytest.mark.parametrize(
    ("code", "statuses", "stdout"),
    [
        ("import os\nos.close(0)\nos.close(1)\nos.close(2)\nprint('gone')", {"ok", "error"}, ""),
        ("import os, sys\nos.dup2(os.open('/dev/null', os.O_WRONLY), 1)\nprint('hidden')\nsys.stdout.flush()", {"ok"}, ""),
        ("import sys\nsys.stdout = open('/dev/null', 'w')\nprint('hidden')", {"ok"}, ""),
    ],
)
def test_closing_or_redirecting_stdio(http, server, code, statuses, stdout):
    r = run(http, code)
    assert r["status"] in statuses and r["stdout"] == stdout
    assert_contained(http, server)


def test_exit_codes(http, server):
    r = run(http, "import sys\nprint('bye')\nsys.exit(3)")
    assert (r["status"], r["exit_code"], r["stdout"]) == ("error", 3, "bye\n")
    r = run(http, "import os\nos._exit(4)")
    assert (r["status"], r["exit_code"]) == ("error", 4)
    r = run(http, "raise SystemExit(0)")
    assert (r["status"], r["exit_code"]) == ("ok", 0)
    assert_contained(http, server)


def test_ctypes_tricks(http, server):
    r = run(http, "import ctypes\nctypes.string_at(0)")
    assert r["status"] == "error" and r["signal"] == 11
    code = (
        "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('setuid', libc.setuid(0))\n"
        "print('mount', libc.mount(b'tmpfs', b'/tmp', b'tmpfs', 0, None))\n"
        "print('unshare', libc.unshare(0x40000000))\n"
        "print('uid', os.getuid())"
    )
    r = run(http, code)
    assert r["status"] == "ok"
    assert "setuid -1" in r["stdout"] and "mount -1" in r["stdout"] and "unshare -1" in r["stdout"]
    assert "uid 0" not in r["stdout"]
    assert_contained(http, server)


def test_threads_do_not_outlive_the_call(http, server):
    code = (
        "import threading, time\n"
        "def late():\n    time.sleep(0.3)\n    print('late', flush=True)\n"
        "def spin():\n    while True:\n        pass\n"
        "threading.Thread(target=late).start()\nthreading.Thread(target=spin, daemon=True).start()\nprint('main done')"
    )
    r = run(http, code)
    assert (r["status"], r["stdout"]) == ("ok", "main done\n")
    time.sleep(0.5)
    assert_contained(http, server)


def test_readyz_says_isolated(http):
    body = http.get("/readyz").json()
    assert body["ready"] and body["checks"]["sandbox_isolated"] is True
    health = http.get("/healthz").json()
    assert health["secure"] is True and health["isolation"]["netns"] and health["isolation"]["hidepid"]
    assert health["isolation"]["seccomp_no_unix_sockets"] is True


def test_pool_parents_hold_none_of_the_service_environment(server):
    # Every call is a fork of a pool parent, so its memory must hold no secret: the parents
    # are started with a scrubbed environment (read here as root, from outside).
    for pid in server.pool_parent_pids():
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        assert SECRET.encode() not in environ and b"RSTAR_" not in environ
        assert b"PATH=" in environ
