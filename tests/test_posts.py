"""assets/make_posts.py: the generated regions of blogs/ and devlog/, and the check CI runs on them.

The repository itself must pass `make_posts.py --check` (without matplotlib). Everything else runs on a small
synthetic repository in a temporary folder: three fake runs (single-ft, ddp-ft, pp-ft) with known numbers, two
tiny "experiments" to quote and diff, and a two-post blog. Each generator's text is compared with what those
numbers must give; each way a page can disagree with the repository must fail the check, naming file, line and
region. No model is built and matplotlib is never imported.
"""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from common.comm import predict_collectives
from common.memory import predict_state_bytes
from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "assets"))
import make_plots  # noqa: E402
import make_posts  # noqa: E402
from plotting.data import imbalance_floor  # noqa: E402
from posts.engine import GENERATORS, RegionError, find_regions, values_outside_paragraphs  # noqa: E402
from posts.generators.tables import COLUMNS  # noqa: E402
from posts.generators.value import evaluate_runs  # noqa: E402
from posts.pages import pages  # noqa: E402

SERIES = "devlog/data/2026-01-01-test"
SINGLE, DDP, PP = f"{SERIES}/single-ft", f"{SERIES}/ddp-ft", f"{SERIES}/pp-ft"
SINGLE_LOSSES = [5.0, 4.0, 3.0, 2.5, 2.0, 1.9, 1.8]
# Relative differences from single-ft: 1e-7 at step 2, 2e-7 at step 3, 3e-5 at step 6 (past the first 5 steps).
DDP_LOSSES = [5.0, 4.0000004, 3.0000006, 2.5, 2.0, 1.900057, 1.8]
WEIGHTS = 4 * 5_245_440  # qwen3-tiny's fp32 weights


def summary(experiment: str, world: int, **fields) -> dict:
    """A summary.json as the experiments write it, reduced to the fields the generators read."""
    config = dict(model="qwen3-tiny", data="assets/data/sft_en.jsonl", seq_len=64, seed=0, eval_fraction=0.05,
                  packing=True, dtype="fp32", lr=1e-3, warmup_steps=10, weight_decay=0.01, max_grad_norm=1.0,
                  lora_rank=0, micro_batch_size=1, grad_accum=4 // world, steps=len(SINGLE_LOSSES),
                  activation_checkpointing=False)
    config.update(fields.pop("config", {}))
    launcher = "uv run python" if world == 1 else f"uv run torchrun --nproc_per_node={world}"
    result = dict(
        experiment=experiment, commit="abc123def456",
        command=f"{launcher} experiments/{experiment}/train.py --steps 7 --seq-len 64 --out-dir runs/{experiment}",
        config=config, t_eff=256, memory_measure="peak RSS of the process (CPU)", warmup_steps_excluded=2,
        attention=dict(impl="sdpa", sdpa_backends=["flash", "math"], reason="CPU"),
        hardware=dict(device_kind="cpu", device_name="x86_64", device_count=1, world_size=world, torch="2.9.0",
                      cuda=None, hip=None, cpu="Test CPU", cpu_cores=2, python="3.11.7",
                      packages=dict(transformers="5.0.0", peft="0.18.0", deepspeed="0.18.0")),
        model=dict(name="qwen3-tiny", parameters=5_245_440, trainable_parameters=5_245_440),
        mfu=None)
    result.update(fields)
    return result


def write_run(root: Path, name: str, data: dict, losses: list[float]) -> None:
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "summary.json").write_text(json.dumps(data, indent=2))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(dict(step=k + 1, loss=loss)) + "\n"
                                                  for k, loss in enumerate(losses)))


def state(weights: int) -> dict:
    return dict(weights=weights, grads=weights, optimizer=2 * weights + 8, master=0)


