"""POST /v1/tinylm/score: a GPT (character tokenizer), a Kneser-Ney n-gram and a neural bigram (BPE)
served together, scored on the same text: per-byte bits that sum to `tinylm evaluate`'s bits per
byte, character bits on the same characters whatever the tokenizer, top predictions, refusals."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import make_stories
from fastapi.testclient import TestClient
from serving_util import make_run

from tinylm.constants import EOS_ID, SOS_ID
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.models.bigram import NeuralBigramLM
from tinylm.models.ngram import NGramLM
from tinylm.serving.app import create_app
from tinylm.serving.models import load_models
from tinylm.tokenizers.bpe import BPETokenizer

TEXT = "Tom had a red ball. He threw the ball to his dog, and the dog ran fast. Story number 3. Café 🙂!"


def make_count_models(root: Path) -> list[Path]:
    """A Kneser-Ney 3-gram and a seeded neural bigram on a BPE of the test stories, each with the
    tokenizer.json beside it (as `tinylm study shakespeare` saves them)."""
    stories = make_stories(60)
    tok = BPETokenizer().train(stories, 320)
    tok.save(root / "tokenizer.json")
    ids = np.array([i for t in stories for i in (SOS_ID, *tok.encode(t), EOS_ID)])
    NGramLM(3, tok.vocab_size, "kneser_ney").fit(ids).smoothed("interpolated").save(root / "ngram-3.npz")
    torch.manual_seed(0)
    bigram = NeuralBigramLM(tok.vocab_size, 16)
    pairs = torch.from_numpy(ids)
    opt = torch.optim.Adam(bigram.parameters(), lr=0.05)
    for _ in range(60):  # a few full-batch steps: a bigram that has learnt something
        opt.zero_grad()
        torch.nn.functional.cross_entropy(bigram(pairs[:-1]), pairs[1:]).backward()
        opt.step()
    bigram.save(root / "bigram.pt")
    return [root / "ngram-3.npz", root / "bigram.pt"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("compare")
    served = load_models([str(make_run(root)), *map(str, make_count_models(root))], [], max_batch=4)
    yield served
    for s in served.values():
        s.scheduler.close()


@pytest.fixture(scope="module")
def client(models):
    with TestClient(create_app(models)) as c:
        yield c


def test_every_model_on_the_same_bytes_sums_to_tinylm_evaluate(client, models):
    r = client.post("/v1/tinylm/score", json={"text": TEXT, "top": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    n_bytes = len(TEXT.encode("utf-8"))
    assert [m["model"] for m in body["models"]] == ["tinyrun", "ngram-3", "bigram"]
    assert body["bytes"] == n_bytes and body["chars"] == len(TEXT) and sum(body["char_bytes"]) == n_bytes
    for m in body["models"]:
        served = models[m["model"]]
        evaluated = evaluate_texts(served.model, served.tokenizer, [TEXT])
        assert len(m["byte_bits"]) == n_bytes and len(m["char_bits"]) == len(TEXT)
        assert sum(m["byte_bits"]) / n_bytes == pytest.approx(evaluated["bpb"], rel=1e-6)
        assert m["bpb"] == pytest.approx(evaluated["bpb"], rel=1e-6)
        assert sum(m["char_bits"]) == pytest.approx(m["bits"], rel=1e-6)
        bits = [t["bits"] for t in m["tokens"]]
        assert len(bits) == evaluated["tokens"] and sum(bits) == pytest.approx(m["bits"], rel=1e-6)
        # the tokens' character spans cover the text in order; a token with no character of its own
        # (the character tokenizer's <unk> for the emoji) shares its neighbour's
        spans = [(t["char_start"], t["char_end"]) for t in m["tokens"]]
        assert spans[0][0] == 0 and spans[-1][1] == len(TEXT)
        assert all(a[1] == b[0] or a == b for a, b in zip(spans, spans[1:]))
        for t in m["tokens"]:
            probs = [alt["prob"] for alt in t["top"]]
            assert len(probs) == 5 and probs == sorted(probs, reverse=True) and sum(probs) <= 1 + 1e-5
            # a token's bits are -log2 of its probability; when it is the most likely, that is the first entry
            if t["top"][0]["id"] == t["id"]:
                assert t["bits"] == pytest.approx(-math.log2(probs[0]), abs=1e-4)
    gpt, ngram = body["models"][0], body["models"][1]
    # characters (bytes for the two it has never seen) vs BPE pieces, on the same bytes
    assert len(gpt["tokens"]) >= len(TEXT) > len(ngram["tokens"])


def test_a_subset_of_models_and_top_0(client):
    body = client.post(
        "/v1/tinylm/score", json={"models": ["bigram", "bigram"], "text": "The dog ran.", "top": 0}
    ).json()
    assert [m["model"] for m in body["models"]] == ["bigram"]
    assert all(t["top"] == [] for t in body["models"][0]["tokens"])


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"text": ""}, 400, "text"),
        ({"text": "x", "top": 21}, 400, "top"),
        ({"text": "x", "models": []}, 400, "models"),
        ({"text": "x", "models": ["nope"]}, 404, "model"),
        ({"text": "x", "temperature": 1}, 400, "temperature"),
        ({"text": 3}, 422, "text"),
    ],
)
def test_bad_requests_name_the_field(client, body, status, param):
    r = client.post("/v1/tinylm/score", json=body)
    assert r.status_code == status and r.json()["error"]["param"] == param, r.text


def test_count_models_are_served_for_scoring_only(client):
    r = client.post("/v1/completions", json={"model": "ngram-3", "prompt": "The dog"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_cannot_generate"
    assert "order-3 n-gram, interpolated" in r.json()["error"]["message"]
    r = client.post("/v1/attention", json={"model": "bigram", "text": "The dog"})
    assert r.status_code == 400 and "no attention" in r.json()["error"]["message"]
    card = client.get("/v1/models/ngram-3").json()["card"]
    assert card["format"] == "ngram" and card["config"]["order"] == 3 and card["parameters"] > 320
    # the existing score route gives the same metrics for them
    m = client.post("/v1/score", json={"model": "bigram", "text": TEXT}).json()["metrics"]
    per_byte = client.post("/v1/tinylm/score", json={"models": ["bigram"], "text": TEXT}).json()["models"][0]
    assert m["bpb"] == pytest.approx(per_byte["bpb"], rel=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered")  # add-0 of an unseen context is 0/0
def test_a_token_of_probability_0_is_a_clear_error(tmp_path):
    tok = BPETokenizer().train(make_stories(20), 300)
    tok.save(tmp_path / "tokenizer.json")
    ids = np.array([i for t in make_stories(20) for i in (SOS_ID, *tok.encode(t), EOS_ID)])
    lm = NGramLM(2, tok.vocab_size, "add_k").fit(ids)
    lm.save(tmp_path / "ngram-2.npz")
    served = load_models([str(tmp_path / "ngram-2.npz")], [], max_batch=1)
    served["ngram-2"].model.ngram.k = 0.0  # add-0: an unseen pair has probability 0
    try:
        with TestClient(create_app(served)) as c:
            r = c.post("/v1/tinylm/score", json={"text": "zebra quartz"})
        assert r.status_code == 400 and "probability 0" in r.json()["error"]["message"], r.text
    finally:
        served["ngram-2"].scheduler.close()
