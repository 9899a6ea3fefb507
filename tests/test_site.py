"""The series as a site (assets/make_site.py): the build and its failures, the calculator's data against
common.memory, and every page in a real browser (Debian's chromium driven by Playwright, served on 127.0.0.1).

The site is built once per session into build/test/ (docs, site, and screenshots/ of every page for a person to look
at). Needs the docs group (in the default groups: `uv run pytest tests/test_site.py`) and /usr/bin/chromium (.ci/run installs
both); where either is missing the tests skip, except where SITE_TESTS_REQUIRED is set (.ci/run), where they fail.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import os
import random
import re
import shutil
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "assets"))
BUILD = REPO_ROOT / "build" / "test"
CHROMIUM = Path("/usr/bin/chromium")
# The flags a closed network needs (no background connections to refuse), beside Playwright's own (--headless and a
# fresh user-data-dir per launch).
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
VIEWPORTS = {"desktop": dict(width=1280, height=900), "phone": dict(width=390, height=844)}
SCHEMES = ("light", "dark")
TIMEOUT_MS = 90_000  # generous: the tests share two cores with other work


def needs(what: str, available: bool) -> None:
    """Skip without `what` on a developer's machine; .ci/run installs everything (SITE_TESTS_REQUIRED), so there it is a
    failure."""
    if not available:
        message = f"{what} is missing (uv sync; apt-get install chromium chromium-driver)"
        if os.environ.get("SITE_TESTS_REQUIRED"):
            pytest.fail(message)
        pytest.skip(message)


def have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def site_pages() -> list[str]:
    """The built pages, from blogs/ as it is now: the index, every post, the calculator."""
    posts = sorted(path.stem for path in (REPO_ROOT / "blogs").glob("*.md") if re.match(r"^\d\d-", path.name))
    return ["index", *posts, "fit"]


@pytest.fixture(scope="session")
def built():
    needs("mkdocs (the docs group)", have("mkdocs") and have("material"))
    import make_site

    if BUILD.exists():
        shutil.rmtree(BUILD)
    make_site.build(REPO_ROOT, BUILD, print_fn=lambda line: None)
    return BUILD


# ---------------------------------------------------------------------------------------------------------------
# The build


@pytest.mark.slow  # the site built once (~15 s) or a browser
def test_the_build_stages_every_post_with_its_figures_and_links(built):
    docs = built / "docs"
    assert sorted(path.stem for path in docs.glob("*.md")) == sorted(site_pages())
    ddp = (docs / "03-ddp.md").read_text()
    assert "](figures/plots/" in ddp and "](../" not in ddp  # figures copied, repository links rewritten
    assert re.search(r"\]\(https?://[^)]+/(tree|blob)/[0-9a-f]{40}/devlog/", ddp)
    assert '<details markdown="1">' in ddp and ddp.rstrip().endswith("holds every page to the committed runs).")
    for figure in re.findall(r"\]\((figures/[^)]+)\)", ddp):
        assert (docs / figure).is_file(), figure
    # The sidebar names each page once: the home page by its own title, not the site's name a second time.
    home = (built / "site" / "index.html").read_text()
    primary = home[home.index("md-nav--primary"):home.index("md-nav--secondary")]
    entries = re.findall(r'<span class="md-ellipsis">\s*(.*?)\s*</span>', primary)
    from make_site import HOME_TITLE

    assert entries and entries[0] == HOME_TITLE and "Distributed fine-tuning of Qwen3" not in entries


def linked_tree(tmp_path: Path) -> Path:
    """A scratch checkout: the repository's folders linked, blogs/ and assets/plots copied (to be broken)."""
    root = tmp_path / "repo"
    root.mkdir()
    for entry in REPO_ROOT.iterdir():
        if entry.name not in ("blogs", "assets", "build", ".git", ".venv"):
            (root / entry.name).symlink_to(entry)
    shutil.copytree(REPO_ROOT / "blogs", root / "blogs")
    (root / "assets").mkdir()
    for entry in (REPO_ROOT / "assets").iterdir():
        if entry.name == "plots":
            shutil.copytree(entry, root / "assets" / "plots")
        else:
            (root / "assets" / entry.name).symlink_to(entry)
    return root