EXPERIMENT_A = '''\
"""Experiment a."""


def helper(x):
    return x + 1


@decorated
def train(steps):
    total = 0
    for step in range(steps):
        total += helper(step)
    return total
'''
EXPERIMENT_B = EXPERIMENT_A.replace("total += helper(step)", "total += helper(step)  # no_sync here").replace(
    "    return x + 1", "    return x + 2")


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """A repository with three runs, two experiments and a blog index; pages are added by each test."""
    # Measured as common/comm.py predicts: one 25 MiB bucket holds every gradient, then the step loss.
    ddp_collectives = {"gloo:all_reduce": {"calls": 2.0, "bytes": WEIGHTS + 4.0}}
    write_run(tmp_path, SINGLE, summary(
        "single-ft", 1, step_ms=281.4, comm_ms=0.0, tokens_per_s=3563.2, tokens_per_s_per_device=3563.2,
        peak_mem_gib=0.971, final_loss=1.8, eval_loss=4.166546, state_bytes_per_rank=[state(WEIGHTS)]),
        SINGLE_LOSSES)
    write_run(tmp_path, DDP, summary(
        "ddp-ft", 2, config=dict(bucket_cap_mb=25.0, reduce_every_micro_batch=False), step_ms=283.0, comm_ms=65.2,
        profiled_step_ms=326.0, tokens_per_s=3666.0, tokens_per_s_per_device=1833.0, peak_mem_gib=1.104,
        final_loss=1.8, eval_loss=4.166543, collective_bytes_per_step=ddp_collectives,
        state_bytes_per_rank=[state(WEIGHTS), state(WEIGHTS)]), DDP_LOSSES)
    pp = summary(
        "pp-ft", 2, config=dict(schedule="1f1b", stages_per_rank=1, split=None, grad_accum=4), step_ms=383.0,
        comm_ms=219.0, tokens_per_s=2621.0, tokens_per_s_per_device=1310.5, peak_mem_gib=0.97, final_loss=1.8,
        eval_loss=4.1, pipeline=dict(schedule="1f1b", ranks=2, stages_per_rank=1, microbatches=4, stage_rank=[0, 1],
                                     replicas=1),
        bubble_fraction=0.274, bubble_fraction_per_rank=[0.48, 0.06], busy_ms_per_rank=[100.0, 190.0],
        state_bytes_per_rank=[state(WEIGHTS // 2), state(WEIGHTS // 2)])
    # Measured as the formula says, but rank 1 sent half the bytes of its activation gradients: a mismatch to mark.
    pp_ranks = predict_collectives(pp)
    pp_ranks[1]["gloo:send"] = {"calls": 4, "bytes": pp_ranks[1]["gloo:send"]["bytes"] / 2}
    pp.update(collective_bytes_per_step=pp_ranks[0], collective_bytes_per_step_per_rank=pp_ranks)
    write_run(tmp_path, PP, pp, SINGLE_LOSSES)
    for name, source in (("a", EXPERIMENT_A), ("b", EXPERIMENT_B)):
        (tmp_path / "experiments" / name).mkdir(parents=True)
        (tmp_path / "experiments" / name / "train.py").write_text(source)
    (tmp_path / "blogs").mkdir()
    (tmp_path / "blogs" / "README.md").write_text(
        "# The series\n\n## Posts\n\n1. [First steps](01-first.md)\n2. [Second steps](02-second.md)\n")
    (tmp_path / "blogs" / "02-second.md").write_text("# Second\n")
    return tmp_path


def build(root: Path, check: bool, only: str | None = None) -> tuple[int, list[str]]:
    lines: list[str] = []
    problems = make_posts.build(root, check=check, only=only, figures=False, print_fn=lines.append)
    return problems, lines


def region(kind_and_args: str) -> str:
    return f"<!-- generated:{kind_and_args} -->\n<!-- /generated -->\n"


PROVENANCE = "\n" + region("provenance")  # every page that quotes runs ends with its provenance block


def generated(root: Path, kind_and_args: str, page: str = "blogs/01-first.md") -> str:
    """Write a page holding one block region (and a provenance region when it quotes runs), generate it, and return
    the first region's content."""
    (root / page).write_text(f"# Page\n\n{region(kind_and_args)}")
    problems, lines = build(root, check=False, only=page)
    if problems and any("has no provenance region" in line for line in lines):
        (root / page).write_text(f"# Page\n\n{region(kind_and_args)}{PROVENANCE}")
        problems, lines = build(root, check=False, only=page)
    assert problems == 0, lines
    text = (root / page).read_text()
    first = find_regions(text)[0][0]
    return text[first.start:first.end].strip("\n")


def provenance_of(root: Path, page: str = "blogs/01-first.md") -> str:
    text = (root / page).read_text()
    found = [r for r in find_regions(text)[0] if r.kind == "provenance"]
    return text[found[0].start:found[0].end]


# ---------------------------------------------------------------------------------------------------------------
# The repository


def test_the_repository_passes_the_check_without_matplotlib():
    script = ("import runpy, sys\nsys.argv = ['assets/make_posts.py', '--check']\ncode = 0\n"
              "sys.path.insert(0, 'assets')\n"  # as `python assets/make_posts.py` has it (run_path does not)
              "try:\n    runpy.run_path('assets/make_posts.py', run_name='__main__')\n"
              "except SystemExit as stop:\n    code = stop.code\n"
              "print('matplotlib imported:', 'matplotlib' in sys.modules)\nsys.exit(code)\n")
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=300)
    assert "matplotlib imported: False" in result.stdout, result.stdout + result.stderr
    assert result.returncode == 0, f"make_posts.py --check failed:\n{result.stdout}{result.stderr}"


# The HTML elements a sentence renders into: a paragraph, a list item, a table cell (aligned cells carry a style), a
# heading.
SENTENCE_OPENINGS = ("<p>", "<li>", "<td>", "<td ", "<th>", "<th ", *(f"<h{n}>" for n in range(1, 7)))
SENTENCE_CLOSINGS = ("</p>", "</li>", "</td>", "</th>", *(f"</h{n}>" for n in range(1, 7)))


def test_every_page_renders_each_generated_value_inside_its_sentence():
    """Every page of blogs/ and devlog/, rendered by a CommonMark parser (markdown-it-py, with GFM tables as git hosts
    render them): no inline value lands in an HTML block or a code block, where it would stand outside its
    sentence; and the rendered HTML of each page holds each value inside a paragraph, list item, heading or cell."""
    from markdown_it import MarkdownIt

    renderer = MarkdownIt("commonmark").enable("table")
    inline_values = 0
    for name in pages(REPO_ROOT):
        text = (REPO_ROOT / name).read_text()
        regions = find_regions(text)[0]
        assert values_outside_paragraphs(text, regions) == [], name
        html = renderer.render(text)
        for found in (r for r in regions if r.inline):
            inline_values += 1
            opener = text[found.outer_start:found.start]
            at = html.index(opener)  # comments pass through as raw HTML
            opened = max(html.rfind(tag, 0, at) for tag in SENTENCE_OPENINGS)
            closed = max(html.rfind(tag, 0, at) for tag in SENTENCE_CLOSINGS)
            assert opened > closed, f"{name}:{found.line}: a generated value renders outside its sentence"
    assert inline_values > 100  # the pages do quote their numbers inline


def test_a_value_that_starts_a_line_is_joined_to_its_sentence(site):
    page = site / "blogs" / "01-first.md"
    value = f"<!-- generated:value run={DDP} field=tokens_per_s fmt=\",.0f\" -->3,666<!-- /generated -->"
    page.write_text(f"# P\n\nDDP ran at\n{value}\ntokens/s.\n\n- and in a list item, at\n  {value} tokens/s.\n"
                    + PROVENANCE)
    lines = [line for line in build(site, check=True)[1] if "outside its sentence" in line]
    assert len(lines) == 2 and lines[0].startswith("blogs/01-first.md:4: region '<!-- generated:value") and \
        "CommonMark renders this value as an html block, outside its sentence" in lines[0]
    assert lines[1].startswith("blogs/01-first.md:8: ")
    assert build(site, check=False)[0] == 0  # writing joins each such line to the one before
    assert f"DDP ran at {value}\ntokens/s." in page.read_text()
    assert f"- and in a list item, at {value} tokens/s." in page.read_text()
    assert build(site, check=True)[0] == 0
    page.write_text(f"# P\n\n{value} tokens/s start this paragraph.\n" + PROVENANCE)  # nothing to join it to
    assert build(site, check=False)[0] == 1 and build(site, check=True)[0] == 1


def test_links_to_headings_that_do_not_exist_fail(site):
    page = site / "blogs" / "01-first.md"
    page.write_text("# First\n\n## The `no_sync` trap, again\n\nSee [above](#the-no_sync-trap-again) and "
                    "[the next post](02-second.md#second).\n")
    assert build(site, check=True)[0] == 0
    page.write_text(page.read_text().replace("#second)", "#third)").replace("#the-no_sync-trap-again", "#gone"))
    problems, lines = build(site, check=True)
    assert problems == 2
    assert lines[0] == "blogs/01-first.md:5: the link '#gone' names no heading of this page"
    assert lines[1] == "blogs/01-first.md:5: the link '02-second.md#third' names no heading of blogs/02-second.md"


ABSOLUTE_PATH = re.compile(r"(?:^|[\s=\"'`(])(/(?:[\w.@+-]+/)+[\w.@+-]*)")


def absolute_paths(text: str) -> list[str]:
    """Absolute file paths in a text (URLs aside: a path inside one follows its host name, not a space)."""
    return ABSOLUTE_PATH.findall(text)


def test_commands_are_written_relative_to_the_repository_root():
    """No page, and no command recorded in a committed run, names a folder of the machine it was written on."""
    assert absolute_paths("uv run python /work/x/train.py --out-dir=/tmp/runs/a (see https://host/a/b)") == [
        "/work/x/train.py", "/tmp/runs/a"]
    for name in pages(REPO_ROOT):
        assert absolute_paths((REPO_ROOT / name).read_text()) == [], name
    commands = 0
    for path in sorted((REPO_ROOT / "devlog" / "data").rglob("summary.json")):
        command = json.loads(path.read_text()).get("command")
        if command:
            commands += 1
            assert absolute_paths(command) == [], path.relative_to(REPO_ROOT)
    assert commands > 100


def test_recorded_commands_name_paths_relative_to_the_repository(tmp_path):
    from common.metrics import repository_relative

    root = tmp_path / "checkout"
    assert repository_relative([f"{root}/experiments/a/train.py", "--model", f"{root}/runs/x/model",
                                f"--out-dir={root}/runs/y", "--data", "/elsewhere/data.jsonl", "--steps", "3"],
                               root=root) == [
        "experiments/a/train.py", "--model", "runs/x/model", "--out-dir=runs/y", "--data", "/elsewhere/data.jsonl",
        "--steps", "3"]


# ---------------------------------------------------------------------------------------------------------------
# The check: every way a page can disagree with the repository


def test_generated_pages_pass_and_an_edited_digit_fails_naming_file_line_and_region(site):
    page = site / "blogs" / "01-first.md"
    opener = f"<!-- generated:table runs={SERIES}/* cols=run,step_ms,tok_s -->"
    page.write_text("# First\n\nddp-ft: <!-- generated:value run=" + DDP + " field=tokens_per_s fmt=\",.0f\" -->"
                    "<!-- /generated --> tokens/s.\n\n" + region(f"table runs={SERIES}/* cols=run,step_ms,tok_s")
                    + PROVENANCE)
    assert build(site, check=True)[0] > 0  # not generated yet
    assert build(site, check=False)[0] == 0
    assert "-->3,666<!-- /generated --> tokens/s" in page.read_text()
    problems, lines = build(site, check=True)
    assert problems == 0, lines

    page.write_text(page.read_text().replace("| ddp-ft | 283 |", "| ddp-ft | 284 |"))
    problems, lines = build(site, check=True)
    assert problems == 1
    line = page.read_text().splitlines().index(opener) + 1
    assert lines[0].startswith(f"blogs/01-first.md:{line}: region '<!-- generated:table runs={SERIES}/*")
    assert "'| ddp-ft | 284 |" in lines[0] and "'| ddp-ft | 283 |" in lines[0]

    page.write_text(page.read_text().replace("-->3,666<", "-->3,667<"))
    problems, lines = build(site, check=True)
    assert problems == 2 and any(line.startswith("blogs/01-first.md:3: region '<!-- generated:value")
                                 for line in lines)


def test_a_region_naming_a_missing_run_fails(site):
    (site / "blogs" / "01-first.md").write_text("# First\n\n" + region(f"table runs={SERIES}/fsdp-ft"))
    problems, lines = build(site, check=True)
    assert problems == 1
    assert lines[0].startswith("blogs/01-first.md:3: region '<!-- generated:table") and \
        f"run {SERIES}/fsdp-ft has no summary.json" in lines[0]
    (site / "blogs" / "01-first.md").write_text("# First\n\n" + region(f"table runs={SERIES}/fsdp-*"))
    problems, lines = build(site, check=True)
    assert problems == 1 and f"'{SERIES}/fsdp-*' matches no run folder" in lines[0]


def test_a_run_git_does_not_track_fails(site):
    (site / "blogs" / "01-first.md").write_text("# First\n\n" + region(f"commands runs={SINGLE},{DDP}") + PROVENANCE)
    assert build(site, check=False)[0] == 0
    git = ["git", "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(git + ["init", "-q"], cwd=site, check=True)
    subprocess.run(git + ["add", "."], cwd=site, check=True)
    subprocess.run(git + ["rm", "-q", "--cached", f"{DDP}/summary.json"], cwd=site, check=True)
    problems, lines = build(site, check=True)
    assert problems == 1 and lines[0].startswith("blogs/01-first.md:3: region '<!-- generated:commands")
    assert f"{DDP}/summary.json is not committed" in lines[0]  # the only error: the provenance waits for it
    subprocess.run(git + ["add", "."], cwd=site, check=True)
    assert build(site, check=True)[0] == 0


def test_a_broken_link_fails(site):
    (site / "blogs" / "01-first.md").write_text(
        "# First\n\nSee [the code](../experiments/a/train.py), [the index](README.md#posts),\n"
        "[a site](https://example.org) and ![a plot](../assets/plots/none.png).\n")
    problems, lines = build(site, check=True)
    assert problems == 1
    assert lines[0] == "blogs/01-first.md:4: the link '../assets/plots/none.png' points to a file that does not exist"


def test_a_hand_typed_measurement_in_a_table_fails_unless_marked(site):
    page = site / "blogs" / "01-first.md"
    page.write_text(textwrap.dedent("""\
        # First

        | run | tokens/s |
        |---|---|
        | ddp-ft | 3,666 tok/s |

        | run | step_ms | note |
        |---|---|---|
        | ddp-ft | 283 | speed-up 1.36x |
        | ddp-ft | 283 | as typed |

        | strategy | formula | bytes |
        |---|---|---|
        | ZeRO-1 | 2 Psi + 2 Psi + 12 Psi / N | 16 GB <!-- not-measured -->
        | ddp | GA 4, 2 ranks | 2 x 4 |
        | published 2 x MI100 demo | micro 1, GA 1 | 2,239 tok/s <!-- cited -->
        """))
    problems, lines = build(site, check=True)
    assert problems == 3, lines
    assert lines[0].startswith("blogs/01-first.md:5: measured-looking '3,666 tok/s' in a table row outside any region")
    assert lines[1].startswith("blogs/01-first.md:9: measured-looking '1.36x'")
    assert lines[2].startswith("blogs/01-first.md:10: hand-typed '283' under 'step_ms'")


def test_unclosed_and_nested_regions_fail_but_quoted_markers_are_text(site):
    page = site / "blogs" / "01-first.md"
    page.write_text(f"# First\n\n<!-- generated:commands runs={SINGLE} -->\ntext\n")
    assert "is not closed" in build(site, check=True)[1][0]
    page.write_text(f"# First\n\n<!-- generated:commands runs={SINGLE} -->\n"
                    f"<!-- generated:commands runs={DDP} -->\n<!-- /generated -->\n")
    problems, lines = build(site, check=True)
    assert problems >= 1 and lines[0].startswith("blogs/01-first.md:4:") and "regions do not nest" in lines[0]
    page.write_text("# First\n\nA region is written `<!-- generated:KIND args -->` ... `<!-- /generated -->`.\n\n"
                    "```markdown\n<!-- generated:table runs=devlog/data/x/* -->\n```\n")
    assert build(site, check=True) == (0, ["make_posts --check: 3 page(s), 0 region(s): all match the committed files"])


def test_a_figure_csv_that_differs_from_its_runs_fails(site):
    """Figures are checked through their CSVs (no matplotlib): a linked figure must be computable, and its CSV
    must be what its runs give."""
    for experiment, mib in (("tp-ft", 30.5), ("tp-sp-ft", 19.25)):
        write_run(site, f"devlog/data/2026-11-23-tp/{experiment}-seq256",
                  summary(experiment, 2, activation_mib=mib, config=dict(seq_len=256)), SINGLE_LOSSES)
    (site / "blogs" / "01-first.md").write_text("# First\n\n" + region("figure name=tp_activations") + PROVENANCE)
    problems, lines = build(site, check=True)
    assert any("tp_activations.csv" in line for line in lines) and problems >= 1  # not drawn yet
    rows, why = make_plots.figure_rows(make_plots.FIGURES["tp_activations"], site)
    assert [(r["run"], r["seq_len"], r["activation_mib"]) for r in rows] == [
        ("tp-ft-seq256", 256, 30.5), ("tp-sp-ft-seq256", 256, 19.25)]
    plots = site / "assets" / "plots"
    plots.mkdir(parents=True)
    (plots / "tp_activations.png").write_bytes(b"a png")  # drawing needs matplotlib; the check reads only the CSV
    (plots / "tp_activations.csv").write_text(make_plots.csv_text(rows))
    assert build(site, check=False)[0] == 0
    assert build(site, check=True)[0] == 0
    (plots / "tp_activations.csv").write_text(make_plots.csv_text(rows).replace("30.5", "31.5"))
    problems, lines = build(site, check=True)
    assert problems == 1 and lines[0].startswith("assets/plots/tp_activations.csv: differs from what its runs give")
    (site / "blogs" / "01-first.md").write_text("# First\n\n" + region("figure name=pp_schedule"))
    problems, lines = build(site, check=True)
    assert "figure pp_schedule: no run folder matches devlog/data/2026-11-23-pp/pp-ft-gpipe-m4" in lines[0]


# ---------------------------------------------------------------------------------------------------------------
# The generators, on the synthetic runs


def test_table_values_formats_and_the_pages_provenance(site):
    text = generated(site, f"table runs={SERIES}/* cols=run,ranks,step_ms,comm_ms,tok_s,rel:tok_s,peak_mem,"
                           f"collectives,field:config.bucket_cap_mb:g ref={SINGLE} sort=-tok_s")
    table = text.split("\n\n")[0].splitlines()
    assert table == [
        "| run | ranks | step ms | comm ms | tok/s | tok/s vs single-ft | peak RSS GiB | collectives per step "
        "| bucket_cap_mb |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
        "| ddp-ft | 2 | 283 | 65 | 3,666 | 1.03x | 1.10 | all_reduce 2 | 25 |",
        "| single-ft | 1 | 281 | 0 | 3,563 | 1.00x | 0.97 | none | - |",
        "| pp-ft | 2 | 383 | 219 | 2,621 | 0.74x | 0.97 | all_reduce 2, broadcast 1, recv 4, send 4 | - |",
    ]
    assert "Runs" not in text and "<details>" not in text  # a table ends with its rows: provenance is the page's
    # One collapsed block per page lists every run the page quotes (the reference run too), where it ran and how.
    block = provenance_of(site)
    assert block.startswith("\n<details><summary>Where the numbers on this page come from: 3 runs, their devices, "
                            "software and exact commands</summary>\n")
    assert (f"- [`{SERIES}/`](../{SERIES}/): ddp-ft, pp-ft, single-ft. CPU only: Test CPU, 2 cores, collectives over "
            f"gloo; world size 1 and 2; torch 2.9.0, transformers 5.0.0, peft 0.18.0, deepspeed 0.18.0, Python 3.11.7; "
            f"commit abc123def456; memory: peak RSS of the process (CPU); averages leave out the first 2 steps.") in block
    assert (f"```bash\n# {SERIES}/\nuv run torchrun --nproc_per_node=2 experiments/ddp-ft/train.py --steps 7 "
            f"--seq-len 64 --out-dir runs/ddp-ft\nuv run torchrun --nproc_per_node=2 experiments/pp-ft/train.py") in block
    assert block.rstrip().endswith("</details>")
    assert build(site, check=True)[0] == 0


def test_a_page_that_quotes_runs_has_one_provenance_region(site):
    page = site / "blogs" / "01-first.md"
    value = f"DDP: <!-- generated:value run={DDP} field=tokens_per_s fmt=\",.0f\" --><!-- /generated --> tokens/s.\n"
    page.write_text("# P\n\n" + value)
    problems, lines = build(site, check=True)
    assert problems == 2 and lines[1].startswith("blogs/01-first.md:1: the page quotes 1 run(s) and has no "
                                                 "provenance region")
    page.write_text("# P\n\n" + value + "\n" + region("provenance") + "\n" + region("provenance"))
    problems, lines = build(site, check=False)
    assert problems == 1 and "a second provenance region" in lines[1]
    page.write_text("# P\n\n" + region("provenance"))
    problems, lines = build(site, check=True)
    assert problems == 1 and "the page quotes no run" in lines[0]
    # a region that fails quotes nothing, and its error is the page's only one: the provenance is left as it was
    broken = value.replace("field=tokens_per_s", "field=no_such_field")
    page.write_text("# P\n\n" + broken + "\n" + region("provenance"))
    problems, lines = build(site, check=False)
    assert problems == 1 and "no_such_field" in lines[0]
    assert page.read_text().endswith(region("provenance"))


def test_table_label_and_an_unknown_column(site):
    text = generated(site, f"table runs={SINGLE},{DDP} cols=run,comm_share,state_mib "
                           f"label=\"{{experiment}} x{{hardware.world_size}}\"")
    assert text.splitlines()[2:4] == ["| single-ft x1 | 0% | 80.0 |", "| ddp-ft x2 | 20% | 80.0 / 80.0 |"]
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region(f"table runs={SINGLE} cols=run,speed"))
    problems, lines = build(site, check=True)
    assert problems == 1 and "unknown column 'speed'" in lines[0]


def test_value_field_and_expression(site):
    page = site / "blogs" / "01-first.md"
    page.write_text(
        f"A <!-- generated:value run={PP} field=bubble_fraction_per_rank.-1 fmt=.2f --><!-- /generated -->, "
        f"B <!-- generated:value run={DDP} field=state_bytes_per_rank.0.weights --><!-- /generated -->, "
        f"C <!-- generated:value run={DDP} field=collective_bytes_per_step.gloo:all_reduce.calls fmt=.0f -->"
        f"<!-- /generated -->, D <!-- generated:value expr=\"(b.tokens_per_s - a.tokens_per_s) / a.tokens_per_s\" "
        f"a={SINGLE} b={DDP} fmt=.1% --><!-- /generated -->, E <!-- generated:value "
        f"expr=\"max(b.steps.*.loss) - min(b.steps.0:3.loss) + abs(-1)\" b={DDP} fmt=.4f --><!-- /generated -->, "
        f"F <!-- generated:value expr=\"mean(a.steps.-2:.loss)\" a={SINGLE} fmt=.2f --><!-- /generated -->, "
        f"G <!-- generated:value expr=\"median(a.timed.*.loss) - len(a.timed)\" a={SINGLE} fmt=.2f --><!-- /generated -->"
        f".\n" + PROVENANCE)
    assert build(site, check=False) == (0, ["wrote blogs/01-first.md",
                                            "make_posts: 3 page(s), 8 region(s): all match the committed files"])
    values = [part.split("-->")[1] for part in page.read_text().split("<!-- /generated -->")[:7]]
    # G: the steps the averages count are 3 to 7 (2 warm-up steps): their median loss 2.0, less their number, 5.
    assert values == ["0.06", f"{WEIGHTS:,}", "2", "2.9%", f"{5.0 - 3.0000006 + 1:.4f}", "1.85", "-3.00"]


def test_value_reads_the_collective_formula_as_the_code_prices_it_now(site):
    from plotting.data import collective_formulas

    run = make_plots.load_run(site / DDP)
    formula = collective_formulas(run.summary)[0]["gloo:all_reduce"]
    assert evaluate_runs("d.formula.gloo:all_reduce.bytes / d.formula.gloo:all_reduce.calls", {"d": run}) == \
        formula["bytes"] / formula["calls"]


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "only numbers"),
    ("a.tokens_per_s.real", "indexes a float"),
    ("a", "only numbers"),
    ("c.tokens_per_s", "'c' is not a run"),
    ("a.tokens_per_s / 0", "division by zero"),
    ("a.steps.*.loss + 1", "not a number"),
    ("a.mfu * 2", "null"),
])
def test_the_expression_evaluator_refuses_anything_else(site, expression, message):
    run = make_plots.load_run(site / SINGLE)
    with pytest.raises(RegionError, match=message):
        evaluate_runs(expression, {"a": run})


