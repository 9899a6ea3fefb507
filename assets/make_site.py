"""Build the series as a static site (Material for MkDocs), offline, from blogs/: the posts stay the single source.

    uv run python assets/make_site.py            # stage into build/docs, build build/site (--strict)
    uv run python assets/make_site.py --check    # fail where build/ is not what this checkout builds
    python3 -m http.server --bind 127.0.0.1 --directory build/site 8000   # then open http://127.0.0.1:8000/

Three steps, each a function below:
1. stage(): copy blogs/*.md into build/docs (blogs/README.md, the series' index, becomes the site's index.md), with
   the figures and diagrams they show (assets/plots, assets/diagrams); rewrite every link to another repository file
   (devlog/, experiments/, assets/*.py, ...) to the repository's web address at the built commit, so the markdown in
   blogs/ still reads right on a git host; let markdown inside <details> render (md_in_html); end every post with the
   commit its numbers come from; add the "will it fit" page and its script (assets/site/). A link to a file that does
   not exist, a figure that is missing or a heading that no page has stops the build with one line per problem.
2. export_ladders(): common.memory's ladder (common.memory.Ladder, what `python -m common.memory --json` prints) for
   every preset model, GPU count, sequence length and training the calculator offers, one file per model and GPU
   count (build/docs/fit/<model>/<gpus>.json) and an index (build/docs/fit/index.json). The page walks a ladder and
   takes the first rung whose peak with its margin (x (1 + ERROR_BAND)) is within the GPU's usable memory, which is
   what recommend() answers (tests/test_site.py holds
   it to that); Python stays the only implementation of the memory model.
3. mkdocs build --strict (mkdocs.yml at the repository root: no plugin that fetches, no web fonts, the search index
   built locally), which fails on a link to a page or heading that does not exist.

The repository's web address is mkdocs.yml's `extra.repository`, or `--repo-url` (the `origin` remote's address when
it is a web one). MkDocs 1.x is frozen and Material announces its end of life for 2027: mkdocs.yml keeps to plain
settings (theme palette and features, the search and glightbox plugins, Python-Markdown extensions) that a successor
reading MkDocs configurations can take over.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(1, str(REPO_ROOT))  # `common`, also for `python3 assets/make_site.py` without an install

from posts.markup import FENCE, LINK, fence_toggle, heading_anchors, masked_code_spans  # noqa: E402

SITE_SOURCES = Path("assets/site")  # the calculator page, its script and the site's stylesheet
FIGURE_DIRS = ("assets/plots", "assets/diagrams")  # copied into the site when a page links them
FIGURE_SUFFIXES = (".png", ".svg", ".csv")
POST = re.compile(r"^\d\d-[\w-]+\.md$")
# What the calculator offers: every preset (the published sizes and the CPU-sized ones), 1 to 8 GPUs (one node; more
# with python -m common.memory --gpus N --nodes K), sequence lengths by powers of two, three trainings. Each model and
# GPU count is one file of every sequence length and training (a few hundred kB for the real sizes).
FIT_GPUS = tuple(range(1, 9))
FIT_SEQ_LENS = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
PARTS = ("weights", "grads", "optimizer", "master", "copies", "activations", "logits", "buffers")


class BuildError(Exception):
    """What stops the build: one line per problem."""


def git(*args: str, root: Path = REPO_ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def built_commit(root: Path) -> str:
    """The commit the site is built from, `-dirty` when the files it shows differ from it."""
    try:
        commit = git("rev-parse", "HEAD", root=root)
        changed = git("status", "--porcelain", "--", "blogs", "devlog", "assets", "common", "experiments", root=root)
    except (subprocess.CalledProcessError, FileNotFoundError):
        return "unknown"
    return commit + ("-dirty" if changed else "")


def mkdocs_settings(root: Path) -> dict:
    """mkdocs.yml read as plain YAML (its !!python tags resolved to nothing: only plain keys are read here)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)
    Loader.add_constructor("!ENV", lambda loader, node: None)
    return yaml.load((root / "mkdocs.yml").read_text(), Loader=Loader)


def web_address(remote: str) -> str | None:
    """A git remote as the address of its web pages (https://host/owner/name), or None for a local one."""
    remote = remote.strip().removesuffix(".git")
    if remote.startswith(("https://", "http://")):
        return re.sub(r"//[^/@]+@", "//", remote)
    match = re.match(r"^(?:ssh://)?git@([^:/]+)[:/](.+)$", remote)
    return f"https://{match.group(1)}/{match.group(2)}" if match else None


