"""The playground's "Compare models" view driven in a real browser (Debian's Chromium through
Playwright) against `tinylm serve` with a GPT, a Kneser-Ney n-gram and a neural bigram: a document
picked from a validation file, a row per model with its bits per byte (the API's numbers), the
difference row, the spans where each model wins, a span's top-5 per model, by mouse and by
keyboard. Screenshots go to the test's temporary directory."""

import json

import httpx
import pytest
from browser_util import browser_page
from serving_util import live_server, make_run
from test_serving_compare import make_count_models

pytestmark = pytest.mark.slow  # a server process and a browser

DOCUMENTS = [
    "The cat liked to play in the sun. Story number 1.",
    "Tom had a red ball. He threw the ball to his dog, and the dog ran fast. Story number 2.",
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("playground_compare")
    run = make_run(root)
    ngram, bigram = make_count_models(root)
    valid = root / "valid.txt"
    valid.write_text("".join(f"{d}\n<|endoftext|>\n" for d in DOCUMENTS), encoding="utf-8")
    with live_server(
        "--checkpoint", str(run), "--checkpoint", str(ngram), "--checkpoint", str(bigram), "--threads", "1"
    ) as url:
        yield url, valid


def _compare(page, a: str, b: str) -> None:
    page.select_option("#versus-a", a)
    page.select_option("#versus-b", b)
    page.click("#versus-run")  # the button is disabled until the models have answered
    page.wait_for_selector("#versus-run:not([disabled])", timeout=60_000)
    assert page.locator("#versus-rows .versus-row").count() == 4, page.inner_text("#versus-info")


def test_compare_models_view(served, tmp_path):
    url, valid = served
    expected = httpx.post(url + "/v1/tinylm/score", json={"text": DOCUMENTS[1]}, timeout=60).json()
    with browser_page(url + "/") as page:
        page.click("#tab-versus")
        page.wait_for_function("document.querySelectorAll('#versus-models input').length === 3")
        assert page.locator("#versus-models input:checked").count() == 3

        # a document of a validation file: split at <|endoftext|> as `tinylm evaluate --data` splits it
        page.set_input_files("#versus-file", str(valid))
        page.wait_for_function("document.querySelector('#versus-doc').options.length === 2")
        page.select_option("#versus-doc", "1")
        assert page.input_value("#versus-text") == DOCUMENTS[1]

        _compare(page, "ngram-3", "tinyrun")  # the trained n-gram against an untrained GPT
        rows = page.locator("#versus-rows .versus-row")
        for i, m in enumerate(expected["models"]):  # the API's bits per byte, on the page
            assert rows.nth(i).locator(".versus-title").inner_text() == m["model"]
            assert f"{m['bpb']:.4f} bits per byte" in rows.nth(i).inner_text()
            assert rows.nth(i).locator(".versus-span").count() >= 1
        assert rows.nth(3).locator(".versus-title").inner_text() == "ngram-3 minus tinyrun"
        # the difference row's spans hold every character once
        assert "".join(rows.nth(3).locator(".versus-span").all_inner_texts()) == DOCUMENTS[1]
        page.screenshot(path=str(tmp_path / "1-rows.png"), full_page=True)

        # a span of the difference row: each model's top-5 where it starts, probabilities in order
        rows.nth(3).locator(".versus-span").nth(4).click()
        assert page.locator("#versus-detail .versus-model").count() == 3
        for k in range(3):
            items = page.locator("#versus-detail ol").nth(k).locator("li")
            assert items.count() == 5
            probs = [float(t.rsplit(" ", 1)[1].rstrip("%")) for t in items.all_inner_texts()]
            assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 100.0001
        assert page.locator("#versus-rows .versus-span.selected").count() >= 3

        # where each model wins most: the spans sorted by the difference, each one selectable
        page.select_option("#versus-sort", "b")
        assert "tinyrun wins most" in page.inner_text("#versus-ranking-title")
        ranked = page.locator("#versus-ranking button")
        if ranked.count():
            saved = [float(t.rsplit(" ", 2)[1]) for t in ranked.all_inner_texts()]
            assert saved == sorted(saved, reverse=True)
        page.select_option("#versus-sort", "a")
        assert "ngram-3 wins most" in page.inner_text("#versus-ranking-title")
        assert ranked.count() >= 1
        ranked.nth(0).click()
        assert page.inner_text("#versus-where").startswith("characters ")

        # the keyboard alone: a token is a button (Tab reaches it), Enter chooses it
        first = rows.nth(2).locator(".versus-span").nth(2)
        first.focus()
        page.keyboard.press("Enter")
        assert "bigram:" in page.inner_text("#versus-detail")
        start = first.get_attribute("data-start")
        assert page.inner_text("#versus-where").startswith(f"characters {start}\u2013")
        page.keyboard.press("Shift+Tab")
        assert page.evaluate("document.activeElement.classList.contains('versus-span')")

        # two models of the same tokenizer; then a text typed in
        _compare(page, "bigram", "ngram-3")
        assert "bigram minus ngram-3" in page.inner_text("#versus-rows")
        page.fill("#versus-text", "The dog ran.")
        _compare(page, "tinyrun", "bigram")
        assert "".join(rows.nth(3).locator(".versus-span").all_inner_texts()) == "The dog ran."
        page.screenshot(path=str(tmp_path / "2-detail.png"), full_page=True)
    for name in ("1-rows", "2-detail"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5_000
    print(json.dumps({"screenshots": str(tmp_path)}))
