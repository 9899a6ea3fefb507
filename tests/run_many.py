"""Run one experiment's main() for several argument lists in a single torchrun launch.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/run_many.py <experiment> '<json list of argv lists>'

A torchrun launch costs ~15 s of imports on a small CPU, so the 2-rank tests put all their configurations into
one launch. The process group is created once here and reused by every main() (init_distributed sees it).
Each configuration writes its own --out-dir; the pytest side reads metrics.jsonl / summary.json from there.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import load_experiment  # noqa: E402


def main() -> None:
    experiment, runs = sys.argv[1], json.loads(sys.argv[2])
    module = load_experiment(experiment)
    # Created here, not by init_distributed, so that no main() tears it down between configurations.
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    for argv in runs:
        module.main(argv)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
