"""`nav`: a post's previous / index / next links, in the order blogs/README.md lists the posts."""

from __future__ import annotations

import re
from pathlib import Path

from ..engine import RegionError, generator
from ..site import Context, Site


def posts_in_order(site: Site) -> list[tuple[str, str]]:
    """(title, file) of every post blogs/README.md links to, in its order."""
    index = site.root / "blogs" / "README.md"
    if not index.exists():
        raise RegionError("nav: no blogs/README.md to read the order of the posts from")
    posts = []
    for title, target in re.findall(r"\[([^\]]+)\]\((\d\d-[\w.-]+\.md)\)", index.read_text()):
        if target not in [t for _, t in posts]:
            posts.append((title, target))
    return posts


@generator("nav", inline=True)
def gen_nav(ctx: Context, args: dict) -> str:
    page = Path(ctx.page)
    if page.parent.as_posix() != "blogs":
        raise RegionError("nav is for posts in blogs/")
    posts = posts_in_order(ctx.site)
    files = [target for _, target in posts]
    if page.name not in files:
        raise RegionError(f"nav: blogs/README.md does not list {page.name}: add it to the list of posts")
    position = files.index(page.name)
    links = []
    if position > 0:
        links.append(f"[← Previous: {posts[position - 1][0]}]({posts[position - 1][1]})")
    links.append("[Index](README.md)")
    if position + 1 < len(posts):
        links.append(f"[Next: {posts[position + 1][0]} →]({posts[position + 1][1]})")
    return " · ".join(links)
