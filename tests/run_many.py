"""Run one experiment's main() for several argument lists in a single torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/run_many.py <experiment> '<json list of argv lists>'
    python -m torch.distributed.run ... tests/run_many.py + '<json list of [target, *argv] lists>'   # several targets

A torchrun launch costs ~15 s of imports on a small CPU, so the 2-rank tests put all their configurations into
one launch. The process group is created once here and reused by every main() (init_distributed sees it).
Each configuration writes its own --out-dir; the pytest side reads metrics.jsonl / summary.json from there.
"""

import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # the repository root, for common.preflight
from common.dist import DEFAULT_COLLECTIVE_TIMEOUT_S, watch_for_lost_ranks  # noqa: E402
from conftest import load_experiment  # noqa: E402


def main() -> None:
    experiment, runs = sys.argv[1], json.loads(sys.argv[2])
    # "+": each run names its own target first: an experiment, or "preflight" for common.preflight.
    runs = [[experiment, *argv] for argv in runs] if experiment != "+" else runs
    # A launch that runs out of time gets SIGUSR1 from conftest.torchrun before it is killed: every thread's stack
    # then shows whether the ranks were busy (a slow machine) or waiting in a collective (a hang).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Created here, not by init_distributed, so that no main() tears it down between configurations; with the
    # experiments' collective timeout and lost-rank report, so that a hang ends as a failure naming the collective.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                            timeout=timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S))
    if dist.get_world_size() > 1:
        watch_for_lost_ranks(dist.get_rank(), dist.get_world_size(), DEFAULT_COLLECTIVE_TIMEOUT_S)
    modules = {}
    timings = os.environ.get("RUN_MANY_TIMINGS")  # a file: each configuration's wall time, appended by rank 0
    for target, *argv in runs:
        start = time.perf_counter()
        if target == "preflight":
            from common import preflight

            preflight.main(argv)
        else:
            if target not in modules:
                modules[target] = load_experiment(target)
            modules[target].main(argv)
        dist.barrier()
        if timings and dist.get_rank() == 0:
            with open(timings, "a") as f:
                f.write(f"{time.perf_counter() - start:7.1f} s  {target} {' '.join(map(str, argv))}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
