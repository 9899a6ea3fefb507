"""Preflight: before a long job, check the layout and time its collectives with the launch command training will use.

    uv run torchrun --nproc_per_node=2 -m common.preflight
    uv run torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=node01:29500 -m common.preflight
    sbatch assets/slurm/train.sbatch -m common.preflight

Rank 0 prints every rank's host, local rank, device and what torch sees of the links (peer access between the GPUs
of a node, the backend and its version), then the time of an all-reduce and an all-gather at a few sizes with their
bus bandwidth as nccl-tests defines it, so the number compares with the link's rated speed whatever the world size:
all-reduce moves 2(n-1)/n of the buffer over each rank's link, all-gather (n-1)/n of the gathered buffer, so

    algbw = bytes / time,  busbw(all-reduce) = algbw x 2(n-1)/n,  busbw(all-gather) = algbw x (n-1)/n

It flags what users hit: a world size other than the one expected (--expect-world-size, or nodes with different
numbers of ranks), consumer GPUs whose peer-to-peer path can hang the first collective (the NCCL_P2P_DISABLE=1 hint;
the collectives run under --timeout-s so a hang ends with that hint instead of forever), and a slow link between
nodes. `--json FILE` also writes the results.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

CONSUMER_GPUS = ("GeForce", "RTX", "TITAN", "Radeon")  # peer-to-peer over PCIe is often missing or broken on these


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests' factor from algorithm bandwidth to bus bandwidth."""
    n = world_size
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def rank_info(device: torch.device) -> dict:
    info = dict(host=socket.gethostname(), rank=dist.get_rank(), local_rank=int(os.environ.get("LOCAL_RANK", 0)),
                local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), device=str(device),
                backend=dist.get_backend(), torch=torch.__version__)
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        others = [i for i in range(torch.cuda.device_count()) if i != device.index]
        info["peer_access"] = {i: torch.cuda.can_device_access_peer(device.index, i) for i in others}
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if info["backend"] == "nccl" else None
        info["hip"] = torch.version.hip
    else:
        info["device_name"] = "cpu"
    return info


