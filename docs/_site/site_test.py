"""The built site (``out/docs``, ``make docs``) as a reader gets it; ``make docs-check`` runs this.

Read from the files: every internal link and image of every page resolves, every
lesson's page shows what it printed, the gallery has a thumbnail per lesson, the
API reference has an entry for every public name, the Flax example's page shows
its loss curves. In headless Chromium (Debian's ``chromium``), the site served on
127.0.0.1: the screenshots of the landing page, the math page and the lessons'
gallery (``out/docs-check/*.png``, each looked at for being more than a blank
page), every file those pages load is found, the math is typeset by the bundled
MathJax, and the search page finds ``num_items``.
"""

from __future__ import annotations

import functools
import html.parser
import http.server
import os
import posixpath
import re
import shutil
import tempfile
import threading
import urllib.parse

import _headlines
import public_api
import pytest
import staging

from testkit import run_bounded

pytestmark = [pytest.mark.slow, pytest.mark.full]  # needs the built site: make docs-check

SITE = staging.ROOT / "out" / "docs"
SHOTS = staging.ROOT / "out" / "docs-check"
NO_CHROMIUM = (
    "chromium is not installed: `apt-get install -y chromium` (make docs-check does it"
    " when it runs as root; CI does)"
)
# Chromium's own requests, which no page makes.
BROWSER_REQUESTS = {"/favicon.ico"}


class Page(html.parser.HTMLParser):
    """The ids of a page and the addresses it links to or loads (``href``, ``src``)."""

    def __init__(self, text: str):
        super().__init__()
        self.ids: set[str] = set()
        self.addresses: list[tuple[str, str]] = []  # (tag, address)
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        for key in ("href", "src"):
            if attrs.get(key) is not None:
                self.addresses.append((tag, attrs[key]))


@functools.cache
def page(relative: str) -> Page:
    return Page((SITE / relative).read_text())


def pages() -> list[str]:
    return sorted(p.relative_to(SITE).as_posix() for p in SITE.rglob("*.html"))


@pytest.fixture(scope="module", autouse=True)
def built_site():
    if not (SITE / "index.html").is_file():
        pytest.fail("out/docs is not built: run `make docs` (make docs-check builds it first)")


def test_internal_links_and_images_resolve():
    broken = []
    for name in pages():
        for tag, address in page(name).addresses:
            parts = urllib.parse.urlsplit(address)
            if parts.scheme or parts.netloc or address.startswith("mailto:"):
                continue  # another site (the theme's credits): the site itself is offline
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), parts.path))
            target = name if not parts.path else target
            if target.startswith("..") or not (SITE / target).is_file():
                broken.append(f"{name}: <{tag}> {address}: no such file")
            elif parts.fragment and target.endswith(".html"):
                if urllib.parse.unquote(parts.fragment) not in page(target).ids:
                    broken.append(f"{name}: <{tag}> {address}: no such anchor")
    assert not broken, "\n".join(broken)


def test_every_lesson_page_shows_what_it_printed():
    for path in staging.LESSON_PATHS:
        text = (SITE / staging.LESSONS / f"{path.stem}.html").read_text()
        printed = re.findall(r"sphx-glr-script-out.*?<pre>(.*?)</pre>", text, re.S)
        if not _headlines.runnable(path.name[:2]):  # the output its own environment recorded
            printed = re.findall(r"highlight-text.*?<pre>(.*?)</pre>", text, re.S)
            assert "recorded on" in text, f"{path.name}: its recorded output is not labelled"
        assert printed and printed[-1].strip(), f"{path.name}: no output on its page"
    gallery = (SITE / staging.LESSONS / "index.html").read_text()
    thumbnails = re.findall(r'class="sphx-glr-thumbcontainer"', gallery)
    assert len(thumbnails) == len(staging.LESSON_PATHS)


def test_api_reference_lists_every_public_name():
    missing = []
    for module_name in public_api.PUBLIC_MODULES:
        ids = page(f"api/{module_name}.html").ids
        missing += [
            f"{module_name}.{name}"
            for name in public_api.public_names(module_name)
            if f"{module_name}.{name}" not in ids
        ]
    assert not missing, "names without an entry in the API reference:\n" + "\n".join(missing)


def test_flax_lm_page_shows_its_loss_curves():
    images = [a for tag, a in page("examples/flax_lm/README.html").addresses if tag == "img"]
    assert any(a.endswith("loss_curves.png") for a in images), images