def test_parity(site):
    text = generated(site, f"parity runs={SERIES}/* ref={SINGLE}")
    assert text.splitlines()[2:4] == [
        "| ddp-ft | 7 | 3.0e-05 | 2.0e-07 | 7.2e-07 | no / yes |",
        "| pp-ft | 7 | 0 | 0 | 1.6e-02 | yes / yes |",
    ]
    assert "within 1e-5 (all / first 5)" in text.splitlines()[0]
    # Runs that round otherwise (bf16) are held to the tolerance the region names: ddp-ft's 3e-5 passes 1e-4.
    looser = generated(site, f"parity runs={SERIES}/* ref={SINGLE} tolerance=1e-4").splitlines()
    assert "within 1e-4 (all / first 5)" in looser[0] and looser[2].endswith("| yes / yes |")
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region(f"parity runs={PP} ref={SINGLE} tolerance=tight"))
    problems, lines = build(site, check=True)
    assert problems == 1 and "tolerance='tight' is not a number" in lines[0]
    other = json.loads((site / PP / "summary.json").read_text())
    other["config"]["seq_len"] = 128
    (site / PP / "summary.json").write_text(json.dumps(other))
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region(f"parity runs={PP} ref={SINGLE}"))
    problems, lines = build(site, check=True)
    assert problems == 1 and "pp-ft does not do the steps of single-ft (seq_len 128 vs 64)" in lines[0]


