"""A lost rank ends the run: ddp-ft on two torchrun agents (two "nodes", as in tests/test_multinode.py), one of which
is killed, or frozen, in the middle of training. The other rank exits within --collective-timeout-s with one line
that names itself, the collective it was in and the rank that stopped answering (common/dist.py), and the last
checkpoint written before the loss resumes and computes the steps the run had computed.

Two agents, not one: a torchrun agent whose own worker dies ends the others itself, so only a rank on another node
(another agent) is left waiting on the lost one, as when a machine of a multi-node job goes down.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO_ROOT, load_experiment, read_losses

TIMEOUT_S = 30  # --collective-timeout-s of these runs: far above a step here, even on a loaded 2-core machine
CHECKPOINT_EVERY = 2
STEPS = 20  # the resumed run takes the same --steps (the learning-rate schedule depends on it)


def agents(out_dir: Path, data: Path) -> list[subprocess.Popen]:
    """ddp-ft on 2 ranks, one per torchrun agent, each agent in a process group of its own (so that one node's agent
    and worker can be killed or stopped together). Agent 0 starts first, so it hosts the rendezvous store."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    train = [str(REPO_ROOT / "experiments" / "ddp-ft" / "train.py"), "--data", str(data), "--seq-len", "128",
             "--dtype", "fp32", "--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_EVERY), "--comm-profile-steps",
             "0", "--eval-fraction", "0.05", "--collective-timeout-s", str(TIMEOUT_S), "--out-dir", str(out_dir)]
    processes = []
    for node in range(2):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=watchdog", *train]
        processes.append(subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                          text=True))
        if node == 0:
            time.sleep(3)
    return processes


def workers(agent: subprocess.Popen) -> list[int]:
    """The worker processes of a torchrun agent (torchrun starts each in a session of its own)."""
    children = subprocess.run(["ps", "-o", "pid=", "--ppid", str(agent.pid)], capture_output=True, text=True).stdout
    return [int(pid) for pid in children.split()]


