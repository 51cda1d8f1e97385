"""The playground's browser tests: Debian's Chromium driven by Playwright (it cannot download its
own browser here), one page per test, and what they check on a canvas."""

from __future__ import annotations

import contextlib
import os
import shutil

import pytest

CHROMIUM = "/usr/bin/chromium"
INSTALL_HINT = (
    "install them with `apt-get install chromium` and `.venv/bin/pip install playwright` "
    "(Playwright drives Debian's Chromium; it cannot download its own browser here)"
)
# without these flags Chromium's background connections are refused by the closed network, many at a time
LAUNCH = {
    "executable_path": CHROMIUM,
    "headless": True,
    "args": ["--disable-background-networking", "--disable-component-update", "--no-first-run"],
}


def sync_playwright():
    """Playwright's entry point, or a failure saying how to install what is missing (`make test`
    installs Chromium when it runs as root, so a missing browser is a broken setup, never a skip)."""
    try:
        from playwright.sync_api import sync_playwright as entry  # only the browser tests need it
    except ImportError:
        entry = None
    missing = [
        what
        for what, ok in (
            ("playwright", entry is not None),
            (CHROMIUM, os.path.exists(CHROMIUM) or shutil.which("chromium")),
        )
        if not ok
    ]
    if missing:
        pytest.fail(f"{' and '.join(missing)} missing: {INSTALL_HINT}")
    return entry


@contextlib.contextmanager
def browser_page(url: str):
    """A 1280 x 900 page at ``url``; on leaving, no script error may have been thrown in it."""
    with sync_playwright()() as p:
        browser = p.chromium.launch(**LAUNCH)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            errors = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            yield page
            assert not errors, errors
        finally:
            browser.close()


def painted(page, selector: str) -> int:
    """How many canvases matching ``selector`` hold pixels of more than one colour."""
    return page.evaluate(
        """(selector) => [...document.querySelectorAll(selector)].filter((c) => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        for (let i = 4; i < d.length; i += 4)
            if (d[i] !== d[0] || d[i + 1] !== d[1] || d[i + 2] !== d[2]) return true;
        return false;
    }).length""",
        selector,
    )
