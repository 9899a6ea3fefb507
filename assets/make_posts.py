"""Generated regions of the posts (blogs/) and the devlog (devlog/): every measured number, table of runs, command,
code excerpt and figure link in them is written by this script from committed files, never typed by hand.

    uv run --group plots python assets/make_posts.py            # rewrite every region, redraw every figure (PNG + CSV)
    uv run python assets/make_posts.py --check                  # CI: fail where a page disagrees with the repository
    uv run python assets/make_posts.py --only blogs/03-fsdp.md  # one page's regions (and the figures it shows)
    uv run python assets/make_posts.py --no-figures             # regions only, without matplotlib

The writers' manual (regions, generators, what --check fails on) and the code's layout: assets/posts/README.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(1, str(REPO_ROOT))  # `common`, also for `python3 assets/make_posts.py` without an install

from posts.pages import build  # noqa: E402  (after the path set-up above; gpu_suite.py calls make_posts.build)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="regenerate in memory and fail where a page or a figure's CSV differs (CI); no matplotlib")
    parser.add_argument("--only", metavar="FILE", help="only this page (and, unless --check, the figures it shows)")
    parser.add_argument("--no-figures", action="store_true",
                        help="do not redraw the figures (no matplotlib needed); --check always compares their CSVs")
    args = parser.parse_args(argv)
    return 1 if build(REPO_ROOT, check=args.check, only=args.only, figures=not args.no_figures) else 0


if __name__ == "__main__":
    sys.exit(main())