def test_a_missing_figure_or_a_broken_link_stops_the_build(tmp_path):
    import make_site

    root = linked_tree(tmp_path)
    assert make_site.stage(root, tmp_path / "docs", "https://git.example/repo", "0" * 40) == []
    (root / "assets" / "plots" / "ddp_buckets.png").unlink()
    ddp = root / "blogs" / "03-ddp.md"
    ddp.write_text(ddp.read_text().replace("(04-zero.md", "(04-zeros.md", 1)
                   .replace("(02-the-reference-step.md#", "(02-the-reference-step.md#no-such-heading-", 1))
    errors = make_site.stage(root, tmp_path / "docs", "https://git.example/repo", "0" * 40)
    assert len(errors) == 3, errors
    assert any("ddp_buckets.png' points to a file that does not exist" in e for e in errors)
    assert any("04-zeros.md" in e and "does not exist" in e for e in errors)
    assert any("names no heading of blogs/02-the-reference-step.md" in e for e in errors)
    assert all(e.startswith("blogs/03-ddp.md:") for e in errors)
    with pytest.raises(make_site.BuildError, match="ddp_buckets.png"):
        make_site.build(root, tmp_path / "out", "https://git.example/repo", mkdocs=False, models=["qwen3-tiny"])


def test_repository_remotes_become_web_addresses():
    from make_site import web_address

    assert web_address("git@github.com:owner/name.git") == "https://github.com/owner/name"
    assert web_address("https://user:token@host.org/owner/name.git") == "https://host.org/owner/name"
    assert web_address("/work/main") is None


# ---------------------------------------------------------------------------------------------------------------
# The calculator's data


def first_fit(ladder: dict, usable: float, band: float):
    """What the page does: the first rung whose peak with its margin (x (1 + band)) is within the usable memory."""
    return next((rung for rung in ladder["rungs"] if rung[4] * (1 + band) <= usable), None)


@pytest.mark.slow  # the site built once (~15 s) or a browser
def test_the_exported_ladders_answer_as_recommend_does(built):
    """Sampled questions and memories (random ones, and each just at and just below a rung's peak): the rung the page
    takes from the JSON is recommend()'s answer, command and peak."""
    from common.memory import ERROR_BAND, USABLE_FRACTION, recommend
    from common.memory.cli import varlen_repeats_kv
    from common.models import PRESET_HUB_IDS

    index = json.loads((built / "docs" / "fit" / "index.json").read_text())
    assert index["usable_fraction"] == USABLE_FRACTION and index["error_band"] == ERROR_BAND
    rng = random.Random(0)
    models = {model["name"]: model for model in index["models"]}
    questions = [("qwen3-4b", 2, 1024, "full"), ("qwen3-30b-a3b", 8, 4096, "full"), ("qwen3-8b", 1, 2048, "qlora")]
    questions += [(name, rng.choice(index["gpus"]), rng.choice(index["seq_lens"]),
                   rng.choice(models[name]["trainings"])) for name in rng.sample(sorted(models), 7)]
    compared = 0
    for name, gpus, seq_len, training in questions:
        ladder = json.loads((built / "docs" / "fit" / name / f"{gpus}.json").read_text())["ladders"][str(seq_len)][
            training]
        peaks = sorted({rung[4] for rung in ladder["rungs"]})
        memories = [rng.uniform(2, 200) for _ in range(3)]
        for peak in rng.sample(peaks, min(2, len(peaks))):
            needed = peak * (1 + ERROR_BAND)  # just at and just below a rung's peak with its margin
            memories += [needed / USABLE_FRACTION, needed / USABLE_FRACTION * (1 - 1e-9)]
        for gpu_mem_gib in memories:
            advice = recommend(name, gpus, gpu_mem_gib, seq_len=seq_len, lora_rank=16 if training == "lora" else 0,
                               qlora=training == "qlora", kv_expanded=varlen_repeats_kv(),
                               model=PRESET_HUB_IDS.get(name, name))
            rung = first_fit(ladder, gpu_mem_gib * index["usable_fraction"], index["error_band"])
            question = (name, gpus, seq_len, training, gpu_mem_gib)
            if advice.rung is None:
                assert rung is None, question
            else:
                assert rung is not None and rung[8] == advice.command(), question
                assert rung[4] == advice.choice.total_gib, question
            compared += 1
    assert compared >= 50


