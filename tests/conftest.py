import importlib.util
import os
import sys
from pathlib import Path

import pytest

# One intra-op thread in this process and in every process a test starts, as torchrun gives each rank
# (OMP_NUM_THREADS=1), set before torch is imported: the tiny models of the tests gain nothing from a second thread,
# and on a 2-core machine doing other work OpenMP's threads spin waiting for each other (two of test_single_ft.py's
# training tests: 93 s of CPU with 2 threads, 21 s with 1).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO_ROOT = Path(__file__).resolve().parent.parent
SAMPLE_DATA = REPO_ROOT / "assets" / "data" / "sft_en.jsonl"


def load_experiment(name: str):
    """Import experiments/<name>/train.py as a module, so tests can call its main(argv) in-process."""
    path = REPO_ROOT / "experiments" / name / "train.py"
    spec = importlib.util.spec_from_file_location(f"{name.replace('-', '_')}_train", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_infer():
    """experiments/infer.py, imported as a module (it is not a train.py, so not through load_experiment)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("infer", REPO_ROOT / "experiments" / "infer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(items):
    """The quick tier (`uv run pytest -m quick`, a few minutes on 2 cores) is every test not marked slow: the unit
    tests of common/, the formulas, the documentation's commands and the posts' regions. The slow ones are the
    torchrun launches that hold each experiment to single-ft, and training runs; CI runs everything."""
    for item in items:
        if item.get_closest_marker("slow") is None:
            item.add_marker(pytest.mark.quick)


@pytest.fixture(scope="session")
def tokenizer():
    from common.models import load_tokenizer

    return load_tokenizer("qwen3-tiny")


@pytest.fixture(scope="session")
def small_data(tmp_path_factory) -> Path:
    """The first 400 conversations of the sample data: enough for a few steps and an eval split, fast to build."""
    path = tmp_path_factory.mktemp("data") / "small.jsonl"
    lines = SAMPLE_DATA.read_text(encoding="utf-8").splitlines(keepends=True)[:400]
    path.write_text("".join(lines), encoding="utf-8")
    return path


def sharegpt(record):
    return {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                               "value": m["content"]} for m in record["messages"]]}


@pytest.fixture(scope="session")
def formats(tmp_path_factory, small_data):
    """small_data written as parquet, as a ShareGPT JSON array, as a save_to_disk folder (a DatasetDict), and its
    single-turn records as a CSV with its own column names; plus the JSONL each must read the same as."""
    import json

    import datasets

    root = tmp_path_factory.mktemp("formats")
    records = [json.loads(line) for line in small_data.read_text().splitlines()]
    datasets.Dataset.from_list(records).to_parquet(root / "data.parquet")
    (root / "sharegpt.json").write_text(json.dumps([sharegpt(r) for r in records]))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records),
                          "test": datasets.Dataset.from_list(records[:5])}).save_to_disk(root / "saved")
    pairs = [r["messages"] for r in records if len(r["messages"]) == 2 and r["messages"][0]["role"] == "user"]
    datasets.Dataset.from_list([{"question": q["content"], "answer": a["content"]} for q, a in pairs]).to_csv(
        root / "pairs.csv", index=False)
    (root / "pairs.jsonl").write_text("".join(json.dumps({"prompt": q["content"], "completion": a["content"]}) + "\n"
                                              for q, a in pairs))
    return root


def torchrun(experiment: str, runs: list[list], nproc: int = 2, timeout: int = 3600, nodes: int = 1):
    """Launch tests/run_many.py under torchrun with `nproc` ranks; fail with the ranks' output if it fails.
    nodes > 1: that many torchrun agents (nproc / nodes ranks each) meet at a c10d rendezvous on localhost, as the
    nodes of a multi-node job do, so LOCAL_RANK differs from RANK. Returns the finished process (stdout, stderr).

    A hang ends sooner, as a failed collective (run_many's collective timeout); `timeout` only bounds a launch that
    keeps computing, e.g. on a machine shared with other work. When it runs out, the ranks are asked for their
    threads' stacks (faulthandler) before they are killed, and those are in the failure's message."""
    import json
    import signal
    import socket
    import subprocess
    import tempfile
    import time

    from common.soak import descendants, kill_tree

    script = [str(REPO_ROOT / "tests" / "run_many.py"), experiment, json.dumps([[str(a) for a in r] for r in runs])]
    if nodes == 1:
        agents = [[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
                   *script]]
    else:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        agents = [[sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", f"--node-rank={node}",
                   f"--nproc-per-node={nproc // nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                   f"--rdzv-id={experiment}", *script] for node in range(nodes)]
    # Output into files, not pipes: an agent blocked on a full pipe that nobody reads (while this process waits on
    # another agent) would stop its ranks, and with them every other rank at the next collective.
    with tempfile.TemporaryDirectory() as logs:
        files = [(open(f"{logs}/{i}.out", "w+"), open(f"{logs}/{i}.err", "w+")) for i in range(len(agents))]
        processes = [subprocess.Popen(agent, cwd=REPO_ROOT, stdout=out, stderr=err, text=True)
                     for agent, (out, err) in zip(agents, files)]
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            for process in processes:
                process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
            for process in processes:
                for pid in descendants(process.pid):
                    try:
                        os.kill(pid, signal.SIGUSR1)
                    except ProcessLookupError:
                        pass
                    time.sleep(1)  # one rank at a time, so that their stacks do not interleave
            time.sleep(3)
            for process in processes:
                kill_tree(process)
        outputs = []
        for out, err in files:
            out.seek(0), err.seek(0)
            outputs.append((out.read(), err.read()))
            out.close(), err.close()
    result = subprocess.CompletedProcess(agents, max(p.returncode for p in processes),
                                         "".join(out for out, _ in outputs), "".join(err for _, err in outputs))
    if timed_out:
        raise AssertionError(f"torchrun {experiment} still running after {timeout} s; the ranks' threads then:\n"
                             f"{result.stderr[-20000:]}")
    if result.returncode != 0:
        raise AssertionError(f"torchrun {experiment} failed ({result.returncode}):\n{result.stdout[-5000:]}\n"
                             f"{result.stderr[-10000:]}")
    # A run that worked also ends cleanly: no collective issued and never waited on (torch lists them when the
    # process exits), no abort after the summary.
    for sign in UNCLEAN_EXIT:
        assert sign not in result.stderr, f"torchrun {experiment}: {sign!r} at exit:\n{result.stderr[-5000:]}"
    return result


UNCLEAN_EXIT = ("unwaited collective calls", "terminate called")


def read_losses(out_dir: Path) -> list[float]:
    import json

    return [json.loads(line)["loss"] for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
