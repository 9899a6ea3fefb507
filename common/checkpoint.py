"""Sharded, atomic training checkpoints with torch.distributed.checkpoint (DCP).

Layout of a checkpoint, --resume, atomicity and resharding: see common/README.md."""

from __future__ import annotations

import json
import random
import shutil
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from common.dist import print0

# Optimizer entries per parameter name, not group index: pipeline stages' groups would collide (common/README.md).
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
# QLoRA's 4-bit base is reloaded from its source, not restored: only the trainable parameters are saved.
TRAINABLE_ONLY = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True, strict=False)


@contextmanager
def _alone_is_expected() -> Iterator[None]:
    """Silences DCP's warning that one process without a process group saves and loads alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield


def _state_dicts(model, optimizer) -> tuple[dict, dict, StateDictOptions]:
    """The model and optimizer state to save or to fill, and the options to restore them with."""
    if all(parameter.is_floating_point() for parameter in model.parameters()):
        return *get_state_dict(model, optimizer, options=OPTIONS), OPTIONS
    model_state, optimizer_state = get_state_dict(model, optimizer, options=TRAINABLE_ONLY)
    trainable = {name.removeprefix("module.") for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model_state.items() if k in trainable}, optimizer_state, TRAINABLE_ONLY


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _rng_state() -> dict:
    """The RNG states as tensors and plain types (weights_only=True reads them); Python's as an int64 tensor."""
    version, words, gauss_next = random.getstate()
    state = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
             "python_version": version, "python_gauss_next": gauss_next}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    python = state["python"]
    if isinstance(python, torch.Tensor):
        python = (state["python_version"], tuple(python.tolist()), state["python_gauss_next"])
    random.setstate(python)  # a checkpoint written before the tensor form holds the plain tuple
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def checkpoint_dir(out_dir: str | Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"step-{step}"


@contextmanager
def _published(out_dir: str | Path, step: int) -> Iterator[Path]:
    """Yield an empty `step-<k>.tmp/` for every rank to write into; publish it as `step-<k>/` once all have."""
    final = checkpoint_dir(out_dir, step)
    temporary = final.with_name(final.name + ".tmp")
    if _rank() == 0:
        shutil.rmtree(temporary, ignore_errors=True)  # the leftovers of a save that crashed
        temporary.mkdir(parents=True)
    _barrier()
    yield temporary
    _barrier()  # every rank's files are on disk before the rename publishes them
    if _rank() == 0:
        if final.exists():
            shutil.rmtree(final)
        temporary.rename(final)
    _barrier()


def _check_resumable(path: Path) -> None:
    if path.name.endswith(".tmp"):
        raise SystemExit(f"{path} is an unfinished checkpoint (a save was interrupted): resume from a step-<k> folder")
    if not path.is_dir():
        raise SystemExit(f"{path} is not a checkpoint folder (expected <out-dir>/checkpoints/step-<k>)")
    if problem := checkpoint_problem(path):
        raise SystemExit(f"--resume {path}: {problem}")


def _zip_problem(file: Path) -> str | None:
    """torch.save writes a zip archive whose index sits at its end: a file cut short has none."""
    try:
        with zipfile.ZipFile(file):
            return None
    except (zipfile.BadZipFile, OSError):
        return f"{file} is damaged (not a whole torch.save archive: {file.stat().st_size:,} bytes)"


def _read_trainer_state(file: Path) -> dict:
    """The trainer state with weights_only=True: tensors and plain types, never arbitrary pickled objects."""
    try:
        return torch.load(file, weights_only=True)
    except Exception as error:  # UnpicklingError names the object weights_only refused; damage raises others
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise SystemExit(f"{file}: not readable as tensors and plain types (torch.load weights_only=True: "
                         f"{first}); refusing to unpickle it") from None


def checkpoint_problem(path: Path) -> str | None:
    """What makes a step-<k> folder unusable, naming the file; None when it is whole."""
    if path.name.endswith(".tmp"):
        return f"{path} is unfinished (a save was interrupted)"
    if not path.is_dir():
        return f"{path} is not a folder"
    identity = path / IDENTITY_FILE
    if identity.exists():
        try:
            json.loads(identity.read_text())
        except (ValueError, UnicodeDecodeError):
            return f"{identity} is not readable JSON ({identity.stat().st_size:,} bytes)"
    trainer = path / "trainer_state_rank0.pt"
    if not trainer.exists() and not (path / ".metadata").exists():  # DeepSpeed's own format (zero-ft, pp-ds-ft)
        files = sorted(path.glob("*.pt"))
        if not files:
            return f"{path} holds no checkpoint files (neither DCP's .metadata nor DeepSpeed's *.pt)"
        return next((problem for file in files if (problem := _zip_problem(file))), None)
    if not trainer.exists():
        return f"{trainer} is missing"
    metadata_file = path / ".metadata"
    if not metadata_file.exists():
        return f"{metadata_file} is missing"
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception:  # a cut-short pickle raises any of several errors
        return f"{metadata_file} is damaged (unreadable, {metadata_file.stat().st_size:,} bytes)"
    written: dict[str, int] = {}
    for info in metadata.storage_data.values():
        written[info.relative_path] = max(written.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(written.items()):
        file = path / name
        if not file.exists():
            return f"{file} is missing (named in .metadata)"
        if file.stat().st_size < size:
            return f"{file} is cut short: {file.stat().st_size:,} bytes of the {size:,} written"
    for file in sorted(path.glob("trainer_state_rank*.pt")):
        if problem := _zip_problem(file):
            return problem
    try:
        _read_trainer_state(trainer)
    except SystemExit as stop:
        return str(stop.code)
    return None


def find_checkpoint(path: str | Path, experiment: str, print_fn=print0) -> Path:
    """The step-<k> folder `--resume` names, damaged ones skipped with their reason."""
    if str(path) == "latest":
        runs = sorted(Path("runs").glob(f"{experiment}-*"), key=lambda run: run.stat().st_mtime, reverse=True)
        found = _first_sound([step for run in runs for step in _complete(run / "checkpoints")], print_fn)
        if found is None:
            raise SystemExit(f"--resume latest: no run under {Path('runs').resolve()}/{experiment}-* has a complete "
                             f"checkpoint (--checkpoint-every N writes them); name the run folder instead")
        return found
    path = Path(path)
    if path.name.startswith("step-"):
        _check_resumable(path)
        return path
    for folder in (path / "checkpoints", path):
        if folder.is_dir() and (candidates := _complete(folder)):
            if (found := _first_sound(candidates, print_fn)) is not None:
                return found
            raise SystemExit(f"--resume {path}: every checkpoint in it is damaged (the newest: "
                             f"{checkpoint_problem(candidates[0])})")
    if not path.is_dir():
        raise SystemExit(f"--resume {path}: no such folder (a run folder, its checkpoints/step-<k>, or latest)")
    unfinished = sorted(path.glob("**/step-*.tmp"))
    raise SystemExit(f"--resume {path}: no complete checkpoint in it"
                     + (f" (only the unfinished {unfinished[-1].name}: its save was interrupted)" if unfinished
                        else " (--checkpoint-every N writes them)"))


def _first_sound(candidates: list[Path], print_fn) -> Path | None:
    """The first checkpoint that passes checkpoint_problem; each one skipped is printed with its reason."""
    for candidate in candidates:
        problem = checkpoint_problem(candidate)
        if problem is None:
            return candidate
        print_fn(f"--resume: skipping {candidate}: {problem}")
    return None


def _complete(folder: Path) -> list[Path]:
    """The published step-<k> folders under `folder`, newest first."""
    steps = [child for child in folder.glob("step-*") if child.is_dir() and child.name.removeprefix("step-").isdigit()]
    return sorted(steps, key=checkpoint_step, reverse=True)


def checkpoint_step(path: str | Path) -> int:
    """k of a step-<k> folder: the optimizer steps it holds."""
    return int(Path(path).name.removeprefix("step-"))


_resumed_from: set[Path] = set()  # the checkpoints this process loaded: --keep-checkpoints never deletes them


def prune_checkpoints(out_dir: str | Path, keep: int) -> list[Path]:
    """Rank 0 deletes the checkpoints older than the newest `keep` (0 keeps all) but the resumed one; returns them."""
    if keep <= 0 or _rank() != 0:
        return []
    deleted = []
    for old in _complete(Path(out_dir) / "checkpoints")[keep:]:
        if old.resolve() not in _resumed_from:
            shutil.rmtree(old)
            deleted.append(old)
    return deleted


IDENTITY_FILE = "run.json"
IDENTITY_NAMES = dict(experiment="experiment", model="--model", data="--data", seq_len="--seq-len",
                      packing="--packing", rows_per_step="rows per step (B)", seed="--seed", lora_rank="--lora-rank")


def check_identity(path: str | Path, identity: dict, allow: bool = False, print_fn=print) -> None:
    """Stop when the checkpoint's run differs in what fixes its steps; `allow` (--resume-anyway) warns."""
    file = Path(path) / IDENTITY_FILE
    if not file.exists():
        print_fn(f"note: {path} records no run identity (written before run.json existed): not checked")
        return
    written = json.loads(file.read_text())
    differs = []
    for key, name in IDENTITY_NAMES.items():
        if key == "data" and written.get(key) != identity.get(key):
            fields = [f"{field} {written[key].get(field)} -> {identity[key].get(field)}"
                      for field in identity[key] if written[key].get(field) != identity[key].get(field)]
            differs.append(f"{name} ({', '.join(fields)})")
        elif key != "data" and written.get(key) != identity.get(key):
            differs.append(f"{name} {written.get(key)} -> {identity.get(key)}")
    if not differs:
        return
    what = "; ".join(differs)
    if not allow:
        raise SystemExit(f"--resume {path}: the checkpoint is of another run: {what}. Its steps would not continue "
                         f"this run's; --resume-anyway resumes from it all the same")
    print_fn(f"--resume-anyway: resuming from a checkpoint of another run ({what})")


def _write_identity(folder: Path, run: dict | None) -> None:
    if run is not None and _rank() == 0:
        (folder / IDENTITY_FILE).write_text(json.dumps(run, indent=2) + "\n")


def save_checkpoint(out_dir: str | Path, step: int, model, optimizer, scheduler, run: dict | None = None,
                    keep: int = 0) -> Path:
    """Save after optimizer step `step` (1-based) with the run's identity `run`; returns the folder."""
    with _published(out_dir, step) as temporary:
        model_state, optimizer_state, _ = _state_dicts(model, optimizer)
        with _alone_is_expected():
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=temporary)
        _write_identity(temporary, run)
        torch.save({"step": step, "scheduler": scheduler.state_dict(), "rng": _rng_state()},
                   temporary / f"trainer_state_rank{_rank()}.pt")
    prune_checkpoints(out_dir, keep)
    return checkpoint_dir(out_dir, step)


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> int:
    """Restore model, optimizer, scheduler and RNG in place from a `step-<k>` folder; returns k."""
    path = Path(path)
    _check_resumable(path)
    trainer_file = path / f"trainer_state_rank{_rank()}.pt"
    if not trainer_file.exists():
        # written by fewer ranks (DCP reshards): rank 0's step, schedule and RNG are every rank's
        trainer_file = path / "trainer_state_rank0.pt"
    model_state, optimizer_state, options = _state_dicts(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    with _alone_is_expected():
        dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
                   options=options)
    trainer = _read_trainer_state(trainer_file)
    scheduler.load_state_dict(trainer["scheduler"])
    _set_rng_state(trainer["rng"])
    _resumed_from.add(path.resolve())
    return trainer["step"]