@pytest.mark.slow  # the site built once (~15 s) or a browser
def test_check_finds_a_stale_ladder(built, tmp_path):
    """--check compares the build with what the checkout writes now: a ladder that differs is named."""
    import make_site

    out = tmp_path / "build"
    shutil.copytree(built / "docs", out / "docs", ignore=shutil.ignore_patterns("fit"))
    (out / "docs" / "fit").mkdir()
    shutil.copy(built / "docs" / "fit" / "index.json", out / "docs" / "fit" / "index.json")
    shutil.copytree(built / "docs" / "fit" / "qwen3-0.6b", out / "docs" / "fit" / "qwen3-0.6b")
    assert make_site.check(REPO_ROOT, out, models=["qwen3-0.6b"]) == []
    stale = out / "docs" / "fit" / "qwen3-0.6b" / "2.json"
    data = json.loads(stale.read_text())
    data["ladders"]["1024"]["full"]["rungs"][0][4] *= 0.5  # a memory model that changed since the build
    stale.write_text(json.dumps(data, separators=(",", ":")))
    assert make_site.check(REPO_ROOT, out, models=["qwen3-0.6b"]) == [
        f"{stale}: stale (the calculator's ladder differs from what this checkout writes)"]


# ---------------------------------------------------------------------------------------------------------------
# In the browser


class Server:
    """The site on 127.0.0.1, on a free port, in a thread."""

    def __init__(self, root: Path):
        class Quiet(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
        self.root = root
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="session")
def browser():
    needs("playwright (the docs group)", have("playwright"))
    needs(str(CHROMIUM), CHROMIUM.exists())
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_FLAGS)
        yield launched
        launched.close()


@pytest.fixture(scope="session")
def served(built):
    server = Server(built / "site")
    yield server
    server.close()


# Each inline generated value: its opening comment, the value and the closing comment share one parent, a paragraph
# or another inline context (a list item, a table cell, ...), never the article itself.
VALUES_OUTSIDE = """() => {
  const walker = document.createTreeWalker(document.querySelector("article") || document.body, NodeFilter.SHOW_COMMENT);
  const bad = [];
  let node, count = 0;
  while ((node = walker.nextNode())) {
    if (!/^\\s*generated:value/.test(node.data)) continue;
    count += 1;
    let close = node.nextSibling;
    while (close && !(close.nodeType === 8 && /^\\s*\\/generated/.test(close.data))) close = close.nextSibling;
    const parent = node.parentElement;
    if (!close || !parent || parent.tagName === "ARTICLE" || parent.tagName === "DIV") {
      bad.push(node.data.slice(0, 80));
    }
  }
  return [bad, count];
}"""
IMAGES_NOT_SHOWN = """() => Array.from(document.images).filter(img => !img.complete || img.naturalWidth === 0)
  .map(img => img.getAttribute("src"))"""
LINKS = """() => Array.from(document.querySelectorAll("a[href]")).map(a => a.href)"""


def source_values(page_name: str) -> int:
    """How many inline generated values the page's markdown has (blogs/README.md is the index)."""
    source = REPO_ROOT / "blogs" / ("README.md" if page_name == "index" else f"{page_name}.md")
    return len(re.findall(r"<!--\s*generated:value", source.read_text())) if source.exists() else 0


