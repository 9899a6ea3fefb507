"""common.soak: how a run's end is judged, and a short soak of the experiment whose rank 0 once aborted at exit
(fsdp-ft over gloo, after its summary) under background load. `python -m common.soak` with its defaults soaks every
multi-rank experiment; the devlog keeps what such a soak counted."""

import signal
import subprocess
import sys
import time

import pytest

from common.soak import MULTI_RANK, classify, descendants, kill_tree, main


def test_each_end_is_judged_for_what_it_is():
    assert classify(None, "", False) == "hang"
    assert classify(-signal.SIGABRT, "terminate called without an active exception", True) == "abort"
    assert classify(0, "summary ...\nterminate called without an active exception", True) == "abort"
    assert classify(1, "RuntimeError: ...", False) == "exit"
    assert classify(0, "Warning: ... there are still 12 unwaited collective calls", True) == "unclean"
    assert classify(0, "", False) == "unclean"  # exit 0 without its results files
    assert classify(0, "summary (3 measured steps ...)", True) == "ok"
    assert "single-ft" not in MULTI_RANK and len(MULTI_RANK) == 9


def test_a_hang_is_killed_with_every_process_below_it():
    # A launcher whose child runs in a session of its own, as torchrun's workers do.
    launcher = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen("
                                 "[sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True); "
                                 "time.sleep(600)"])
    deadline = time.monotonic() + 60
    while not descendants(launcher.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    (child,) = descendants(launcher.pid)
    kill_tree(launcher)
    assert launcher.returncode == -signal.SIGKILL
    time.sleep(0.5)
    try:
        state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z")  # killed (a zombie until its new parent reaps it)


@pytest.mark.slow
def test_fsdp_ft_ends_cleanly_every_time_under_load(tmp_path, capsys):
    assert main(["--experiments", "fsdp-ft", "--runs", "2", "--steps", "3", "--load", "1", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "soak.md").read_text()
    assert "| fsdp-ft | 2 | 2 | 0 | 0 | 0 | 0 |" in report
    assert "total: 2 runs, 2 ok, 0 hang, 0 abort, 0 exit, 0 unclean" in report