# --- in the browser -----------------------------------------------------------------------


class Server(http.server.ThreadingHTTPServer):
    """The site on 127.0.0.1 (a free port), and every request it answered: (path, status)."""

    def __init__(self):
        answered = self.answered = []

        class Handler(http.server.SimpleHTTPRequestHandler):
            def send_response(self, code, message=None):
                answered.append((urllib.parse.urlsplit(self.path).path, code))
                super().send_response(code, message)

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), functools.partial(Handler, directory=str(SITE)))
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


@pytest.fixture(scope="module")
def server():
    with Server() as running:
        thread = threading.Thread(target=running.serve_forever, daemon=True)
        thread.start()
        yield running
        running.shutdown()
        thread.join(timeout=10)


def chromium(url: str, *args: str) -> str:
    """Opens ``url`` in headless Chromium, lets its scripts run, returns what it printed."""
    executable = shutil.which("chromium")
    if executable is None and os.environ.get("JAXACCUM_REQUIRE_CHROMIUM"):
        pytest.fail(f"JAXACCUM_REQUIRE_CHROMIUM is set (CI): {NO_CHROMIUM}")
    if executable is None:
        pytest.skip(NO_CHROMIUM)
    with tempfile.TemporaryDirectory() as profile:
        # no network but 127.0.0.1: Chromium's own background connections stay off
        returncode, out, err = run_bounded(
            [
                executable,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                f"--user-data-dir={profile}",
                "--hide-scrollbars",
                "--virtual-time-budget=30000",
                *args,
                url,
            ],  # fmt: skip
            timeout=120,  # a page takes seconds; the bound is for a busy machine
        )
    assert returncode == 0, err[-3000:]
    return out


def assert_math_typeset(dom: str, address: str) -> None:
    """Every display equation of the page is MathJax's output, without an error or raw TeX."""
    blocks = dom.count('class="math notranslate nohighlight"')
    typeset = len(re.findall(r'<mjx-container[^>]*jax="CHTML"[^>]*display="true"', dom))
    assert typeset == blocks, f"{address}: {typeset} of {blocks} display equations typeset"
    assert "<mjx-merror" not in dom, f"{address}: MathJax could not read an equation"
    text = re.sub(r"<[^>]+>", "", re.sub(r"<(style|script)\b.*?</\1>", "", dom, flags=re.S))
    assert "$$" not in text and "\\[" not in text, f"{address}: raw TeX left on the page"


@pytest.mark.parametrize(
    "name, address, height",  # each page's first screen, and its equations for the math
    [
        ("landing", "index.html", 1000),
        ("math", "docs/math.html", 1600),
        ("gallery", f"{staging.LESSONS}/index.html", 1400),
    ],  # fmt: skip
)
def test_screenshot(server, name, address, height):
    from PIL import Image, ImageStat

    SHOTS.mkdir(parents=True, exist_ok=True)
    shot = SHOTS / f"{name}.png"
    shot.unlink(missing_ok=True)
    server.answered.clear()
    # the DOM as it is when the screenshot is taken
    dom = chromium(f"{server.url}/{address}", "--dump-dom", f"--screenshot={shot}",
                   f"--window-size=1280,{height}")  # fmt: skip
    with Image.open(shot) as image:
        assert image.size == (1280, height)
        # a page with text and a sidebar, not a blank one: the grey levels spread widely
        assert ImageStat.Stat(image.convert("L")).stddev[0] > 20
    missing = [(p, c) for p, c in server.answered if c != 200 and p not in BROWSER_REQUESTS]
    assert not missing, f"{address} loaded files the server did not have: {missing}"
    assert (f"/{address}", 200) in server.answered
    assert_math_typeset(dom, address)


@pytest.mark.parametrize("address", ["docs/math.html", "api/bigbatch.html"])
def test_math_is_typeset(server, address):
    dom = chromium(f"{server.url}/{address}", "--dump-dom")
    assert 'class="math notranslate nohighlight"' in dom, f"{address} has no equation"
    assert_math_typeset(dom, address)


def test_search_finds_num_items(server):
    dom = chromium(f"{server.url}/search.html?q=num_items", "--dump-dom")
    found = re.findall(r'<li class="kind-\w+"><a href="([^"]+)"', dom)
    # the pages that define num_items: the API reference and the math
    for expected in ("api/jaxaccum.html", "docs/math.html", "index.html"):
        assert expected in found, f"search for num_items: {expected} not among {found}"