def inspect(browser, server: Server, page_name: str, viewport: str = "desktop", scheme: str = "light",
            links: bool = True, screenshot: Path | None = None) -> list[str]:
    """Everything wrong with one page as a reader's browser shows it: console errors, failed or off-machine
    requests, images not shown, overflow of the page's width, generated values outside their paragraph (or fewer
    than its markdown has), links to pages or headings the site does not have."""
    problems: list[str] = []
    context = browser.new_context(viewport=VIEWPORTS[viewport], color_scheme=scheme, service_workers="block")
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)

    def route(request_route):
        host = urlsplit(request_route.request.url).hostname
        if request_route.request.url.startswith(("data:", "blob:")) or host == "127.0.0.1":
            request_route.continue_()
        else:
            problems.append(f"request off this machine: {request_route.request.url}")
            request_route.abort()

    page.route("**/*", route)
    page.on("console", lambda message: message.type == "error" and problems.append(f"console error: {message.text}"))
    page.on("pageerror", lambda error: problems.append(f"page error: {error}"))
    page.on("requestfailed", lambda request: urlsplit(request.url).hostname == "127.0.0.1" and problems.append(
        f"request failed: {request.url} ({request.failure})"))
    page.on("response", lambda response: response.status >= 400 and problems.append(
        f"HTTP {response.status}: {response.url}"))
    try:
        page.goto(server.url + f"{page_name}.html", wait_until="load")
        page.wait_for_load_state("networkidle")
        if page_name == "fit":
            page.wait_for_selector("#fit-answer:not([hidden])")
        if scheme == "dark" and page.evaluate("document.body.dataset.mdColorScheme") != "slate":
            problems.append("dark mode asked for, not shown")
        problems += [f"image not shown: {src}" for src in page.evaluate(IMAGES_NOT_SHOWN)]
        width, inner = page.evaluate("[document.documentElement.scrollWidth, window.innerWidth]")
        if width > inner + 1:
            problems.append(f"the page is {width} px wide in a {inner} px window: it scrolls sideways")
        outside, values = page.evaluate(VALUES_OUTSIDE)
        problems += [f"generated value outside its paragraph: {value}" for value in outside]
        if values != source_values(page_name):
            problems.append(f"{values} generated values shown, {source_values(page_name)} in the page's markdown")
        if links:
            problems += broken_links(server, page.evaluate(LINKS))
        if screenshot is not None:
            screenshot.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(screenshot), full_page=viewport == "desktop" and scheme == "light")
    finally:
        context.close()
    return problems


@functools.lru_cache(maxsize=None)
def ids_of(path: Path) -> frozenset[str]:
    return frozenset(re.findall(r'\bid="([^"]+)"', path.read_text(errors="replace")))


def broken_links(server: Server, hrefs: list[str]) -> list[str]:
    """Links within the site to a file it does not have, or to a heading its target page does not have."""
    problems = []
    for href in sorted(set(hrefs)):
        parts = urlsplit(href)
        if parts.hostname != "127.0.0.1":
            continue
        target = server.root / (parts.path.lstrip("/") or "index.html")
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            problems.append(f"broken link: {href}")
        elif parts.fragment and target.suffix == ".html" and parts.fragment not in ids_of(target):
            problems.append(f"link to a missing heading: {href}")
    return problems


@pytest.mark.slow  # the site built once (~15 s) or a browser
@pytest.mark.parametrize("page_name", site_pages())
def test_every_page_renders_offline_at_desktop_and_phone_width_in_light_and_dark(browser, served, page_name):
    problems = []
    for viewport in VIEWPORTS:
        for scheme in SCHEMES:
            shot = BUILD / "screenshots" / f"{page_name}-{viewport}-{scheme}.png"
            first = (viewport, scheme) == ("desktop", "light")  # links are the same in every view
            found = inspect(browser, served, page_name, viewport, scheme, links=first, screenshot=shot)
            problems += [f"{viewport}, {scheme}: {problem}" for problem in found]
    assert problems == []


@pytest.fixture
def broken_copy(built, tmp_path):
    """A copy of the built site to break (the calculator's data linked, not copied)."""
    copy = tmp_path / "site"
    shutil.copytree(built / "site", copy, ignore=shutil.ignore_patterns("fit"))
    (copy / "fit").symlink_to(built / "site" / "fit")
    server = Server(copy)
    yield copy, server
    server.close()


@pytest.mark.slow  # the site built once (~15 s) or a browser
def test_the_browser_check_fails_on_a_removed_figure_a_broken_link_an_external_request_and_a_stray_value(
        browser, broken_copy):
    copy, server = broken_copy
    page = copy / "03-ddp.html"
    html = page.read_text()
    assert inspect(browser, server, "03-ddp") == []
    figure = re.search(r'<img[^>]+src="(figures/plots/[^"]+\.png)"', html).group(1)
    (copy / figure).unlink()
    article = html.index("<article")
    assert 'href="04-zero.html' in html[article:]  # a link of the post's text to the next post
    html = html[:article] + html[article:].replace('href="04-zero.html', 'href="04-zero-gone.html', 1)
    html = html.replace("</body>", '<img src="https://cdn.example.org/pixel.png" alt=""></body>')
    # what a paragraph line starting with a generated value renders as: the value a block of the article's own
    opening = re.search(r"<article[^>]*>", html).end()
    page.write_text(html[:opening] + "<!-- generated:value run=x -->1.37<!-- /generated -->" + html[opening:])
    problems = inspect(browser, server, "03-ddp")
    assert f"image not shown: {figure}" in problems
    assert any(problem.startswith("HTTP 404: ") and problem.endswith(figure) for problem in problems)
    assert any(problem.startswith("broken link: ") and problem.endswith("/04-zero-gone.html")
               for problem in problems), problems
    assert "request off this machine: https://cdn.example.org/pixel.png" in problems
    assert "generated value outside its paragraph:  generated:value run=x " in problems
    assert f"{source_values('03-ddp') + 1} generated values shown, {source_values('03-ddp')} in the page's markdown" \
        in problems