def test_collectives_state_and_bubble(site):
    """The formula, the predicted states and the textbook bubble beside each run are computed from its summary.json
    (common.comm, common.memory), which records none of them."""
    rows = generated(site, f"collectives runs={DDP},{PP}").splitlines()
    assert rows[0] == ("| run | rank | collective | calls/step | calls (formula) | MiB/step | MiB (formula) "
                       "| wire MiB/step per rank | match |")
    mib = (WEIGHTS + 4) / 2**20
    # one bucket and the loss; a ring all-reduce sends 2 (W-1)/W = 1 times its buffer
    assert rows[2] == f"| ddp-ft | 0 | gloo:all_reduce | 2 | 2 | {mib:.2f} | {mib:.2f} | {mib:.2f} | ✓ |"
    # pp-ft rank 1: all_reduce, broadcast, recv, send; m = 4 micro-batches of 64 x 256 fp32 hidden states each way.
    assert rows[9] == "| pp-ft | 1 | gloo:recv | 4 | 4 | 0.25 | 0.25 | 0.25 | ✓ |"
    assert rows[10] == "| pp-ft | 1 | gloo:send | 4 | 4 | 0.12 | 0.25 | 0.12 | ✗ |"

    rows = generated(site, f"state runs={DDP},{PP}").splitlines()
    assert rows[2] == "| ddp-ft | 0 | 20.0 / 20.0 | 20.0 / 20.0 | 40.0 / 40.0 | 0.0 / 0.0 | 80.0 / 80.0 | 1.000 |"
    pp = json.loads((site / PP / "summary.json").read_text())
    predicted = predict_state_bytes(pp)[1]  # the last stage: half the layers, the norm and the LM head's copy
    assert predicted["weights"] > WEIGHTS // 2
    cells = " | ".join(f"{WEIGHTS * share / 2 ** 21:,.1f} / {predicted[kind] / 2**20:,.1f}"
                       for kind, share in (("weights", 1), ("grads", 1), ("optimizer", 2)))
    assert rows[5].startswith(f"| pp-ft | 1 | {cells} | 0.0 / 0.0 |")

    rows = generated(site, f"bubble runs={PP}").splitlines()
    assert rows[2] == "| pp-ft | 1f1b | 2 | 1 | 4 | 0.274 | 0.48 / 0.06 | 0.200 | (p-1)/(m+p-1) |"