def repository_url(root: Path, given: str | None) -> str:
    if given:
        return given.rstrip("/")
    try:
        remote = web_address(git("remote", "get-url", "origin", root=root))
    except (subprocess.CalledProcessError, FileNotFoundError):
        remote = None
    return (remote or mkdocs_settings(root)["extra"]["repository"]).rstrip("/")


# ---------------------------------------------------------------------------------------------------------------
# 1. Staging: blogs/ as the site's pages


def rewrite_links(text: str, page: Path, root: Path, repo_url: str, commit: str, figures: set[str],
                  anchors: dict[str, set[str]]) -> tuple[str, list[str]]:
    """The page with its links rewritten for the site, and one line for every link that leads nowhere. A link to
    another post stays relative (README.md becomes index.md), a figure's becomes its copy in the site, any other
    repository file's goes to its page on the repository's web address at `commit`."""
    errors: list[str] = []
    lines = text.splitlines(keepends=True)
    fence: str | None = None
    ref = commit.removesuffix("-dirty")
    for index, line in enumerate(lines):
        if fence is not None or FENCE.match(line):
            fence = fence_toggle(line, fence)
            continue
        visible = masked_code_spans(line)
        pieces, last = [], 0
        for match in LINK.finditer(visible):
            target = match.group(1)
            replacement = _site_target(target, page, root, repo_url, ref, figures, anchors)
            if replacement.startswith("error: "):
                errors.append(f"{page.relative_to(root).as_posix()}:{index + 1}: {replacement[7:]}")
                continue
            pieces += [line[last:match.start(1)], replacement]
            last = match.end(1)
        lines[index] = "".join(pieces) + line[last:]
    return "".join(lines), errors


def _site_target(target: str, page: Path, root: Path, repo_url: str, ref: str, figures: set[str],
                 anchors: dict[str, set[str]]) -> str:
    from urllib.parse import unquote

    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
        return target  # a URL
    path_part, _, anchor = target.partition("#")
    if not path_part:
        if anchor and anchor not in anchors[page.name]:
            return f"error: the link '{target}' names no heading of this page"
        return target
    resolved = Path(os.path.normpath(page.parent / unquote(path_part)))
    if not resolved.is_relative_to(root):
        return f"error: the link '{target}' leaves the repository"
    if not resolved.exists():
        return f"error: the link '{target}' points to a file that does not exist"
    relative = resolved.relative_to(root).as_posix()
    suffix = f"#{anchor}" if anchor else ""
    if resolved.parent == page.parent and resolved.suffix == ".md":  # another page of the series
        if anchor and anchor not in anchors.get(resolved.name, set()):
            return f"error: the link '{target}' names no heading of {relative}"
        return ("index.md" if resolved.name == "README.md" else resolved.name) + suffix
    if resolved.suffix in FIGURE_SUFFIXES and resolved.parent.relative_to(root).as_posix() in FIGURE_DIRS:
        figures.add(relative)
        return f"figures/{resolved.parent.name}/{resolved.name}{suffix}"
    kind = "tree" if resolved.is_dir() else "blob"
    return f"{repo_url}/{kind}/{ref}/{relative}".rstrip("/") + ("/" if resolved.is_dir() else "") + suffix


DETAILS = re.compile(r"^(\s{0,3})<details(?![^>]*\bmarkdown=)")


def markdown_in_details(text: str) -> str:
    """`<details>` blocks render their markdown (tables, code, lists) on the site as on a git host: Python-Markdown
    needs md_in_html's `markdown` attribute for that, which a git host does not."""
    lines = text.splitlines(keepends=True)
    fence: str | None = None
    for index, line in enumerate(lines):
        if fence is not None or FENCE.match(line):
            fence = fence_toggle(line, fence)
            continue
        lines[index] = DETAILS.sub(r'\1<details markdown="1"', line)
    return "".join(lines)


def provenance_footer(repo_url: str, commit: str) -> str:
    ref = commit.removesuffix("-dirty")
    shown = ref[:12] + (" with uncommitted changes" if commit.endswith("-dirty") else "")
    return (f"\n\n---\n\nThis page was built from commit [`{shown}`]({repo_url}/commit/{ref}) of the repository: "
            f"its numbers are those of the runs its provenance block lists, written into the page at that commit by "
            f"`assets/make_posts.py` (whose `--check` holds every page to the committed runs).\n")


HOME_TITLE = "About the series"  # the home page in the sidebar and the tab title