def cli_answer(argv: list[str]) -> dict:
    """python -m common.memory's answer, as it prints it."""
    from common.memory import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        main(argv)
    lines = out.getvalue().splitlines()
    line = {key: next(line.removeprefix(key) for line in lines if line.startswith(key))
            for key in ("recommendation: ", "predicted peak: ", "run: ")}
    return dict(label=line["recommendation: "].split(". ")[0], peak=line["predicted peak: "].split()[0],
                command=line["run: "])


def ask_page(page, model: str, gpus: str, memory: str | None, seq_len: str, training: str, gpu: str | None = None):
    page.select_option("#fit-model", model)
    page.fill("#fit-gpus", gpus)
    if gpu:
        from common.memory import GPU_MEMORY_GIB

        page.select_option("#fit-gpu", label=f"{gpu} ({GPU_MEMORY_GIB[gpu]} GiB)")
    else:
        page.fill("#fit-mem", memory)
    page.fill("#fit-seq", seq_len)
    page.check(f"input[name=training][value={training}]")


@pytest.mark.slow  # the site built once (~15 s) or a browser
def test_the_calculator_reached_by_a_click_answers_as_the_cli(browser, served):
    from common.memory import GPU_MEMORY_GIB

    context = browser.new_context(viewport=VIEWPORTS["desktop"])
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.route("**/*", lambda route: route.continue_() if urlsplit(route.request.url).hostname == "127.0.0.1"
               else route.abort())
    try:
        page.goto(served.url + "index.html")
        page.get_by_role("article").get_by_role("link", name="Will it fit?").click()
        page.wait_for_url("**/fit.html")
        page.wait_for_selector("#fit-answer:not([hidden])")
        questions = [("qwen3-4b", "2", "24", None, "1024", "full"),
                     ("qwen3-1.7b", "1", None, "H100", "4096", "lora"),
                     ("qwen3-30b-a3b", "8", None, "H200", "2048", "full")]
        for model, gpus, memory, gpu, seq_len, training in questions:
            memory = memory or f"{GPU_MEMORY_GIB[gpu]:g}"
            ask_page(page, model, gpus, memory, seq_len, training, gpu)
            cli = (f"uv run python -m common.memory --model {model} --gpus {gpus} --gpu-mem-gib {memory} "
                   f"--seq-len {seq_len}" + {"full": "", "lora": " --lora-rank 16", "qlora": " --qlora"}[training])
            page.wait_for_function("text => document.getElementById('fit-cli').textContent === text", arg=cli)
            expected = cli_answer(cli.split()[5:])
            assert page.text_content("#fit-command") == expected["command"], cli
            assert page.text_content("#fit-verdict strong").startswith(expected["label"]), cli
            assert f"{float(page.get_attribute('#fit-answer', 'data-peak')):.2f}" == expected["peak"], cli
            assert page.is_visible("#fit-copy") and page.locator(".fit-chosen").count() == 1
        bad = [("", "the memory of one GPU", "fit-mem"), ("-5", "more than 0 GiB, not -5", "fit-mem"),
               ("0", "at least 1, not 0", "fit-gpus"), ("0", "at least 1 token, not 0", "fit-seq"),
               ("12", "1 to 8 GPUs, not 12", "fit-gpus")]
        for value, message, field in bad:
            ask_page(page, "qwen3-4b", "2", "24", "1024", "full")
            page.wait_for_selector("#fit-answer:not([hidden])")
            page.fill(f"#{field}", value)
            page.wait_for_selector("#fit-error:not([hidden])")
            assert message in page.text_content("#fit-error") and page.is_hidden("#fit-answer"), (field, value)
    finally:
        context.close()
