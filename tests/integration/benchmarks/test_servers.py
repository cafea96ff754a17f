"""Stopping a benchmark's server stops its whole process group (real processes)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from harness.servers import stop_group


def test_stop_group_waits_for_the_whole_group() -> None:
    # A leader and a child that outlives it, as TorchServe's Java frontend would.
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    stop_group(process, grace_s=10)
    assert process.poll() is not None
    with pytest.raises(ProcessLookupError):
        os.killpg(process.pid, 0)


def test_stop_group_kills_a_member_that_ignores_sigterm() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    stop_group(process, grace_s=0.5)
    assert process.poll() is not None
