"""/v1/completions as likelihood tools call it (lm-evaluation-harness's local-completions model):
``echo`` with ``max_tokens`` 0 or 1 and ``logprobs``, a log probability for every prompt token,
prompts in every shape OpenAI takes and several in one request; and how served models are named."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from serving_util import make_run

from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.serving.app import create_app
from tinylm.serving.completions import JSON_SLICE, Chained, Limits, Mapped, has_long_list, json_body, prompt_offsets
from tinylm.serving.models import load_models, model_name
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.word import WordTokenizer

TEXTS = ["The dog ran.", "Lily saw a big tree, naïve ☃."]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    models = load_models([str(make_run(tmp_path_factory.mktemp("logprobs")))], [], max_batch=8)
    yield models["tinyrun"]
    models["tinyrun"].scheduler.close()


@pytest.fixture(scope="module")
def client(served):
    with TestClient(create_app({served.name: served}, Limits(max_tokens=64, max_choices=8))) as c:
        yield c


def score(client, prompt, max_tokens=0, logprobs=3, **extra):
    r = client.post(
        "/v1/completions",
        json={
            "model": "tinyrun",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "echo": True,
            "logprobs": logprobs,
            "temperature": 0,
            **extra,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def check_prompt_part(choice, served, ids, top=3):
    """Every prompt token is listed with its text, offset and log probability (the first: null)."""
    tok = served.tokenizer
    lp = choice["logprobs"]
    n = len(ids)
    assert lp["tokens"][:n] == [tok.decode([i]) for i in ids]
    assert lp["text_offset"][:n] == [len(tok.decode(ids[:k])) for k in range(n)]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = served.sequence_logprobs(ids, top)
    assert lp["token_logprobs"][1:n] == pytest.approx(expected.logprobs.tolist(), abs=1e-5)
    for got, alternatives in zip(lp["top_logprobs"][1:n], expected.alternatives()):
        assert 1 <= len(got) <= top and max(got.values()) == pytest.approx(alternatives[0][1], abs=1e-5)


@pytest.mark.parametrize("shape", ["string", "strings", "ids", "lists"])
def test_echo_scores_every_prompt_token_in_every_prompt_shape(client, served, shape):
    tok = served.tokenizer
    ids = [[tok.bos_id] + tok.encode(t) for t in TEXTS]
    prompt = {"string": TEXTS[0], "strings": TEXTS, "ids": ids[0], "lists": ids}[shape]
    body = score(client, prompt)
    assert len(body["choices"]) == (1 if shape in ("string", "ids") else 2)
    assert body["usage"]["completion_tokens"] == 0
    for choice, text, row in zip(body["choices"], TEXTS, ids):
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["token_logprobs"]) == len(row)
        check_prompt_part(choice, served, row)


def test_a_batch_scores_as_its_prompts_one_by_one(client, served):
    tok = served.tokenizer
    rows = [tok.encode(t) for t in ("a cat", "The sun was shining and the birds were singing.", "x")]
    together = score(client, rows)["choices"]
    for row, choice in zip(rows, together):
        alone = score(client, row)["choices"][0]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(alone["logprobs"]["token_logprobs"], abs=1e-5)


def test_the_harness_request_scores_the_prompt_then_one_new_token(client, served):
    """local-completions sends max_tokens 1 and reads token_logprobs[ctxlen:-1]: the prompt's part."""
    tok = served.tokenizer
    context, continuation = tok.encode("Tom had a"), tok.encode(" red ball")
    body = score(client, [context + continuation], max_tokens=1, logprobs=1, seed=1234)
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(context + continuation) + 1
    scored = served.sequence_logprobs(context + continuation)
    assert sum(lp["token_logprobs"][len(context) : -1]) == pytest.approx(
        float(scored.logprobs[len(context) - 1 :].sum()), abs=1e-4
    )
    greedy = lp["top_logprobs"][-1]  # temperature 0: the new token is the most likely one
    assert lp["token_logprobs"][-1] == pytest.approx(max(greedy.values()))


@pytest.mark.parametrize("long", [False, True])
def test_one_new_token_scores_prompts_of_every_length_in_one_request(client, served, long):
    """Prompts that fit the context are scored in the decoding rows' own prefill (left-padded
    together); a request with a prompt longer than the context is scored apart, in windows."""
    tok = served.tokenizer
    rows = [tok.encode(t) for t in ("a cat", "The sun was shining and the birds were singing.", "x y")]
    if long:
        rows.append(tok.encode("The dog and the cat were friends. " * 8))
        assert len(rows[-1]) > served.context_length
    body = score(client, rows, max_tokens=1, logprobs=2)
    for row, choice in zip(rows, body["choices"]):
        check_prompt_part(choice, served, row, top=2)
        assert len(choice["logprobs"]["token_logprobs"]) == len(row) + 1