def test_sweep_table_is_common_sweeps(site):
    from common import sweep

    cells = {}
    for micro in (1, 2):
        cell = sweep.Cell("fsdp-ft", 2, micro, 2, False, "fp32", "qwen3-tiny", 64, 7)
        data = summary("fsdp-ft", 2, step_ms=400.0 + micro, comm_ms=30.0, tokens_per_s=1000.0 * micro,
                       peak_mem_gib=1.0, final_loss=2.0)
        write_run(site, f"devlog/data/2026-01-01-sweep/{cell.name}", data, SINGLE_LOSSES)
        cells[cell] = {"summary": data}
    rows = sweep.table_rows(cells)
    sweep.write_csv(rows, site / "devlog/data/2026-01-01-sweep/sweep.csv")
    text = generated(site, "sweep run-dir=devlog/data/2026-01-01-sweep")
    assert text == sweep.markdown_table(rows)
    assert "[`devlog/data/2026-01-01-sweep/`](../devlog/data/2026-01-01-sweep/)" in provenance_of(site)


def test_memory_table_is_what_common_memory_recommends(site):
    from common import memory

    cases = ["--model qwen3-tiny --gpus 1 --gpu-mem-gib 1",
             "--model qwen3-tiny --gpus 2 --gpu-mem-gib 24 --lora-rank 8"]
    text = generated(site, f'memory-table cases="{"; ".join(cases)}" strategies=single,ddp,fsdp')
    table = text.split("\n\n")[0].splitlines()
    assert table[0] == "| setting | single | ddp | fsdp | first rung that fits |"
    assert table[2].startswith("| Qwen3-tiny, 1 x 1 GiB | ") and table[3].startswith(
        "| Qwen3-tiny, 2 x 24 GiB, LoRA r8, PCIe | - | ")
    for row, case in zip(table[2:], cases):
        choice = memory.ask(case.split()).advice.choice  # the question the command line asks with these flags
        label = (choice.strategy + " + checkpointing" * choice.activation_checkpointing
                 + (f" + LoRA r{choice.lora_rank}" if choice.lora_rank else "")
                 + (f", micro-batch {choice.micro_batch_size}" if choice.micro_batch_size > 1 else ""))
        assert row.endswith(f" {label} ({choice.total_gib:.1f} GiB) |")
        assert f"**{choice.total_gib:.1f}**" in row
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region('memory-table cases="--model qwen3-tiny --gpus x"'))
    problems, lines = build(site, check=True)
    assert problems == 1 and "case '--model qwen3-tiny --gpus x'" in lines[0] and "--gpus" in lines[0]


