"""`tinylm serve` as a real process: the official `openai` client against it, a client that goes
away mid-stream, and the playground page driven in a real browser (Debian's Chromium through
Playwright), screenshots saved to the test's temporary directory."""

import json
import time

import httpx
import pytest
from browser_util import browser_page, painted
from serving_util import live_server, make_run

pytestmark = pytest.mark.slow  # starts a server process (~3 s) per module


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    run = make_run(tmp_path_factory.mktemp("serve"))
    # --max-tokens: a request may run for minutes, so that only cancelling it can free its row
    with live_server("--checkpoint", str(run), "--threads", "1", "--max-tokens", "1000000") as url:
        yield url


def test_openai_client_completions(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tinyrun"]

    knobs = {"max_tokens": 12, "temperature": 0.9, "extra_body": {"min_tokens": 12}}  # tinylm's knob: no early stop
    first = client.completions.create(model="tinyrun", prompt="Once upon", seed=7, **knobs)
    again = client.completions.create(model="tinyrun", prompt="Once upon", seed=7, **knobs)
    assert first.choices[0].text == again.choices[0].text and first.choices[0].text
    assert first.usage.completion_tokens == 12 and first.usage.prompt_tokens == len("Once upon") + 1  # + <sos>
    assert first.choices[0].finish_reason == "length"

    # n choices: choice k samples with seed + k, so choice 1 of seed 7 is choice 0 of seed 8
    many = client.completions.create(model="tinyrun", prompt="Once upon", seed=7, n=3, **knobs)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert many.choices[0].text == first.choices[0].text
    shifted = client.completions.create(model="tinyrun", prompt="Once upon", seed=8, **knobs)
    assert many.choices[1].text == shifted.choices[0].text

    # logprobs: the top-5 alternatives per token, the chosen token among them when greedy
    greedy = client.completions.create(
        model="tinyrun", prompt="The dog", max_tokens=6, temperature=0, logprobs=5, extra_body={"min_tokens": 6}
    )
    lp = greedy.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 5 and max(top.values()) == pytest.approx(logprob, abs=1e-6)  # greedy = the most likely
        assert logprob < 0
    assert "".join(lp.tokens) == greedy.choices[0].text

    # stop: the text ends before the stop string (OpenAI's rule)
    greedy30 = {"max_tokens": 30, "temperature": 0, "extra_body": {"min_tokens": 30}}
    full = client.completions.create(model="tinyrun", prompt="The dog", **greedy30).choices[0].text
    stop = full[5:7]
    cut = client.completions.create(model="tinyrun", prompt="The dog", stop=[stop], **greedy30)
    assert cut.choices[0].text == full[: full.find(stop)] and cut.choices[0].finish_reason == "stop"

    # streaming: the pieces join to the text of the same request without streaming
    pieces, finish = [], None
    for chunk in client.completions.create(model="tinyrun", prompt="Once upon", seed=7, stream=True, **knobs):
        pieces.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == first.choices[0].text and finish == "length"
    assert len(pieces) >= 12  # one chunk per token, and a last one

    with pytest.raises(openai.NotFoundError, match="base language models"):
        client.chat.completions.create(model="tinyrun", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tinyrun", prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="x")


def _rows_left(server) -> int:
    """Active decoding rows once they have had up to 5 s to leave."""
    for _ in range(100):
        rows = httpx.get(server + "/health").json()["active_rows"]["tinyrun"]
        if rows == 0:
            break
        time.sleep(0.05)
    return rows


def test_a_client_that_disconnects_stops_its_generation(server):
    """A million tokens take minutes: a row gone within seconds was cancelled by the disconnect."""
    long = {"model": "tinyrun", "prompt": "Once", "max_tokens": 1_000_000, "min_tokens": 1_000_000}
    with httpx.stream("POST", server + "/v1/completions", timeout=30, json={**long, "stream": True}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert httpx.get(server + "/health").json()["active_rows"]["tinyrun"] == 1
    assert _rows_left(server) == 0
    with pytest.raises(httpx.ReadTimeout):  # not streaming: the client gives up waiting
        httpx.post(server + "/v1/completions", json=long, timeout=1.0)
    assert _rows_left(server) == 0


def test_the_page_in_a_real_browser(server, tmp_path):
    with browser_page(server + "/") as page:
        page.wait_for_function("document.querySelector('#model').options.length > 0")

        # type a prompt, generate, wait for streamed tokens
        page.fill("#prompt", "Once upon a time")
        page.fill("#max_tokens", "24")
        page.fill("#seed", "3")
        page.click("#generate")
        page.wait_for_function("document.querySelectorAll('#output .chip').length >= 24", timeout=30_000)
        page.wait_for_selector("#generate:not([disabled])")
        assert "24 tokens" in page.inner_text("#gen-info")
        page.screenshot(path=str(tmp_path / "1-generated.png"))

        # click a token: its 10 alternatives, with probabilities, the chosen one among them
        page.click("#output .chip >> nth=5")
        items = page.locator("#alternatives li")
        assert items.count() == 10
        probs = [float(t.rsplit(" ", 1)[1].rstrip("%")) for t in items.all_inner_texts()]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 100.0001
        page.screenshot(path=str(tmp_path / "2-alternatives.png"))

        # attention: a layer x head grid of heat-maps with pixels drawn, one enlarged on click
        page.click("#tab-attention")
        page.click("#attention-run")
        page.wait_for_selector("#attention-grid canvas")
        maps = page.locator("#attention-grid canvas")
        assert maps.count() == 2 * 4  # 2 layers x 4 heads
        assert painted(page, "#attention-grid canvas") == 8
        maps.nth(5).click()
        assert painted(page, "#attention-zoom") == 1
        assert "layer 1, head 1" in page.inner_text("#attention-info")
        page.screenshot(path=str(tmp_path / "3-attention.png"), full_page=True)

        # compare: greedy, sampling, beam search side by side with tokens/s and log-probabilities
        page.click("#tab-compare")
        page.click("#compare-run")
        page.wait_for_function("document.querySelectorAll('#compare .column').length === 3", timeout=60_000)
        columns = page.locator("#compare .column")
        assert [columns.nth(i).get_attribute("data-setting") for i in range(3)] == ["greedy", "sampling", "beam search"]
        for i in range(3):
            assert "tokens/s" in columns.nth(i).inner_text()
            assert float(columns.nth(i).locator(".mean-logprob").inner_text()) < 0
            assert columns.nth(i).locator(".chip").count() >= 1
        page.screenshot(path=str(tmp_path / "4-compare.png"), full_page=True)

        # tokenizer and model card
        page.click("#tab-tokenizer")
        page.wait_for_selector("#tokenizer-out .tok")
        assert page.locator("#tokenizer-out .tok").count() == len("Once upon a time, there was a little cat.")
        page.click("#tab-card")
        page.wait_for_selector("#card table")
        assert "parameters" in page.inner_text("#card")
        assert painted(page, "#curves") == 1
        page.screenshot(path=str(tmp_path / "5-card.png"), full_page=True)
    for name in ("1-generated", "2-alternatives", "3-attention", "4-compare", "5-card"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5_000
    print(json.dumps({"screenshots": str(tmp_path)}))