def stage(root: Path, docs: Path, repo_url: str, commit: str) -> list[str]:
    """Write the site's sources into `docs` (emptied first). Returns the problems found (the build stops on any)."""
    blogs = root / "blogs"
    if docs.exists():
        shutil.rmtree(docs)
    docs.mkdir(parents=True)
    pages = sorted(path for path in blogs.glob("*.md") if POST.match(path.name) or path.name == "README.md")
    if not any(POST.match(path.name) for path in pages):
        return [f"{blogs}: no post (NN-slug.md) to build a site from"]
    anchors = {path.name: heading_anchors(path.read_text()) for path in pages}
    errors: list[str] = []
    figures: set[str] = set()
    for path in pages:
        text, problems = rewrite_links(path.read_text(), path, root, repo_url, commit, figures, anchors)
        errors += problems
        text = markdown_in_details(text)
        if path.name == "README.md":
            # Its own title in the sidebar: its heading is the site's name, which the sidebar already shows above it.
            text = f"---\ntitle: {HOME_TITLE}\n---\n\n{text}"
            text += ("\n## On this site\n\n[Will it fit?](fit.md): pick a model, your GPUs, the sequence length and "
                     "full fine-tuning, LoRA or QLoRA, and see what each strategy needs per GPU, the first that fits "
                     "and the command that runs it.\n")
        else:
            text += provenance_footer(repo_url, commit)
        (docs / ("index.md" if path.name == "README.md" else path.name)).write_text(text)
    for relative in sorted(figures):
        target = docs / "figures" / Path(relative).parent.name / Path(relative).name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / relative, target)
    for source in sorted((root / SITE_SOURCES).iterdir()):
        shutil.copyfile(source, docs / source.name)
    return errors


# ---------------------------------------------------------------------------------------------------------------
# 2. The calculator's data: common.memory's ladders


def fit_models() -> list[str]:
    from common.models import MOE_PRESETS, PRESETS

    return [*PRESETS, *MOE_PRESETS]


def trainings(shape) -> dict[str, dict]:
    """The trainings the page offers, as Ladder's (and the CLI's) settings; a mixture of experts trains in full only
    (the CLI refuses LoRA on one)."""
    from common.memory import DEFAULT_LORA_RANK

    if shape.is_moe:
        return {"full": {}}
    return {"full": {}, "lora": {"lora_rank": DEFAULT_LORA_RANK}, "qlora": {"qlora": True}}


def compact_ladder(rungs: list[dict]) -> dict:
    """Ladder.to_json's rungs without repeating what they share: each rung's strategy, flags, LoRA rank and QLoRA as
    an index into `groups` (in the order they first appear: the order recommend() tries them), its GiB by part in
    PARTS' order rounded to the MiB (the bars), its peak exact (the fit test)."""
    groups: list[list] = []
    compact = []
    for rung in rungs:
        group = [rung["strategy"], rung["flags"], rung["lora_rank"], rung["qlora"]]
        if group not in groups:
            groups.append(group)
        compact.append([groups.index(group), rung["micro_batch_size"], rung["grad_accum"],
                        int(rung["activation_checkpointing"]), rung["peak_gib"], rung["peak_phase"],
                        round(rung["cpu_gib"], 3), [round(rung["parts_gib"][part], 3) for part in PARTS],
                        rung["command"]])
    return dict(groups=groups, rungs=compact)


def export_ladders(out: Path, models: list[str] | None = None, gpu_counts: tuple[int, ...] = FIT_GPUS,
                   seq_lens: tuple[int, ...] = FIT_SEQ_LENS) -> list[Path]:
    """Write fit/index.json and fit/<model>/<gpus>.json under `out`. Returns the files written."""
    from common.memory import DEFAULT_LORA_RANK, DEFAULT_ROWS_PER_GPU, ERROR_BAND, GPU_MEMORY_GIB, USABLE_FRACTION, \
        Ladder, model_shape
    from common.memory.cli import varlen_repeats_kv  # the CLI's own answer for this machine's torch
    from common.models import PRESET_HUB_IDS, count_parameters, model_config

    models = models or fit_models()
    kv_expanded = varlen_repeats_kv()
    written = []
    index_models = []
    for name in models:
        shape = model_shape(name)
        command_model = PRESET_HUB_IDS.get(name, name)  # what the CLI's command names (common.memory.cli)
        offered = trainings(shape)
        index_models.append(dict(name=name, hub_id=PRESET_HUB_IDS.get(name), moe=shape.is_moe,
                                 parameters=count_parameters(model_config(name))["total"], trainings=list(offered)))
        for gpus in gpu_counts:
            ladders = {str(seq_len): {training: compact_ladder(
                Ladder(shape, gpus, seq_len=seq_len, kv_expanded=kv_expanded, **settings).to_json(command_model))
                for training, settings in offered.items()} for seq_len in seq_lens}
            path = out / "fit" / name / f"{gpus}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(dict(model=name, gpus=gpus, ladders=ladders), separators=(",", ":")))
            written.append(path)
    index = dict(models=index_models, gpus=list(gpu_counts), seq_lens=list(seq_lens), parts=list(PARTS),
                 usable_fraction=USABLE_FRACTION, error_band=ERROR_BAND, gpu_memory_gib=GPU_MEMORY_GIB,
                 kv_expanded=kv_expanded,
                 lora_rank=DEFAULT_LORA_RANK, rows_per_gpu=DEFAULT_ROWS_PER_GPU,
                 rung_fields=["group", "micro_batch_size", "grad_accum", "activation_checkpointing", "peak_gib",
                              "peak_phase", "cpu_gib", "parts_gib", "command"],
                 group_fields=["strategy", "flags", "lora_rank", "qlora"])
    path = out / "fit" / "index.json"
    path.write_text(json.dumps(index, indent=1))
    written.append(path)
    return written


