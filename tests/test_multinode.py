"""Beyond one machine, the parts that need no launch: what common.preflight flags, and the SLURM script's dry run.

The launches are in tests/test_ddp_fsdp.py: its ddp-ft and fsdp-ft runs are two torchrun agents meeting at a c10d
rendezvous as two nodes (with common.preflight in the same launch), and one 4-rank launch runs HSDP, a 2-rank
checkpoint resumed on 4 ranks, and pp-ds-ft as 2 stages x 2 replicas."""

from __future__ import annotations

import os
import subprocess

from conftest import REPO_ROOT
from test_commands import parse_experiment


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

