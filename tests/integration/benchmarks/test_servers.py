"""Stopping a benchmark's server stops its whole process group (real processes).

Each leader starts its children, waits until they are up, and prints their
PIDs before the test stops it: a stop that kills only the leader leaves the
children running, and the tests look at each child, not only at the leader.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.servers import stop_group

pytestmark = pytest.mark.skipif(
    not Path("/proc/self/stat").exists(), reason="reads process states from /proc"
)

# A child that ignores SIGTERM, as a JVM in a shutdown hook or a stuck worker would;
# it says "up" once the signal is ignored.
SLEEPER = ["sh", "-c", "echo up; exec sleep 60"]
STUBBORN_CHILD = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
    " print('up', flush=True); time.sleep(60)"
)


def start_leader(
    children: list[list[str]], *, leader_ignores_sigterm: bool = False
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A session leader that starts ``children`` (each must print one line when up),
    then prints their PIDs and sleeps; returns it and the children's PIDs."""
    code = "\n".join(
        [
            "import signal, subprocess, sys, time",
            *(["signal.signal(signal.SIGTERM, signal.SIG_IGN)"] if leader_ignores_sigterm else []),
            f"children = [subprocess.Popen(c, stdout=subprocess.PIPE) for c in {children!r}]",
            "for child in children:",
            "    child.stdout.readline()",
            "print(' '.join(str(child.pid) for child in children), flush=True)",
            "time.sleep(60)",
        ]
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True
    )
    assert process.stdout is not None
    pids = [int(pid) for pid in process.stdout.readline().split()]
    process.stdout.close()
    assert len(pids) == len(children)
    assert all(alive(pid) for pid in pids)
    return process, pids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie has died; only its parent has not reaped it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def wait_gone(pids: list[int], within_s: float = 5.0) -> list[int]:
    """The PIDs still alive after ``within_s`` (a SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if alive(pid)]


def cleanup(pids: list[int]) -> None:
    """Kill what a broken stop left behind, so a failing test leaks nothing."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, 9)


def test_stop_group_waits_for_the_whole_group() -> None:
    # A leader and children that outlive it, as TorchServe's Java frontend would.
    process, pids = start_leader([SLEEPER, SLEEPER])
    try:
        stop_group(process, grace_s=10)
        assert process.poll() is not None
        # Gone when stop_group returns, not some time after: it waited for them.
        assert [pid for pid in pids if alive(pid)] == []
        with pytest.raises(ProcessLookupError):
            os.killpg(process.pid, 0)
    finally:
        cleanup(pids)


def test_stop_group_kills_a_member_that_ignores_sigterm() -> None:
    stubborn = [sys.executable, "-c", STUBBORN_CHILD]
    process, pids = start_leader([stubborn])
    try:
        stop_group(process, grace_s=0.5)
        assert process.poll() is not None
        assert wait_gone(pids) == []
    finally:
        cleanup(pids)


def test_stop_group_kills_a_leader_that_ignores_sigterm_and_its_children() -> None:
    process, pids = start_leader([SLEEPER], leader_ignores_sigterm=True)
    try:
        stop_group(process, grace_s=0.5)
        assert process.poll() is not None
        assert wait_gone(pids) == []
    finally:
        cleanup(pids)
