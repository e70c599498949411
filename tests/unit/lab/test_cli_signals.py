"""`rstar up` and `rstar demo` stop the services they started on SIGTERM as on Ctrl-C: their
clean-up sits in ``finally`` blocks (a plain one in `up`, one inside ``asyncio.run`` in the
demo), which SIGTERM's default action would skip."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

# A command's shape: clean-up in a ``finally`` around a long wait. {handler} is where a command
# installs the SIGTERM handler (left empty for the control case below).
PLAIN = """
import sys, time
from lab.cli import sigterm_as_ctrl_c
{handler}
try:
    print("ready", flush=True)
    time.sleep(60)
finally:
    open(sys.argv[1], "w").write("cleaned up")
"""
WITH_HANDLER = "sigterm_as_ctrl_c()"

IN_ASYNCIO = """
import asyncio, sys
from lab.cli import sigterm_as_ctrl_c

async def main():
    try:
        print("ready", flush=True)
        await asyncio.sleep(60)
    finally:
        # the demo stops its services from a thread like this
        await asyncio.to_thread(lambda: open(sys.argv[1], "w").write("cleaned up"))

sigterm_as_ctrl_c()
asyncio.run(main())
"""


@pytest.mark.parametrize("program", [PLAIN.format(handler=WITH_HANDLER), IN_ASYNCIO], ids=["plain", "asyncio"])
def test_sigterm_runs_the_finally_blocks(tmp_path: Path, program: str):
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", program, str(marker)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert marker.read_text() == "cleaned up"
    assert proc.returncode != 0  # still reported as interrupted


def test_without_the_handler_sigterm_skips_them(tmp_path: Path):
    """The case the handler exists for (the test above would pass vacuously otherwise)."""
    marker = tmp_path / "marker"
    proc = subprocess.Popen([sys.executable, "-c", PLAIN.format(handler=""), str(marker)], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    assert not marker.exists() and proc.returncode == -signal.SIGTERM