def test_answer_table_is_the_command_lines_answer(site):
    """Each row is what `python -m common.memory` answers for its flags: the run line's experiment and the flags that
    differ from the defaults (the full command in the collapsed block below), the predicted peak and its margin;
    tokens/s measured where a given run ran that very command on that GPU, else projected from the reference's tokens
    over its time by peak FLOP/s (H200 989.4, RTX 4090 165.2 TFLOP/s) and FLOPs per token, times the GPUs."""
    from common import memory
    from common.models import model_config, training_flops

    cases = ["--model qwen3-tiny --gpus 1 --gpu H200", "--model qwen3-tiny --gpus 2 --gpu RTX-4090 --lora-rank 8",
             "--model qwen3-tiny --gpus 1 --gpu RTX-5090"]
    reference = "devlog/data/gpu/fast"
    fast = summary("single-ft", 1, config=dict(seq_len=1024, micro_batch_size=8, grad_accum=1, attn="varlen",
                                               loss_chunk_tokens=1024, compile=True), flops_per_token=2.0e7)
    fast["hardware"].update(device_kind="cuda", device_name="NVIDIA H200", cuda="13.0")
    write_run(site, reference, fast, SINGLE_LOSSES)
    steps = [dict(step=k + 1, loss=1.0, tokens_per_s=tokens_per_s, tokens=tokens_per_s * step_ms / 1000,
                  step_ms=step_ms)
             for k, (tokens_per_s, step_ms) in enumerate([(1.0, 100.0), (2.0, 100.0), (50_000.0, 100.0),
                                                          (60_000.0, 100.0), (70_000.0, 200.0)])]
    (site / reference / "metrics.jsonl").write_text("".join(json.dumps(step) + "\n" for step in steps))
    text = generated(site, f'answer-table reference={reference} cases="{"; ".join(cases)}"')
    rows = text.split("\n\n")[0].splitlines()[2:]
    full = text.split("<details><summary>The full commands</summary>", 1)[1].split("</details>")[0]
    assert len(rows) == 3
    for number, (row, case) in enumerate(zip(rows, cases), 1):
        asked = memory.ask(case.split())
        advice, choice, usable = asked.advice, asked.advice.choice, asked.gpu_mem_gib * memory.USABLE_FRACTION
        assert row.startswith(f"| {number}. ") and advice.command() in full.splitlines()
        experiment = advice.command().split("experiments/", 1)[1].split("/train.py")[0]
        short = f"`{experiment} --micro-batch-size {advice.rung.micro_batch_size}"
        assert short in row and "--seq-len 1024" not in row and "--dtype bf16" not in row
        assert f"| {choice.total_gib:.1f} + {choice.margin_gib:.1f} of {usable:.1f} |" in row
    assert advice.rung is not None and rows[0].endswith("| 60,000 measured |")  # its median timed step
    assert "(measured: fast)" in full
    # the reference's tokens over its time: steps 3-5 (two warm-up steps), (5,000 + 6,000 + 14,000) / 0.4 s
    flops = [training_flops(model_config("qwen3-tiny"), rank).dense_per_token(1024) for rank in (0, 8)]
    assert rows[1].endswith(f"| ~{62_500 * 165.2 / 989.4 * flops[0] / flops[1] * 2:,.0f} projected |")
    assert rows[2].endswith("| - (no peak FLOP/s for RTX-5090 in common/metrics.py) |")


def test_memory_cli_is_what_common_memory_prints(site, capsys):
    from common import memory

    text = generated(site, 'memory-cli args="--model qwen3-tiny --gpus 2 --gpu-mem-gib 24"')
    memory.main(["--model", "qwen3-tiny", "--gpus", "2", "--gpu-mem-gib", "24"])
    printed = capsys.readouterr().out.rstrip()
    command = "$ uv run python -m common.memory --model qwen3-tiny --gpus 2 --gpu-mem-gib 24"
    assert text == f"```text\n{command}\n{printed}\n```"
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region('memory-cli args="--model qwen3-tiny --gpu 2x"'))
    problems, lines = build(site, check=True)
    assert problems == 1 and "python -m common.memory" in lines[0] and "--gpu" in lines[0]


def test_code_diff_and_diffstat_quote_the_current_files(site):
    assert generated(site, "code file=experiments/a/train.py symbol=train") == (
        "```python\n@decorated\ndef train(steps):\n    total = 0\n    for step in range(steps):\n"
        "        total += helper(step)\n    return total\n```")
    assert generated(site, 'code file=experiments/a/train.py start="for step" end="return"') == (
        "```python\nfor step in range(steps):\n    total += helper(step)\nreturn total\n```")
    assert generated(site, 'diff a=experiments/a/train.py b=experiments/b/train.py match=no_sync context=0') == (
        "```diff\n--- experiments/a/train.py\n+++ experiments/b/train.py\n@@ -12 +12 @@\n"
        "-        total += helper(step)\n+        total += helper(step)  # no_sync here\n```")
    assert "@@ -5 +5 @@" in generated(site, "diff a=experiments/a/train.py b=experiments/b/train.py context=0")
    assert generated(site, "diffstat base=experiments/a/train.py files=experiments/*/train.py").splitlines()[2] == (
        "| `experiments/b/train.py` | 13 | +2 | -2 |")
    # A block re-indented under a new `with` shows as context: only the `with` line is added.
    (site / "experiments/c").mkdir()
    (site / "experiments/c/train.py").write_text("def f():\n    with ctx():\n        a = 1\n        b = 2\n")
    (site / "experiments/d").mkdir()
    (site / "experiments/d/train.py").write_text("def f():\n    a = 1\n    b = 2\n")
    assert generated(site, "diff a=experiments/d/train.py b=experiments/c/train.py") == (
        "```diff\n--- experiments/d/train.py\n+++ experiments/c/train.py\n@@ -1,3 +1,4 @@\n def f():\n"
        "+    with ctx():\n         a = 1\n         b = 2\n```")
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region('code file=experiments/a/train.py start="total"'
                                                                   ' end="return"'))
    problems, lines = build(site, check=True)
    assert problems == 1 and "'total' is on 3 lines of experiments/a/train.py" in lines[0]


