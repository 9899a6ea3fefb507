"""Beyond one machine: two torchrun agents on localhost as two "nodes" (c10d rendezvous) compute single-ft's steps in
ddp-ft and fsdp-ft, and common.preflight reports the layout; the SLURM script's dry run prints each node's command."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, load_experiment, read_losses
from test_commands import parse_experiment

FP32 = ("--seq-len", 128, "--dtype", "fp32", "--warmup-steps", 2, "--steps", 3, "--comm-profile-steps", 0)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory, small_data):
    """One launch: node 0 and node 1, one rank each, meet at a c10d rendezvous; both run ddp-ft, fsdp-ft (B = 1 x 2 x
    2 ranks = 4 rows) and the preflight. The single-ft reference runs here, on the same B."""
    root = tmp_path_factory.mktemp("two-nodes")
    common = [*FP32, "--data", small_data, "--micro-batch-size", 1, "--grad-accum", 2]
    runs = [["ddp-ft", *common, "--out-dir", root / "ddp"], ["fsdp-ft", *common, "--out-dir", root / "fsdp"],
            ["preflight", "--sizes-mb", 1, "--iters", 2, "--expect-world-size", 2, "--json", root / "preflight.json"]]
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes",
         str(REPO_ROOT / "tests" / "run_many.py"), "+", json.dumps([[str(a) for a in run] for run in runs])],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
    outputs = [agent.communicate(timeout=600)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-5000:]
    load_experiment("single-ft").main([str(a) for a in (*common, "--grad-accum", 4, "--out-dir", root / "single")])
    return root, outputs


def test_two_nodes_compute_the_single_process_steps(two_nodes):
    root, _ = two_nodes
    reference = read_losses(root / "single")
    assert len(reference) == 3
    for name in ("ddp", "fsdp"):
        summary = json.loads((root / name / "summary.json").read_text())
        assert summary["hardware"]["world_size"] == 2
        # Each node's rank takes its own rows (the data shard follows RANK, not LOCAL_RANK, which is 0 on both).
        assert read_losses(root / name) == pytest.approx(reference, rel=1e-5), name


def test_preflight_reports_the_ranks_and_bus_bandwidth(two_nodes):
    root, outputs = two_nodes
    report = json.loads((root / "preflight.json").read_text())
    assert report["world_size"] == 2 and report["problems"] == []
    assert sorted((r["rank"], r["local_rank"], r["local_world_size"]) for r in report["ranks"]) == [(0, 0, 1),
                                                                                                  (1, 0, 1)]
    rows = {(r["op"], r["bytes"]): r for r in report["collectives"]}
    assert set(rows) == {("all_reduce", 2**20), ("all_gather", 2**20)}
    for (op, n_bytes), row in rows.items():
        algbw = n_bytes / (row["ms"] / 1e3) / 1e9
        assert row["algbw_gbps"] == pytest.approx(algbw) and row["busbw_gbps"] == pytest.approx(
            algbw * (1.0 if op == "all_reduce" else 0.5))  # nccl-tests: 2(n-1)/n and (n-1)/n at n = 2
    assert "| all_reduce | 1 MiB |" in outputs[0] + outputs[1]  # printed by rank 0, whichever node it is on


def test_preflight_flags_what_users_hit(monkeypatch):
    from common.preflight import checks

    gpu = dict(host="a", device_name="NVIDIA GeForce RTX 4090", peer_access={1: False})
    infos = [dict(gpu, rank=0), dict(gpu, rank=1), dict(gpu, host="b", rank=2)]
    slow = [dict(op="all_reduce", bytes=2**27, busbw_gbps=1.2)]
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    problems = checks(infos, slow, expect_world_size=4, min_busbw_gbps=5.0)
    assert len(problems) == 4
    assert problems[0].startswith("world size 3, expected 4")
    assert problems[1].startswith("nodes run different numbers of ranks (a: 2, b: 1)")
    assert "without peer access" in problems[2] and "NCCL_P2P_DISABLE=1" in problems[2]
    assert "1.20 GB/s at 128 MiB" in problems[3] and "NCCL_SOCKET_IFNAME" in problems[3]
    monkeypatch.setenv("NCCL_P2P_DISABLE", "1")
    assert checks(infos[:2], slow, expect_world_size=2, min_busbw_gbps=5.0) == []  # one node: no link to judge


def test_slurm_dry_run_prints_each_nodes_command():
    env = dict(os.environ, DRY_RUN="1", NODELIST="gpu01 gpu02 gpu03", GPUS_PER_NODE="4", MASTER_PORT="29512")
    env.pop("SLURM_JOB_NODELIST", None)
    result = subprocess.run(["bash", "assets/slurm/train.sbatch", "experiments/fsdp-ft/train.py", "--steps", "3",
                             "--model", "Qwen/Qwen3-4B-Base"], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(": ", 1)[0] for line in lines] == ["gpu01", "gpu02", "gpu03"]
    commands = {line.split(": ", 1)[1] for line in lines}
    assert len(commands) == 1  # every node runs the same agent; the rendezvous numbers them
    tokens = commands.pop().split()
    assert tokens[:3] == ["uv", "run", "torchrun"]
    assert {"--nnodes=3", "--nproc-per-node=4", "--rdzv-backend=c10d", "--rdzv-endpoint=gpu01:29512"} <= set(tokens)
    script = tokens.index("experiments/fsdp-ft/train.py")
    parse_experiment("fsdp-ft", tokens[script + 1:])  # the experiment accepts the flags it is handed
    # Without arguments it says how to use it.
    usage = subprocess.run(["bash", "assets/slurm/train.sbatch"], cwd=REPO_ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert usage.returncode == 2 and "usage: sbatch" in usage.stderr
