#!/usr/bin/env python3
"""Check a built documentation site as a reader opening it from disk would meet it.

    NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d SITE
    .venv/bin/python scripts/site-check.py SITE              # links, no browser
    .venv/bin/python scripts/site-check.py SITE --browser    # and headless Chromium from file://

Without a browser: every relative link, image, stylesheet and script of every page leads
to a file (a link that leads to a folder is what a directory URL becomes on disk: a folder
listing). With ``--browser`` (Debian's ``chromium`` and ``chromium-driver``, and the
``selenium`` of the docs extra; ``scripts/install-site-check.sh`` installs them): Chromium
opens ``index.html`` from ``file://``, follows every link of the navigation and checks that
each reaches a page of the site, then at a 1280 px wide window checks that no table of the
pages named by ``--unclipped`` (default: the scheme comparison) is wider than its box. Prints
what it checked; exits 1, naming each failure, when one fails.
"""

from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

WIDTH = 1280
UNCLIPPED = ("compare.html",)


class _Refs(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value and (tag, name) in (("a", "href"), ("img", "src"), ("link", "href"), ("script", "src")):
                self.refs.append(value)


def broken_links(site: Path) -> tuple[int, list[str]]:
    """(relative references checked, those that lead to no file)."""
    checked, bad = 0, []
    for page in sorted(site.rglob("*.html")):
        if page.relative_to(site) == Path("404.html"):
            continue  # a server's error page: its links are absolute (/...), for any URL it is served at
        parser = _Refs()
        parser.feed(page.read_text(errors="replace"))
        for ref in parser.refs:
            u = urlsplit(ref)
            if u.scheme or u.netloc or not u.path:  # another site, or an anchor of this page
                continue
            checked += 1
            target = (page.parent / unquote(u.path)).resolve()
            if not target.is_file():
                what = "a folder (a directory URL)" if target.is_dir() else "nothing"
                bad.append(f"{page.relative_to(site)}: {ref} leads to {what}")
    return checked, bad


def _driver(width: int):  # type: ignore[no-untyped-def]
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--window-size={width},900"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


_CLIPPED = """return Array.from(document.querySelectorAll('.md-content table')).map(t => {
  const box = t.parentElement.getBoundingClientRect(), r = t.getBoundingClientRect();
  return [t.scrollWidth > t.clientWidth + 1 || r.right > box.right + 1 || r.right > window.innerWidth,
          t.rows[0] ? t.rows[0].innerText.slice(0, 60) : ''];
}).filter(x => x[0]).map(x => x[1]);"""


def browse(site: Path, unclipped: tuple[str, ...], width: int = WIDTH) -> tuple[int, list[str]]:
    """(navigation links followed, failures) in headless Chromium from file://."""
    drv = _driver(width)
    bad = []
    try:
        root = (site / "index.html").resolve().as_uri()
        drv.get(root)
        links = drv.execute_script("return Array.from(document.querySelectorAll('nav.md-nav--primary "
                                   "a.md-nav__link[href]')).map(a => a.href);")
        pages = sorted({str(x).split("#")[0] for x in links})
        for url in pages:
            drv.get(url)
            ok = drv.execute_script("return !!document.querySelector('.md-content article');")
            if not ok or drv.title.startswith("Index of"):
                bad.append(f"{url}: not a page of the site (title {drv.title!r})")
        for name in unclipped:
            drv.get((site / name).resolve().as_uri())
            for head in drv.execute_script(_CLIPPED):
                bad.append(f"{name}: a table is clipped at {width} px: {head!r}")
    finally:
        drv.quit()
    return len(pages), bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("site", type=Path, help="The built site (mkdocs build -d SITE).")
    ap.add_argument("--browser", action="store_true", help="Also open it in headless Chromium from file://.")
    ap.add_argument("--unclipped", default=",".join(UNCLIPPED),
                    help="Comma-separated pages whose tables must fit at 1280 px (default: %(default)s).")
    a = ap.parse_args(argv)
    if not (a.site / "index.html").is_file():
        print(f"site-check: {a.site}/index.html: no built site there", file=sys.stderr)
        return 2
    checked, bad = broken_links(a.site)
    print(f"site-check: {checked} relative links, images, stylesheets and scripts: {len(bad)} lead to no file")
    if a.browser:
        n, more = browse(a.site, tuple(x for x in a.unclipped.split(",") if x))
        print(f"site-check: Chromium from file://: {n} navigation links followed, tables of {a.unclipped} at "
              f"{WIDTH} px: {len(more)} failures")
        bad += more
    for b in bad:
        print(f"  {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
