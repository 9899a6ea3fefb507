import importlib.util
import sys
from pathlib import Path

import pytest

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
