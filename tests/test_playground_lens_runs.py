"""The playground's "Logit lens" and "Runs" views driven in a real browser (Debian's Chromium through
Playwright), against `tinylm serve --runs DIR` while a `--quick` training writes into DIR, so the
curves must grow without a reload; then the whole page with the keyboard alone, and axe-core's
rules on every view. Screenshots go to the test's temporary directory."""

import json
import re
import subprocess
import sys
import time

import httpx
import pytest
from browser_util import browser_page, painted
from serving_util import REPO, live_server, make_run

pytestmark = pytest.mark.slow  # a training and a server process, a browser

TEXT = "Once upon a time"


def _rows(path) -> int:
    try:
        return max(0, path.read_text().count("\n") - 1)
    except FileNotFoundError:
        return 0


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    """DIR with a finished run (tinyrun) and a `--quick` training still running into DIR/live."""
    root = tmp_path_factory.mktemp("runs")
    make_run(root)
    # a long wall budget and a row every 2 steps: the run trains (and logs) all through the tests
    train = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tinylm.cli",
            "train",
            "--config",
            "demo",
            "--quick",
            "--out",
            str(root / "live"),
            "train.max_steps=100000",
            "train.max_minutes=4",
            "train.log_interval=2",
            "train.eval_interval=10",
            "train.threads=1",
            "train.progress=false",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 180
        while _rows(root / "live" / "metrics.csv") < 2:
            if train.poll() is not None:
                raise RuntimeError(f"the training exited with {train.returncode}: {train.stdout.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError("the training logged no rows in 180 s")
            time.sleep(0.5)
        yield root
    finally:
        train.terminate()
        train.wait(timeout=30)


@pytest.fixture(scope="module")
def server(runs_dir):
    with live_server("--checkpoint", str(runs_dir / "tinyrun"), "--runs", str(runs_dir), "--threads", "1") as url:
        yield url


@pytest.fixture()
def page(server):
    with browser_page(server + "/") as page:
        page.wait_for_function("document.querySelector('#model').options.length > 0")
        yield page


def show_lens(page, model_rows: int, positions: int) -> None:
    page.click("#tab-lens")
    page.fill("#lens-text", TEXT)
    page.click("#lens-run")
    page.wait_for_selector("#lens-grid .lens-cell")
    assert page.locator("#lens-grid tbody tr").count() == model_rows
    for row in range(model_rows):
        assert page.locator(f"#lens-grid tbody tr >> nth={row} >> .lens-cell").count() == positions


def test_logit_lens_view(page, tmp_path):
    show_lens(page, 3, len(TEXT) + 1)  # tinyrun: embeddings, layer 1, layer 2; the start token and each character
    assert [page.locator("#lens-grid tbody th").nth(i).inner_text() for i in range(3)] == [
        "embeddings",
        "layer 1",
        "layer 2",
    ]
    info = page.inner_text("#lens-info")
    hits = int(re.search(r"next one at (\d+) of 16 positions after the last layer", info).group(1))
    assert page.locator("#lens-grid tbody tr >> nth=2 >> .lens-cell.hit").count() == hits
    # a cell's five most likely tokens, probabilities falling, with p of the token that comes next
    page.click("#lens-grid tbody tr >> nth=2 >> .lens-cell >> nth=4")
    items = page.locator("#lens-cell li")
    assert items.count() == 5
    probs = [float(t.rsplit(" ", 1)[1].rstrip("%")) for t in items.all_inner_texts()]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 100.0001
    assert re.search(
        r"layer 2, position 4 \(after \"e\"\): the next token \" \" has p = [\d.]+%",
        page.inner_text("#lens-cell-where"),
    )
    page.screenshot(path=str(tmp_path / "lens.png"), full_page=True)


def _shown_rows(page) -> int:
    return int(re.search(r"(\d+) rows", page.inner_text("#runs-info")).group(1))


def test_runs_view_follows_a_training_run(page, server, runs_dir, tmp_path):
    page.evaluate("window.notReloaded = true")
    page.click("#tab-runs")
    page.wait_for_function("[...document.querySelectorAll('#runs-list option')].some((o) => o.value === 'live')")
    assert [o.strip() for o in page.locator("#runs-list option").all_inner_texts()] == ["live", "tinyrun"]
    page.select_option("#runs-list", "live")
    page.wait_for_function("/^live: step \\d+/.test(document.querySelector('#runs-info').textContent)")
    first = _shown_rows(page)
    assert "\u2014 training (last row" in page.inner_text("#runs-info")
    # the curves grow while the run trains: more rows arrive by polling, the page is never reloaded
    page.wait_for_function(
        f"Number(document.querySelector('#runs-info').textContent.match(/(\\d+) rows/)[1]) > {first}", timeout=90_000
    )
    assert page.evaluate("window.notReloaded === true")
    assert _shown_rows(page) <= _rows(runs_dir / "live" / "metrics.csv")
    assert painted(page, "#runs-loss, #runs-ppl") == 2
    assert "step" in page.get_attribute("#runs-loss", "aria-label")
    # the config as written by the trainer
    page.click("#runs-config-box summary")
    assert "max_minutes: 4" in page.inner_text("#runs-config")

    # overlay the finished run: both in the legend, its curves dashed
    page.select_option("#runs-overlay", "tinyrun")
    page.wait_for_function("document.querySelector('#runs-legend').textContent.includes('tinyrun')")
    assert "live train" in page.inner_text("#runs-legend")
    page.screenshot(path=str(tmp_path / "runs-live.png"), full_page=True)

    # the first evaluation wrote checkpoints: sample the run's prompts with one, then load it
    best = "#runs-checkpoints tr[data-checkpoint=best]"
    page.wait_for_selector(best, timeout=120_000)
    page.click(f"{best} button.samples")
    page.wait_for_selector("#runs-samples section[data-checkpoint=best] li", timeout=60_000)
    prompts = [
        t.split("\n")[0] for t in page.locator("#runs-samples section[data-checkpoint=best] li b").all_inner_texts()
    ]
    assert prompts == ["ROMEO:", "To be, or not to be"]  # the demo preset's quick prompts
    # the samples the trainer wrote at each evaluation arrive by polling too, the newest open
    page.wait_for_selector("#runs-eval-samples details[open] li", timeout=60_000)
    newest = page.inner_text("#runs-eval-samples details[open] summary")
    assert re.fullmatch(r"step \d+0 \([\d,]+ tokens\): samples at this evaluation", newest), newest  # eval_interval 10
    assert [
        t.split("\n")[0] for t in page.locator("#runs-eval-samples details[open] li b").all_inner_texts()
    ] == prompts
    page.click(f"{best} button.load")
    page.wait_for_function("document.querySelector('#model').value === 'live-best'", timeout=60_000)
    assert "as model live-best" in page.inner_text("#runs-info")
    assert [o.strip() for o in page.locator("#model option").all_inner_texts()] == ["tinyrun", "live-best"]
    # the loaded checkpoint in another view: the demo's quick model has 2 layers and a BPE tokenizer
    ids = httpx.post(server + "/v1/tokenize", json={"model": "live-best", "text": TEXT}).json()["ids"]
    show_lens(page, 3, len(ids) + 1)
    assert page.inner_text("#lens-info").startswith("live-best: 3 rows")


def _tab_to(page, selector: str, key: str = "Tab", limit: int = 60) -> None:
    """Press Tab (or Shift+Tab) until the focused element matches ``selector``: it is reachable by keyboard."""
    for _ in range(limit):
        page.keyboard.press(key)
        if page.evaluate("(s) => document.activeElement.matches(s)", selector):
            return
    raise AssertionError(f"{selector} is not reachable with Tab")


def test_the_whole_page_by_keyboard_and_axe(page, tmp_path):
    from axe_playwright_python.sync_playwright import Axe  # the browser test's own dev dependency

    # tab order: the header's model menu and key, then the views, in reading order
    order = []
    for _ in range(4):
        page.keyboard.press("Tab")
        order.append(page.evaluate("document.activeElement.id"))
    assert order == ["model", "api-key", "tab-generate", "tab-attention"]
    labels = page.evaluate("[...document.querySelectorAll('#tabs button')].map((b) => b.getAttribute('aria-selected'))")
    assert labels[0] == "true" and set(labels[1:]) == {"false"}

    # generate with the keyboard, then a token's alternatives with Enter
    _tab_to(page, "#generate")
    page.keyboard.press("Enter")
    page.wait_for_selector("#generate:not([disabled])", timeout=30_000)
    _tab_to(page, "#output .chip")
    page.keyboard.press("Enter")
    assert page.locator("#alternatives li").count() == 10

    # attention: a map enlarged with Enter
    _tab_to(page, "#tab-attention")
    page.keyboard.press("Enter")
    _tab_to(page, "#attention-run")
    page.keyboard.press("Enter")
    page.wait_for_selector("#attention-grid canvas")
    _tab_to(page, "#attention-grid canvas")
    page.keyboard.press("Enter")
    assert painted(page, "#attention-zoom") == 1

    # the logit lens: run it, then a cell's top tokens, all with Tab and Enter
    _tab_to(page, "#tab-lens")
    page.keyboard.press("Enter")
    assert page.get_attribute("#tab-lens", "aria-selected") == "true"
    _tab_to(page, "#lens-run")
    page.keyboard.press("Enter")
    page.wait_for_selector("#lens-grid .lens-cell")
    page.keyboard.press("Tab")  # the grid is one Tab stop, right after the button: its first cell
    assert (
        page.evaluate("document.activeElement.dataset.layer + ',' + document.activeElement.dataset.position") == "0,0"
    )
    for key in ("ArrowDown", "ArrowDown", "ArrowRight", "End", "ArrowLeft", "Enter"):
        page.keyboard.press(key)
    assert page.locator("#lens-cell li").count() == 5
    assert page.inner_text("#lens-cell-where").startswith("layer 2, position 30 ")  # 32 positions: the context
    page.keyboard.press("Tab")  # the grid is left in one step
    assert not page.evaluate("document.activeElement.classList.contains('lens-cell')")

    # runs: choose the finished run with the keyboard and load its checkpoint
    _tab_to(page, "#tab-runs", "Shift+Tab")
    page.keyboard.press("Enter")
    _tab_to(page, "#runs-list")
    page.wait_for_function("document.querySelectorAll('#runs-list option').length === 2")
    page.keyboard.press("End")  # the last run in the menu: tinyrun
    page.wait_for_function("/^tinyrun: /.test(document.querySelector('#runs-info').textContent)")
    _tab_to(page, "#runs-checkpoints button.load")
    page.keyboard.press("Enter")
    page.wait_for_function("document.querySelector('#model').value === 'tinyrun-best'", timeout=60_000)

    # axe-core on every view, each shown with what the steps above put in it
    found = {}
    for tab in page.locator("#tabs button").all():
        tab.click()
        page.wait_for_timeout(300)
        violations = Axe().run(page).response["violations"]
        if violations:
            found[tab.inner_text()] = [
                (v["id"], v["impact"], [n["target"] for n in v["nodes"]][:3]) for v in violations
            ]
    page.screenshot(path=str(tmp_path / "keyboard.png"), full_page=True)
    assert not found, json.dumps(found, indent=1)