def test_a_streamed_echo_lists_the_scored_prompt_then_each_token(client, served):
    """A stream sends the prompt's log probabilities in its first chunk, then a chunk per token:
    the same numbers as the whole response."""
    body = {"model": "tinyrun", "prompt": "The dog", "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    parts = [json.loads(line[6:])["choices"][0]["logprobs"] for line in lines[:-1]]
    streamed = [lp for part in parts if part is not None for lp in part["token_logprobs"]]
    assert len(parts[0]["token_logprobs"]) == 1 + len(served.tokenizer.encode("The dog"))  # the prompt, with <sos>
    assert streamed == pytest.approx(whole["token_logprobs"], abs=1e-5)


def test_a_stop_token_that_ends_a_choice_is_listed_last(client, served):
    """The scheduler ends a row on a stop id without emitting it; with echo the logprobs still end
    with it (text ""), as OpenAI's do, so the harness's [ctxlen:-1] keeps every prompt token."""
    ids = served.tokenizer.encode("The dog ran")
    greedy = int(served.sequence_logprobs(ids + [0], top=1).top_ids[-1, 0])  # the likeliest token after the prompt
    body = score(client, [ids], max_tokens=1, logprobs=2, stop_ids=[greedy])
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["tinylm"]["token_ids"] == [] and choice["finish_reason"] == "stop"
    assert len(lp["token_logprobs"]) == len(ids) + 1 and lp["tinylm_top"][-1][0]["id"] == greedy
    assert lp["token_logprobs"][-1] == pytest.approx(lp["tinylm_top"][-1][0]["logprob"])
    assert lp["tokens"][-1] == served.tokenizer.decode([greedy]) and lp["text_offset"][-1] == len(choice["text"])
    check_prompt_part(choice, served, ids, top=2)


def test_a_sampled_stop_token_is_the_one_the_decoder_drew(client, served):
    """With every id a stop id, the first token drawn ends the choice: the token listed last is the
    one the same seed draws without stop ids (text and log probability), not the likeliest one."""
    ids = served.tokenizer.encode("The dog ran")
    every_id = list(range(served.vocab_size))
    drawn, listed = [], []
    for seed in range(6):
        knobs = {"max_tokens": 1, "logprobs": 1, "temperature": 3.0, "seed": seed}
        free = score(client, [ids], **knobs)["choices"][0]
        stopped = score(client, [ids], stop_ids=every_id, **knobs)["choices"][0]
        assert stopped["finish_reason"] == "stop" and stopped["tinylm"]["token_ids"] == []
        drawn.append((free["logprobs"]["tokens"][-1], free["logprobs"]["token_logprobs"][-1]))
        listed.append((stopped["logprobs"]["tokens"][-1], stopped["logprobs"]["token_logprobs"][-1]))
    for (text, lp), (stop_text, stop_lp) in zip(drawn, listed):
        assert stop_text == text and stop_lp == pytest.approx(lp, abs=1e-5)
    assert len({text for text, _ in drawn}) > 1  # the draws differ: the likeliest id alone could not pass


@pytest.mark.parametrize("copies", [2, 12])  # 12: 830 tokens, a response written a slice at a time
def test_a_prompt_longer_than_the_context_is_scored_whole(client, served, copies):
    """Every token gets a log probability, with `tinylm evaluate`'s strided windows: the sum is its NLL."""
    text = "The dog and the cat were friends. They shared their food every day. " * copies
    assert len(text) > 2 * served.context_length
    body = score(client, text, logprobs=0)
    lp = body["choices"][0]["logprobs"]["token_logprobs"]
    assert len(lp) == 1 + len(served.tokenizer.encode(text)) and "warnings" not in body
    assert -sum(lp[1:]) == pytest.approx(evaluate_texts(served.model, served.tokenizer, [text])["nll"], rel=1e-5)


@pytest.mark.parametrize("extra, param", [({"echo": False}, "max_tokens"), ({"stream": True}, "stream")])
def test_max_tokens_zero_only_scores_an_echoed_prompt(client, extra, param):
    r = client.post(
        "/v1/completions", json={"model": "tinyrun", "prompt": "The dog", "max_tokens": 0, "echo": True, **extra}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_echo_without_logprobs_gives_the_prompt_back(client):
    body = client.post(
        "/v1/completions", json={"model": "tinyrun", "prompt": "The dog", "max_tokens": 0, "echo": True}
    ).json()
    assert body["choices"][0]["text"] == "The dog" and body["choices"][0]["logprobs"] is None


# ----------------------------------------------------------------------------------- names
@pytest.mark.parametrize(
    "path, name",
    [
        ("runs/x/checkpoints/ema", "x"),
        ("runs/x/checkpoints/step-0000100", "x"),
        ("runs/x/checkpoints/best", "x"),
        ("runs/x", "x"),
        ("stories260K.bin", "stories260K"),
        ("out/hf-model", "hf-model"),
    ],
)
def test_a_served_model_is_named_after_its_run(path, name):
    assert model_name(path, set()) == name
    assert model_name(path, {name}) == f"{name}-2"


def test_names_can_be_chosen(tmp_path):
    run = make_run(tmp_path)
    ema = str(run / "checkpoints" / "best")
    models = load_models([ema, str(run)], [], max_batch=2, names=["small", "same-run"])
    try:
        assert list(models) == ["small", "same-run"]
    finally:
        for m in models.values():
            m.scheduler.close()
    for names, message in (
        (["a"], "1 --name for 2 --checkpoint"),
        (["a", "a"], "distinct"),
        (["a", "b/c"], "without '/'"),
    ):
        with pytest.raises(TinyLMError, match=message):
            load_models([ema, ema], [], max_batch=2, names=names)


def test_prompt_offsets_are_each_prefix_s_length_for_characters_cut_between_tokens():
    """Where the tokens' texts do not add up to the text (a character's bytes split between byte
    tokens, a word tokenizer's spaces), each offset is still len(decode(ids[:k])), in linear time."""
    text = "Naïve café — déjà vu, 東京 🙂 and a cat. " * 3
    bpe = BPETokenizer().train(["plain ascii words only, " * 40], 300)  # no merge reaches the accents
    word = WordTokenizer().train(["the cat sat on the mat ."] * 5, 30)
    for tok in (bpe, word):
        ids = list(tok.encode(text))
        pieces = [tok.decode([i]) for i in ids]
        want = [7 + len(tok.decode(ids[:k])) for k in range(len(ids))]
        offsets = prompt_offsets(ids, tok, pieces, start=7)
        assert offsets[:5] == want[:5] and list(offsets) == want and offsets[-1] == want[-1]  # read in order
    assert "".join(tok.decode([i]) for i in bpe.encode(text)) != bpe.decode(bpe.encode(text))  # the hard case


def test_many_short_scored_prompts_longer_than_a_slice_together_are_answered(client, served):
    """lm-evaluation-harness's batches: several scored prompts, each shorter than a slice, together
    longer (the response is built lazily and written at once): a 200 with every prompt's scores."""
    tok = served.tokenizer
    ids = [tok.bos_id] + tok.encode("Tom had a red ball and a blue kite. " * 3)
    prompts = [ids[: len(ids) - k] for k in range(8)]
    assert max(map(len, prompts)) <= JSON_SLICE < sum(map(len, prompts))
    body = score(client, prompts, max_tokens=1, logprobs=1, temperature=0)
    for choice, prompt in zip(body["choices"], prompts):
        check_prompt_part(choice, served, prompt, top=1)


def test_a_long_body_is_written_in_slices_as_a_whole_dump_writes_it():
    """A scored prompt's response is built and written a slice at a time (the event loop free
    between slices): the bytes are JSON of the same value as the eager body."""
    alternatives = [None] + [[(i, -0.5 * i), (i + 1, -1.0)] for i in range(1300)]
    top = Mapped(lambda a: None if a is None else [{"id": i, "logprob": lp} for i, lp in a], alternatives)
    tok = BPETokenizer().train(["plain words, " * 40], 280)
    ids = list(tok.encode("déjà vu à Tōkyō, " * 60))  # characters cut between byte tokens: PrefixLengths
    offsets = Chained(prompt_offsets(ids, tok, [tok.decode([i]) for i in ids]), [10**6, 10**6 + 1])
    body = {"choices": [{"top": top, "text_offset": offsets}], "ids": list(range(2000)), "small": {"n": [1, 2]}}

    async def written() -> bytes:
        return b"".join([part async for part in json_body(body)])

    assert has_long_list(body) and not has_long_list(body["small"])
    want = [len(tok.decode(ids[:k])) for k in range(len(ids))] + [10**6, 10**6 + 1]
    assert json.loads(asyncio.run(written())) == {**body, "choices": [{"top": top[:], "text_offset": want}]}
