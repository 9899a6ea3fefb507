"""The repository as the generators see it: which files git tracks, the committed runs (loaded once, each run a
region reads recorded for the page's provenance), and the context a generator is called with."""

from __future__ import annotations

import glob
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from run_files import Run, load_run, run_folders

from .engine import RegionError

RUNS_DIR = "devlog/data/"  # every run a page quotes is committed under it


def tracked_files(root: Path) -> set[str] | None:
    """Paths git tracks (and their folders), or None when root is not the top of a git checkout."""
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, check=True).stdout.strip()
        if Path(top).resolve() != root.resolve():
            return None
        listing = subprocess.run(["git", "-C", str(root), "ls-files", "-z"], capture_output=True, text=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    files = {path for path in listing.split("\0") if path}
    folders = {str(parent) for path in files for parent in Path(path).parents if str(parent) != "."}
    return files | folders


class Site:
    """The repository root, which files git tracks (checked only in --check mode), and the runs read so far."""

    def __init__(self, root: Path, check_commits: bool):
        self.root = root.resolve()
        self.tracked = tracked_files(self.root) if check_commits else None
        self.loaded: dict[str, Run] = {}
        self.recording: list[Run] | None = None  # while a page renders: every run its regions read (provenance)

    def relative(self, path: Path) -> str:
        return path.resolve().relative_to(self.root).as_posix()

    def file(self, name: str) -> Path:
        """A file named by a region: it must exist inside the repository (and be tracked, when checking)."""
        path = (self.root / name).resolve()
        if not path.is_relative_to(self.root):
            raise RegionError(f"{name} is outside the repository")
        if not path.is_file():
            raise RegionError(f"no file {name}")
        self.require_tracked(self.relative(path))
        return path

    def require_tracked(self, name: str) -> None:
        if self.tracked is not None and name not in self.tracked:
            raise RegionError(f"{name} is not committed (git does not track it): `git add` it, or CI fails")

    def run(self, name: str) -> Run:
        name = name.strip().rstrip("/")
        if not name.startswith(RUNS_DIR):
            raise RegionError(f"run '{name}' is not under {RUNS_DIR} (the runs pages quote are committed there)")
        if name not in self.loaded:
            folder = (self.root / name).resolve()
            if not folder.is_relative_to(self.root) or not (folder / "summary.json").is_file():
                raise RegionError(f"run {name} has no summary.json")
            self.require_tracked(f"{name}/summary.json")
            if (folder / "metrics.jsonl").exists():
                self.require_tracked(f"{name}/metrics.jsonl")
            run = load_run(folder)
            if run.summary.get("mfu") is not None and "flops_per_token" not in run.summary:
                # An MFU of an older count (6 FLOPs per weight under LoRA, attention over whole rows) is not shown.
                raise RegionError(f"run {name}: its MFU predates the per-step FLOPs (no flops_per_token in its "
                                  f"summary.json): recount its steps into it before a page quotes it")
            self.loaded[name] = run
        if self.recording is not None and self.loaded[name] not in self.recording:
            self.recording.append(self.loaded[name])
        return self.loaded[name]

    def runs(self, spec: str, allow_missing: bool = False) -> list[Run]:
        """`runs=`: comma-separated run folders or globs, in the order given (a glob's matches sorted)."""
        result: list[Run] = []
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            if not item.startswith(RUNS_DIR):
                raise RegionError(f"runs: '{item}' is not under {RUNS_DIR} (the runs pages quote are committed there)")
            if glob.has_magic(item):
                names = [self.relative(folder) for folder in run_folders(self.root, item)]
                if not names and not allow_missing:
                    raise RegionError(f"runs: '{item}' matches no run folder (a folder holding summary.json)")
            else:
                names = [item.rstrip("/")]
                if allow_missing and not (self.root / item / "summary.json").is_file():
                    names = []
            for name in names:
                run = self.run(name)
                if run not in result:
                    result.append(run)
        if not result and not allow_missing:
            raise RegionError("runs: no run given")
        return result


@dataclass
class Context:
    """What a generator may read: the repository and the page it writes into."""
    site: Site
    page: str  # the page's path relative to the repository root
    line: int = 0  # the line of the region being generated
    figures: dict[str, int] = field(default_factory=dict)  # figure name -> line of a region that shows it
    page_runs: list[Run] = field(default_factory=list)  # every run the page's other regions read (provenance)

    def link(self, target: str) -> str:
        """A relative link from the page to a path given relative to the repository root."""
        page_folder = (self.site.root / self.page).parent
        link = os.path.relpath(self.site.root / target, page_folder).replace(os.sep, "/")
        return link + ("/" if target.endswith("/") else "")