def test_commands_hardware_and_the_cpu_box(site):
    assert generated(site, f"commands runs={SINGLE}") == (
        "```bash\nuv run python experiments/single-ft/train.py --steps 7 --seq-len 64 --out-dir runs/single-ft\n```")
    assert generated(site, f"hardware runs={SINGLE}") == (
        "CPU only: Test CPU, 2 cores; world size 1; torch 2.9.0, transformers 5.0.0, peft 0.18.0, deepspeed 0.18.0, "
        "Python 3.11.7; commit abc123def456")
    box = generated(site, f"cpu-box runs={SERIES}/*")
    assert box.startswith("> **Measured on a CPU** (Test CPU, 2 cores; one process and 2 ranks over gloo). Carries "
                          "over to GPUs: ")
    assert "\n" not in box  # one paragraph: the explanation of each point is in post 2, once
    for point in ("which collectives each strategy runs", "model-state bytes each rank holds",
                  "loss parity", "the bubble's form; its size only as far as", "the 2 ranks share the 2 cores", "no native reduce-scatter",
                  "0.97 GiB for a 5.25M-parameter single-ft run", "MFU (no CPU peak)"):
        assert point in box, point
    # The parity point states what these runs measured (DDP_LOSSES: 2e-7 in the first 5 steps, 3e-5 at step 6).
    assert ("the 3 runs here that do another's steps agree in fp32 within 2.0e-07 over the first 5 steps, 3.0e-05 "
            "over all") in box
    single_only = generated(site, f"cpu-box runs={SINGLE}")
    for point in ("collectives", "loss parity", "bubble", "share the"):
        assert point not in single_only, point
    assert "speed (these are 2 CPU cores)" in single_only
    # Where the series has post 2, the box links to its explanation.
    (site / "blogs" / "02-the-reference-step.md").write_text("# Two\n\n## What CPU numbers can and cannot tell\n")
    assert generated(site, f"cpu-box runs={SINGLE}").endswith(
        "[Why each point holds](02-the-reference-step.md#what-cpu-numbers-can-and-cannot-tell).")


def test_gpu_slot_is_a_sentence_until_a_gpu_run_exists(site):
    text = generated(site, "gpu-slot runs=devlog/data/*-gpu/* cols=run,tok_s")
    assert text.startswith("Not measured on a GPU yet") and "GPU commands of this page's \"Run it\"" in text
    gpu = summary("ddp-ft", 2, tokens_per_s=91234.0)
    gpu["hardware"].update(device_kind="cuda", device_name="NVIDIA H100 80GB HBM3", device_count=2, cuda="12.8")
    write_run(site, "devlog/data/2026-01-02-gpu/ddp-ft", gpu, SINGLE_LOSSES)
    text = generated(site, "gpu-slot runs=devlog/data/*-gpu/* cols=run,tok_s")
    assert text.splitlines()[2] == "| ddp-ft | 91,234 |"
    assert "2 x NVIDIA H100 80GB HBM3 (CUDA 12.8)" in provenance_of(site)
    assert SINGLE not in provenance_of(site)  # the CPU runs the glob could match are not quoted
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region("table runs=devlog/data/*-tpu/*"))
    assert "matches no run folder" in build(site, check=True)[1][0]  # only gpu-slot accepts an empty glob