def worker_rank(agent: subprocess.Popen) -> int | None:
    """The RANK torchrun gave the worker of `agent` (from the worker's environment), None before it started."""
    for pid in workers(agent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for entry in environ:
            if entry.startswith(b"RANK="):
                return int(entry[5:])
    return None


def signal_node(agent: subprocess.Popen, signum: int) -> None:
    """What a node's loss looks like to the others: its agent and its worker killed, or frozen, at once."""
    for pid in [*workers(agent), agent.pid]:
        os.kill(pid, signum)


def latest_checkpoint(out_dir: Path) -> int:
    steps = [int(p.name.removeprefix("step-")) for p in (out_dir / "checkpoints").glob("step-*")
             if not p.name.endswith(".tmp")]
    return max(steps, default=0)


@pytest.mark.slow
@pytest.mark.parametrize("loss", ["killed", "frozen"])
def test_a_lost_rank_ends_the_run_with_one_line_and_a_resumable_checkpoint(tmp_path, small_data, loss):
    out_dir = tmp_path / "run"
    processes = agents(out_dir, small_data)
    try:
        # Wait for a published checkpoint and a step logged after it: the rank is lost in the middle of training.
        deadline = time.monotonic() + 600
        while True:
            assert all(p.poll() is None for p in processes), "\n".join(p.stdout.read() for p in processes)
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            logged = len((out_dir / "metrics.jsonl").read_text().splitlines()) if (
                out_dir / "metrics.jsonl").exists() else 0
            if latest_checkpoint(out_dir) >= CHECKPOINT_EVERY and logged > latest_checkpoint(out_dir):
                break
            time.sleep(0.5)
        ranks = [worker_rank(p) for p in processes]
        survivor, lost = (processes[0], processes[1]) if ranks.index(0) == 0 else (processes[1], processes[0])
        signal_node(lost, signal.SIGKILL if loss == "killed" else signal.SIGSTOP)
        lost_at = time.monotonic()
        output, _ = survivor.communicate(timeout=TIMEOUT_S + 120)
        ended_after_s = time.monotonic() - lost_at
    finally:
        for p in processes:
            for pid in [*workers(p), p.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()

    assert survivor.returncode != 0
    # Within the timeout: at once when the peer's process is gone (its sockets close), after --collective-timeout-s
    # when it is frozen; then 5 s of heartbeat reading and the agent's shutdown.
    assert ended_after_s < (20 if loss == "killed" else TIMEOUT_S + 20), output[-3000:]
    lines = [line for line in output.splitlines() if re.match(r"(\[rank0\]:)?rank 0: collective ", line)]
    assert len(lines) == 1, output[-3000:]
    what = "lost its connection to a peer" if loss == "killed" else f"got no answer within --collective-timeout-s " \
                                                                     f"{TIMEOUT_S}"
    assert what in lines[0] and lines[0].endswith("rank 1 stopped answering. Ending the run."), lines[0]
    assert re.search(r"collective gloo:\w+ #\d+ of group \w+", lines[0]), lines[0]  # from the flight recorder
    assert 'train.py", line' not in output  # one line, no traceback of the worker

    # The last published checkpoint is whole, and one is resumable: one process takes the same B (grad-accum 2 x 1
    # rank), resumes from the newest checkpoint the lost run logged steps after and computes those steps. (Between the
    # wait above and the signal the run may publish one more checkpoint at its last logged step: nothing to compare.)
    from common.checkpoint import checkpoint_problem

    newest = latest_checkpoint(out_dir)
    assert checkpoint_problem(out_dir / "checkpoints" / f"step-{newest}") is None
    logged = read_losses(out_dir)
    assert len(logged) >= newest >= CHECKPOINT_EVERY
    step = max(k for k in range(CHECKPOINT_EVERY, newest + 1, CHECKPOINT_EVERY) if k < len(logged))
    resumed = tmp_path / "resumed"
    load_experiment("ddp-ft").main([str(a) for a in [
        "--data", small_data, "--seq-len", 128, "--dtype", "fp32", "--steps", STEPS, "--grad-accum", 2,
        "--comm-profile-steps", 0, "--resume", out_dir / "checkpoints" / f"step-{step}", "--out-dir", resumed]])
    compared = min(2, len(logged) - step)
    assert read_losses(resumed)[:compared] == pytest.approx(logged[step:step + compared], rel=1e-5)
    assert json.loads((resumed / "summary.json").read_text())["config"]["resume"].endswith(f"step-{step}")


# ---------------------------------------------------------------------------------------------------------------
# On CUDA (no GPU here: the code path, with the device faked)


def test_nccl_gets_its_watchdog_and_the_flight_recorder_dumps_into_the_out_dir(tmp_path, monkeypatch):
    import torch

    from common import dist

    names = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE",
             "TORCH_FR_DUMP_ON_TIMEOUT", "TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_FR_DUMP_TEMP_FILE",
             "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "500")  # a user's own setting wins
    dist._enable_nccl_watchdog()
    assert {name: os.environ.get(name) for name in names[:5]} == {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_FR_BUFFER_SIZE": "2000", "TORCH_NCCL_TRACE_BUFFER_SIZE": "500",
        "TORCH_FR_DUMP_ON_TIMEOUT": "1", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    dist.record_collectives_in(tmp_path / "run")  # without CUDA: nothing to point
    assert "TORCH_FR_DUMP_TEMP_FILE" not in os.environ
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: True)
    dist.record_collectives_in(tmp_path / "run")
    prefix = str(tmp_path / "run" / "flight_recorder" / "rank_")  # PyTorch appends the rank
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == prefix
    assert (tmp_path / "run" / "flight_recorder").is_dir()


def test_only_a_collective_that_failed_is_reported_as_a_lost_rank():
    from common.dist import is_collective_failure, lost_rank_line

    timeout = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                           "30000ms for recv operation to complete")
    closed = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                          "[127.0.0.1]:49284")
    assert is_collective_failure(timeout) and is_collective_failure(closed)
    assert not is_collective_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_collective_failure(SystemExit("bad training data"))
    line = lost_rank_line(3, timeout, None, 30.0)
    assert line.startswith("rank 3: collective ") and "got no answer within --collective-timeout-s 30;" in line
    assert "lost its connection to a peer" in lost_rank_line(0, closed, None, 30.0)


def test_a_plain_process_gets_a_group_of_one_that_teardown_ends(monkeypatch):
    """`python train.py` of a strategy that needs a process group (DTensor, fully_shard): init_distributed makes a
    one-rank group in which collectives work, and teardown() ends it; a script that needs none gets none."""
    import torch
    import torch.distributed as dist

    from common.dist import init_distributed, teardown

    if dist.is_initialized():
        pytest.skip("a process group of this pytest process already exists")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_distributed().world_size == 1 and not dist.is_initialized()
    info = init_distributed(group_of_one=True)
    try:
        assert dist.is_initialized() and (dist.get_rank(), dist.get_world_size(), info.world_size) == (0, 1, 1)
        value = torch.tensor([2.0, 3.0])
        dist.all_reduce(value)
        assert value.tolist() == [2.0, 3.0]
    finally:
        teardown()
    assert not dist.is_initialized()