def time_collective(op: str, n_bytes: int, device: torch.device, iters: int) -> float:
    """Seconds per call, after one warm-up call; the device is synchronised around the timed calls."""
    world = dist.get_world_size()
    count = max(1, n_bytes // 4)
    if op == "all_reduce":
        tensor = torch.ones(count, device=device)
        call = lambda: dist.all_reduce(tensor)  # noqa: E731
    else:  # all_gather: n_bytes is the gathered output, as nccl-tests counts it
        part = torch.ones(max(1, count // world), device=device)
        out = torch.empty(part.numel() * world, device=device)
        call = lambda: dist.all_gather_into_tensor(out, part)  # noqa: E731
    call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        call()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters


def checks(infos: list[dict], results: list[dict], expect_world_size: int | None, min_busbw_gbps: float) -> list[str]:
    """What to fix before training, one line each (empty when nothing looks wrong)."""
    problems = []
    world = len(infos)
    if expect_world_size and expect_world_size != world:
        problems.append(f"world size {world}, expected {expect_world_size}: check --nnodes/--nproc-per-node and that "
                        f"every node joined the rendezvous")
    per_host: dict[str, int] = {}
    for info in infos:
        per_host[info["host"]] = per_host.get(info["host"], 0) + 1
    if len(set(per_host.values())) > 1:
        problems.append("nodes run different numbers of ranks (" + ", ".join(f"{h}: {n}" for h, n in per_host.items())
                        + "): give every node the same --nproc-per-node")
    consumer = [i for i in infos if any(word in i["device_name"] for word in CONSUMER_GPUS)]
    if consumer and per_host[consumer[0]["host"]] > 1 and not os.environ.get("NCCL_P2P_DISABLE"):
        no_peer = any(not ok for i in consumer for ok in i.get("peer_access", {}).values())
        problems.append(f"consumer GPUs ({consumer[0]['device_name']}){' without peer access' if no_peer else ''}: "
                        f"if a job hangs at its first collective, set NCCL_P2P_DISABLE=1")
    if len(per_host) > 1 and results:
        largest = max((r for r in results if r["op"] == "all_reduce"), key=lambda r: r["bytes"])
        if largest["busbw_gbps"] < min_busbw_gbps:
            problems.append(f"all-reduce bus bandwidth between nodes is {largest['busbw_gbps']:.2f} GB/s at "
                            f"{largest['bytes'] / 2**20:.0f} MiB (under {min_busbw_gbps} GB/s): check the interface "
                            f"(NCCL_SOCKET_IFNAME) and InfiniBand/RoCE (NCCL_IB_DISABLE must not be set)")
    return problems


def run(sizes_mb: list[float], iters: int, expect_world_size: int | None = None, min_busbw_gbps: float = 5.0,
        print_fn=print) -> dict:
    """The preflight on the current process group; every rank must call it. Returns the report (on every rank)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    infos: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(infos, rank_info(device))
    world = len(infos)
    results = []
    for op in ("all_reduce", "all_gather"):
        for size_mb in sizes_mb:
            n_bytes = int(size_mb * 2**20)
            seconds = time_collective(op, n_bytes, device, iters)
            slowest = torch.tensor(seconds, dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective is as slow as its slowest rank
            seconds = float(slowest)
            algbw = n_bytes / seconds / 1e9
            results.append(dict(op=op, bytes=n_bytes, ms=seconds * 1e3, algbw_gbps=algbw,
                                busbw_gbps=algbw * bus_factor(op, world)))
    problems = checks(infos, results, expect_world_size, min_busbw_gbps)
    report = dict(world_size=world, ranks=infos, collectives=results, problems=problems)
    if dist.get_rank() == 0:
        hosts = len({info["host"] for info in infos})
        print_fn(f"preflight: {world} ranks on {hosts} node(s), backend {infos[0]['backend']}")
        for info in infos:
            links = info.get("peer_access")
            print_fn(f"  rank {info['rank']}: {info['host']} local rank {info['local_rank']} {info['device']} "
                     f"({info['device_name']})" + (f" peer access {links}" if links else ""))
        print_fn("| collective | size | time (ms) | algbw (GB/s) | busbw (GB/s) |\n|---|---|---|---|---|")
        for r in results:
            print_fn(f"| {r['op']} | {r['bytes'] / 2**20:g} MiB | {r['ms']:.3f} | {r['algbw_gbps']:.2f} | "
                     f"{r['busbw_gbps']:.2f} |")
        print_fn("\n".join(f"problem: {p}" for p in problems) if problems else "no problem found")
    return report


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description="Time the collectives of this launch before a long job.")
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 16, 128], help="buffer sizes, MiB")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per size")
    parser.add_argument("--expect-world-size", type=int, help="the world size the job is meant to have")
    parser.add_argument("--min-busbw-gbps", type=float, default=5.0, help="flag a slower link between nodes")
    parser.add_argument("--timeout-s", type=int, default=120, help="a collective that takes longer fails")
    parser.add_argument("--json", help="also write the report here (rank 0)")
    args = parser.parse_args(argv)
    own_group = not dist.is_initialized()
    if own_group:
        if "WORLD_SIZE" not in os.environ:
            raise SystemExit("common.preflight times collectives between ranks: launch it with torchrun "
                             "(uv run torchrun --nproc_per_node=2 -m common.preflight)")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=timedelta(seconds=args.timeout_s))
    try:
        report = run(args.sizes_mb, args.iters, args.expect_world_size, args.min_busbw_gbps)
    except (RuntimeError, dist.DistBackendError) as error:
        raise SystemExit(f"preflight: a collective failed ({type(error).__name__}: {str(error).splitlines()[0]}); "
                         f"if it hung until the timeout on consumer GPUs, try NCCL_P2P_DISABLE=1") from None
    if args.json and dist.get_rank() == 0:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=2)
    if own_group:
        dist.destroy_process_group()
    return report


if __name__ == "__main__":
    main()