def test_an_mfu_recorded_before_the_per_step_count_is_refused_and_a_recounted_one_is_said(site):
    """A GPU run whose summary.json carries an MFU but not the FLOPs of its steps (the count before documents and
    frozen weights were counted) fails the check, named; a run recounted once into its files shows the recount's
    figure and a table with an MFU column says so."""
    records = [dict(step=k + 1, loss=1.0, tokens=100, step_ms=100.0, tokens_per_s=1000.0, mfu=0.5) for k in range(3)]
    run = summary("single-ft", 1, mfu=0.9, warmup_steps_excluded=1, profiled_steps=[])
    run["hardware"].update(device_kind="cuda", device_name="NVIDIA H100 80GB HBM3", cuda="12.8")
    folder = site / "devlog" / "data" / "2026-01-02-gpu" / "single-ft"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(run))
    (folder / "metrics.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    name = "devlog/data/2026-01-02-gpu/single-ft"
    (site / "blogs" / "01-first.md").write_text(f"# Page\n\n{region(f'table runs={name} cols=run,mfu')}{PROVENANCE}")
    problems, lines = build(site, check=False, only="blogs/01-first.md")
    assert problems == 1 and f"run {name}: its MFU predates the per-step FLOPs" in lines[0]

    run.update(mfu=0.5, mfu_recorded=0.9, flops_per_token=1e6,
               mfu_recount="recounted from each step's rebuilt documents (common/models.py's training_flops)")
    (folder / "summary.json").write_text(json.dumps(run))
    table = generated(site, f"table runs={name} cols=run,mfu")
    assert "50.0%" in table and "MFU recounted from the documents of each step" in table
    assert "recounted" not in generated(site, f"table runs={name} cols=run,tok_s")


def test_nav_follows_the_index(site):
    assert generated(site, "nav") == "[Index](README.md) · [Next: Second steps →](02-second.md)"
    assert generated(site, "nav", page="blogs/02-second.md") == (
        "[← Previous: First steps](01-first.md) · [Index](README.md)")
    (site / "blogs" / "03-third.md").write_text("# Third\n\n" + region("nav"))
    problems, lines = build(site, check=True)
    assert problems == 1 and "blogs/README.md does not list 03-third.md" in lines[0]


def test_unknown_generators_and_arguments_are_errors(site):
    (site / "blogs" / "01-first.md").write_text(
        "# P\n\n" + region("tabel runs=x") + "\n" + region(f"table runs={SINGLE} colums=run") + "\n"
        + f"inline <!-- generated:table runs={SINGLE} --><!-- /generated -->\n")
    problems, lines = build(site, check=True)
    assert problems == 3
    assert "unknown generator 'tabel'" in lines[0]
    assert "unknown: colums" in lines[1]
    assert "table writes a block" in lines[2]


def test_a_block_region_inside_a_list_item_keeps_its_indentation(site):
    page = site / "blogs" / "01-first.md"
    page.write_text(f"- item\n\n  <!-- generated:commands runs={SINGLE} -->\n  <!-- /generated -->\n" + PROVENANCE)
    assert build(site, check=False)[0] == 0
    assert page.read_text().startswith(f"- item\n\n  <!-- generated:commands runs={SINGLE} -->\n\n  ```bash\n"
                                       f"  uv run python experiments/single-ft/train.py --steps 7 --seq-len 64 "
                                       f"--out-dir runs/single-ft\n  ```\n\n  <!-- /generated -->\n")
    assert build(site, check=True)[0] == 0


def test_figure_data_functions_read_the_summaries(site):
    runs = [make_plots.load_run(site / name) for name in (SINGLE, DDP, PP)]
    rows = make_plots.loss_curves_data(runs)
    ddp = [row for row in rows if row["run"] == "ddp-ft"]
    assert [row["reference"] for row in ddp] == ["single-ft"] * 7
    assert ddp[5]["relative_difference"] == pytest.approx(3e-5)
    predicted = predict_state_bytes(runs[2].summary)[1]
    assert make_plots.state_bytes_data(runs)[-4:] == [
        dict(run="pp-ft", rank=1, kind=kind, measured_bytes=value, predicted_bytes=predicted[kind])
        for kind, value in (("weights", WEIGHTS // 2), ("grads", WEIGHTS // 2), ("optimizer", WEIGHTS + 8),
                            ("master", 0))]
    written = list(csv.DictReader(make_plots.csv_text(make_plots.pp_bubble_data(runs)).splitlines()))
    assert written == [dict(run="pp-ft", schedule="1f1b", p="2", v="1", m="4", split="", bubble="0.274",
                            bubble_per_rank="0.48;0.06", textbook="0.2", formula="(p-1)/(m+p-1)",
                            busy_ms_per_rank="100.0;190.0")]
    # The less busy stage's floor: its first micro-batch, then m of the slow stage's (post 7).
    r = 100 / 190
    assert imbalance_floor(4, r) == pytest.approx(1 - 4 * 100 / (100 + 4 * 190))
    assert imbalance_floor(1e9, r) == pytest.approx(1 - r)


def test_an_opening_comment_may_go_on_over_several_lines(site):
    page = site / "blogs" / "01-first.md"
    page.write_text(f"# P\n\nDDP at <!-- generated:value expr=\"b.tokens_per_s / a.tokens_per_s\" fmt=.2f\n"
                    f"a={SINGLE} b={DDP} --><!-- /generated -->x.\n\n"
                    f"<!-- generated:table runs={DDP}\n     cols=run,tok_s -->\n<!-- /generated -->\n" + PROVENANCE)
    assert build(site, check=False)[0] == 0
    text = page.read_text()
    assert f"b={DDP} -->1.03<!-- /generated -->x." in text
    assert "     cols=run,tok_s -->\n\n| run | tok/s |\n|---|---:|\n| ddp-ft | 3,666 |\n" in text
    assert build(site, check=True)[0] == 0
    page.write_text(f"# P\n\n<!-- generated:table runs={DDP}\ncols=run,tok_s\n")
    assert "without its closing -->" in build(site, check=True)[1][0]


def test_the_manual_names_every_generator_and_column():
    """assets/posts/README.md is the writers' manual: it must not fall behind the code."""
    manual = (REPO_ROOT / "assets" / "posts" / "README.md").read_text()
    for name in list(GENERATORS) + list(COLUMNS):
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", manual), f"the manual does not mention {name}"


def test_memory_errors_keep_the_in_sample_prediction_apart_from_the_one_made_before_the_run(site):
    """memory-errors lists each committed GPU run (measured at 1 GiB or more) against the current prediction and
    against the one the run wrote at its start; memory-error quotes the extremes of each and the stored band."""
    from common import memory

    runs = {"devlog/data/gpu/big": (1.5, 1.0), "devlog/data/gpu/bigger": (2.0, 4.0),
            "devlog/data/gpu/small": (0.5, None)}  # name: (reserved GiB, predicted at its start)
    for name, (reserved, at_start) in runs.items():
        run = summary("single-ft", 1, peak_mem_gib=reserved, predicted_peak_mem_gib=at_start,
                      memory_measure="max_memory_reserved", attention={"impl": "sdpa"})
        run["hardware"].update(device_kind="cuda", device_name="NVIDIA H200", cuda="13.0")
        write_run(site, name, run, SINGLE_LOSSES)
    predicted = memory.predict_run(json.loads((site / "devlog/data/gpu/big/summary.json").read_text())).total_gib
    text = generated(site, "memory-errors")
    rows = text.split("\n\n")[0].splitlines()[2:]
    assert [row.split(" | ")[1] for row in rows] == ["big", "bigger"]  # the run under 1 GiB is left out
    assert rows[0] == (f"| NVIDIA H200 | big | 1.50 | {predicted:.2f} | {1.5 / predicted - 1:+.0%} | 1.00 | +50% |")
    assert rows[1].endswith("| 4.00 | -50% |")
    values = {stat: generated(site, f"memory-error stat={stat}") for stat in
              ("band", "under-start", "over-start", "count-start", "under-now")}
    assert values == {"band": f"{memory.ERROR_BAND:.0%}", "under-start": "50.0%", "over-start": "2.00x",
                      "count-start": "2", "under-now": f"{2.0 / predicted - 1:.1%}"}


def test_lora_states_are_the_bytes_per_kind_the_run_recorded(site):
    """lora-states divides rank 0's recorded state bytes by the parameters of each kind: a 2-byte base and 16 bytes per
    trained parameter here, and refuses a run that trains every weight."""
    trained, parameters = 155_648, 5_245_440
    held = dict(weights=2 * parameters + 4 * trained, grads=4 * trained, optimizer=8 * trained, master=0)
    run = summary("single-ft", 1, config=dict(lora_rank=8, dtype="bf16"), state_bytes_per_rank=[held],
                  peak_mem_gib=0.5, attention={"impl": "sdpa"},
                  model=dict(name="qwen3-tiny", parameters=parameters, trainable_parameters=trained))
    write_run(site, "devlog/data/lora/single-ft", run, SINGLE_LOSSES)
    text = generated(site, "lora-states runs=devlog/data/lora/single-ft")
    row = text.split("\n\n")[0].splitlines()[2]
    assert row.startswith("| single-ft | x86_64 | qwen3-tiny | LoRA r8, --dtype bf16 | 155,648 (2.97%) | 2.00 | - | "
                          "16.00 | ") and row.endswith("| 0.50 |")
    (site / "blogs" / "01-first.md").write_text("# P\n\n" + region(f"lora-states runs={SINGLE}") + PROVENANCE)
    problems, lines = build(site, check=False, only="blogs/01-first.md")
    assert problems == 1 and "is not a LoRA run" in " ".join(lines)