# ---------------------------------------------------------------------------------------------------------------
# 3. MkDocs, and the check


def mkdocs_build(root: Path, docs: Path, site: Path) -> None:
    """mkdocs build --strict of the staged sources (any warning, e.g. a link to a missing page or heading, fails)."""
    result = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--config-file",
                             str(root / "mkdocs.yml"), "--site-dir", str(site)],
                            cwd=root, capture_output=True, text=True, env={**os.environ, "SITE_DOCS_DIR": str(docs)})
    if result.returncode:
        lines = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()]
        raise BuildError("mkdocs build --strict failed:\n" + "\n".join(lines[-40:]))


def build(root: Path = REPO_ROOT, out: Path | None = None, repo_url: str | None = None, *, mkdocs: bool = True,
          models: list[str] | None = None, print_fn=print) -> Path:
    """Stage, export and build into `out` (default build/): out/docs, out/site. Returns out/site."""
    root = root.resolve()
    out = (out or root / "build").resolve()
    docs, site = out / "docs", out / "site"
    url, commit = repository_url(root, repo_url), built_commit(root)
    errors = stage(root, docs, url, commit)
    if errors:
        raise BuildError("\n".join(errors))
    files = export_ladders(docs, models)
    print_fn(f"staged {len(list(docs.glob('*.md')))} page(s) from blogs/ at {commit[:12]}, links to {url}; "
             f"{len(files)} ladder file(s) under {docs / 'fit'}")
    if mkdocs:
        mkdocs_build(root, docs, site)
        print_fn(f"built {site} (open it with: python3 -m http.server --bind 127.0.0.1 --directory {site} 8000)")
    return site


def check(root: Path = REPO_ROOT, out: Path | None = None, repo_url: str | None = None,
          models: list[str] | None = None) -> list[str]:
    """What differs between `out`/docs and what this checkout stages and exports now (a stale calculator, a post
    changed since the build): one line per file."""
    root = root.resolve()
    out = (out or root / "build").resolve()
    built = out / "docs"
    if not built.is_dir():
        return [f"{built}: no staged site (run assets/make_site.py)"]
    with tempfile.TemporaryDirectory() as scratch:
        fresh = Path(scratch) / "docs"
        errors = stage(root, fresh, repository_url(root, repo_url), built_commit(root))
        export_ladders(fresh, models)
        for path in sorted(fresh.rglob("*")):
            relative = path.relative_to(fresh)
            if path.is_dir() or (models is not None and relative == Path("fit/index.json")):
                continue  # (the index of a few models' export lists only them)
            mine = built / relative
            if not mine.exists():
                errors.append(f"{mine}: missing (this checkout writes it)")
            elif not filecmp.cmp(path, mine, shallow=False):
                what = "the calculator's ladder" if relative.parts[0] == "fit" else "the page"
                errors.append(f"{mine}: stale ({what} differs from what this checkout writes)")
        if models is None:
            errors += [f"{path}: not written by this checkout" for path in sorted(built.rglob("*"))
                       if path.is_file() and not (fresh / path.relative_to(built)).exists()]
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="build folder (default build/): the staged docs and the site")
    parser.add_argument("--repo-url", help="the repository's web address for links to its files (default: the origin "
                                           "remote's, else mkdocs.yml's extra.repository)")
    parser.add_argument("--check", action="store_true",
                        help="build nothing; fail where the build folder's pages or ladders differ from what this "
                             "checkout writes (a stale calculator)")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(REPO_ROOT, args.out, args.repo_url)
        for problem in problems:
            print(problem)
        print(f"make_site --check: {len(problems)} problem(s)" if problems else "make_site --check: up to date")
        return 1 if problems else 0
    try:
        build(REPO_ROOT, args.out, args.repo_url)
    except BuildError as error:
        print(f"make_site: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
