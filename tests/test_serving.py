"""`tinylm serve` through FastAPI's test client: every endpoint, every bad request, and the
scheduler's promise that a request gets, token for token, what `tinylm generate` gives it alone."""

import asyncio
import concurrent.futures
import dataclasses
import json
import math
import random
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import examples
from fastapi.testclient import TestClient
from serving_util import make_run

import tinylm.cli
from tinylm.cli import main
from tinylm.config import ModelConfig
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.evaluation.plots import attention_maps
from tinylm.generation.batch import DoneEvent, ErrorEvent, Row, TokenEvent
from tinylm.generation.core import fit_prompts
from tinylm.generation.generate import encode_prompt, generate_many
from tinylm.generation.processors import GenerationConfig
from tinylm.models.gpt import GPT
from tinylm.serving.app import create_app, list_models
from tinylm.serving.completions import APIError, Limits, visible_text
from tinylm.serving.models import load_models, model_name
from tinylm.serving.scheduler import Scheduler
from tinylm.serving.state import ServerState


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("serving"))


@pytest.fixture(scope="module")
def models(run):
    served = load_models([str(run)], [], max_batch=16)
    yield served
    for s in served.values():
        s.scheduler.close()


@pytest.fixture(scope="module")
def client(models):
    with TestClient(create_app(models, Limits(max_tokens=256, max_choices=8, max_body_bytes=20_000))) as c:
        yield c


def complete(client, **body):
    r = client.post("/v1/completions", json={"model": "tinyrun", **body})
    assert r.status_code == 200, r.text
    return r.json()


# ------------------------------------------------------------------------------------ endpoints
def test_models_health_page_and_card(client, models, run):
    assert client.get("/health").json()["status"] == "ok"
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tinyrun"]
    card = client.get("/v1/models/tinyrun").json()
    assert card["id"] == "tinyrun" and card["object"] == "model"
    assert card["card"]["parameters"] == models["tinyrun"].model.num_parameters()
    assert card["card"]["config"]["context_length"] == 32 and card["card"]["checkpoint"]["step"] == 30
    assert [row["val_loss"] for row in card["card"]["run"]["curves"]] == [3.8, 3.2, 2.8]
    assert card["card"]["run"]["eval"] == {
        "steps": 30,
        "stopped_because": "max_steps",
        "valid": {"token_ppl": 16.4, "bpb": 4.0},
    }
    assert client.get("/v1/models/tinyrun/curves.png").status_code == 404  # this run has no curves.png
    page = client.get("/")
    assert page.status_code == 200 and 'src="/static/app.js"' in page.text
    for name in ("app.js", "style.css"):
        assert client.get(f"/static/{name}").status_code == 200


def test_model_names():
    taken: set[str] = set()
    names = []
    for path in ("runs/demo", "runs/demo/checkpoints/best", "stories260K.bin"):
        names.append(model_name(path, taken))
        taken.add(names[-1])
    assert names == ["demo", "demo-2", "stories260K"]


def test_routes_run_on_a_hand_made_state_without_an_app():
    rng = random.Random(0)
    fakes = {name: SimpleNamespace(name=name, created=rng.randrange(10**9)) for name in ("a", "b")}
    state = ServerState(fakes, Limits())
    assert asyncio.run(list_models(state)) == {
        "object": "list",
        "data": [
            {"id": name, "object": "model", "created": fakes[name].created, "owned_by": "tinylm"} for name in ("a", "b")
        ],
        "tinylm_limits": {
            "max_tokens": 512,
            "max_choices": 16,
            "max_body_bytes": 1_000_000,
            "max_score_tokens": 16_384,
        },
    }
    assert state.model("b") is fakes["b"]
    assert ServerState({"a": fakes["a"]}, Limits()).model(None) is fakes["a"]  # the only model needs no name
    with pytest.raises(APIError) as unknown:
        state.model("c")
    assert unknown.value.status == 404 and unknown.value.body() == {
        "error": {
            "message": "the model 'c' does not exist; served: a, b",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(APIError) as unnamed:
        state.model(None)
    assert (unnamed.value.status, unnamed.value.code) == (400, "model_required")


def test_tokenize_detokenize_round_trip(client, models):
    tok = models["tinyrun"].tokenizer
    body = client.post("/v1/tokenize", json={"text": "The dog ran."}).json()
    assert body["ids"] == tok.encode("The dog ran.") and body["count"] == len("The dog ran.")
    assert [t["id"] for t in body["tokens"]] == body["ids"]
    assert client.post("/v1/detokenize", json={"tokens": body["ids"]}).json()["text"] == "The dog ran."


def test_score_is_tinylm_evaluate(client, models):
    served = models["tinyrun"]
    text = "The cat liked to play in the sun."
    body = client.post("/v1/score", json={"text": text}).json()
    m = evaluate_texts(served.model, served.tokenizer, [text])
    for key in ("token_ppl", "bpb", "word_ppl", "tokens", "bytes", "words"):
        assert body["metrics"][key] == pytest.approx(m[key], rel=1e-9)
    # the per-token log probabilities add up to the same NLL
    assert len(body["token_logprobs"]) == m["tokens"] == len(text)
    assert -sum(body["token_logprobs"]) == pytest.approx(m["nll"], rel=1e-5)
    # a text longer than the context: strided windows, every token scored once
    long = "The cat liked to play in the sun. " * 3
    body = client.post("/v1/score", json={"text": long}).json()
    m = evaluate_texts(served.model, served.tokenizer, [long])
    assert len(body["token_logprobs"]) == m["tokens"]
    assert -sum(body["token_logprobs"]) == pytest.approx(m["nll"], rel=1e-5)


def test_attention_is_tinylm_attention(client, models):
    served = models["tinyrun"]
    body = client.post("/v1/attention", json={"text": "The dog"}).json()
    maps = attention_maps(served.model, served.tokenizer, "The dog")
    assert body["tokens"] == maps.tokens and (body["n_layers"], body["n_heads"]) == (2, 4)
    for got, want in zip(body["weights"], maps.weights):
        np.testing.assert_allclose(np.array(got), want, atol=1e-5)
    assert body["warnings"] == []
    # too long for the context: the last tokens after <sos>, with a warning
    body = client.post("/v1/attention", json={"text": "x" * 40}).json()
    assert len(body["tokens"]) == 32 and body["tokens"][0] == "<sos>"
    assert "longer than the context" in body["warnings"][0]


def test_chat_completions_is_refused_honestly(client):
    r = client.post("/v1/chat/completions", json={"model": "tinyrun", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "chat_not_supported" and "base language models" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------- completions
def test_completion_shape_usage_and_logprobs(client):
    body = complete(
        client, prompt=["The dog", "A cat"], max_tokens=5, min_tokens=5, n=2, seed=3, logprobs=3, temperature=0.7
    )
    assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
    assert body["usage"] == {"prompt_tokens": 8 + 6, "completion_tokens": 20, "total_tokens": 34}
    for c in body["choices"]:
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
        assert all(len(top) == 3 for top in lp["tinylm_top"])
        assert all(t["logprob"] <= 0 for top in lp["tinylm_top"] for t in top)
        assert c["tinylm"]["token_ids"] and c["finish_reason"] == "length"
        offsets = lp["text_offset"]  # where each token starts in the text (a byte token may add no character)
        assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(c["text"])


def test_stream_joins_to_the_same_text(client):
    whole = complete(client, prompt="The dog", max_tokens=20, seed=5, temperature=0.9)
    with client.stream(
        "POST",
        "/v1/completions",
        json={
            "model": "tinyrun",
            "prompt": "The dog",
            "max_tokens": 20,
            "seed": 5,
            "temperature": 0.9,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert chunks[-1]["usage"] == whole["usage"] and chunks[-1]["choices"] == []
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == whole["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_echo_and_stop(client):
    full = complete(client, prompt="The dog", max_tokens=30, min_tokens=30, temperature=0)["choices"][0]["text"]
    stop = full[8:10]
    cut = complete(client, prompt="The dog", max_tokens=30, min_tokens=30, temperature=0, stop=stop, echo=True)
    assert cut["choices"][0]["text"] == "The dog" + full[: full.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["tinylm"]["finish"] == "stop_string"
    echoed = complete(client, prompt="The dog", max_tokens=3, echo=True, logprobs=1, temperature=0)
    lp = echoed["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == 1 + 7 + 3  # <sos>, the prompt, 3 new


@pytest.mark.parametrize(
    "stops, text, final, shown",
    [
        (("END",), "abc EN", False, "abc "),  # "EN" may become the stop string: held back
        (("END",), "abc EN", True, "abc EN"),
        (("END",), "abc ENDxyz", False, "abc "),
        (("\n\n", "."), "one. two", True, "one"),
        ((), "caf\ufffd", False, "caf"),  # an incomplete character waits for its next byte
    ],
)
def test_visible_text(stops, text, final, shown):
    assert visible_text(text, stops, final) == shown


def test_prompt_longer_than_the_context_is_left_cropped_with_a_warning(client, models):
    tok = models["tinyrun"].tokenizer
    prompt = "Once upon a time there was a cat. " * 2
    body = complete(client, prompt=prompt, max_tokens=6, temperature=0)
    assert "keeping the last 32" in body["warnings"][0]
    kept = encode_prompt(tok, prompt)[-32:]  # the rule: the last context_length tokens
    same = complete(client, prompt=kept, max_tokens=6, temperature=0)
    assert same["choices"][0]["tinylm"]["token_ids"] == body["choices"][0]["tinylm"]["token_ids"]
    assert body["usage"]["prompt_tokens"] == 32


def test_beam_search_equals_generate_many(client, models):
    served = models["tinyrun"]
    body = complete(client, prompt="The dog", max_tokens=8, beam_width=3, n=2, logprobs=1)
    ids = encode_prompt(served.tokenizer, "The dog")
    cfg = GenerationConfig(
        max_new_tokens=8,
        temperature=1.0,
        beam_width=3,
        num_return_sequences=2,
        stop_ids=tuple(served.tokenizer.stop_ids),
    )
    want = generate_many(served.model, [ids], cfg, served.tokenizer.decode)
    assert [c["tinylm"]["token_ids"] for c in body["choices"]] == [g.tokens for g in want]
    assert all(len(c["logprobs"]["token_logprobs"]) == len(c["tinylm"]["token_ids"]) for c in body["choices"])


# ------------------------------------------------------------------------------ bad requests
BAD = [
    ({"temperature": -0.5}, 400, "temperature"),
    ({"top_p": 0}, 400, "top_p"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 257}, 400, "max_tokens"),  # above the server's limit
    ({"model": "nope"}, 404, "model"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": []}, 400, "prompt"),
    ({"prompt": ["a", ""]}, 400, "prompt"),
    ({"prompt": [1, 99999]}, 400, "prompt"),
    ({"beam_width": 100000}, 400, "beam_width"),
    ({"beam_width": 2, "stream": True}, 400, "stream"),
    ({"n": 0}, 400, "n"),
    ({"n": 9}, 400, "n"),  # above max_choices
    ({"logprobs": 21}, 400, "logprobs"),
    ({"top_k": 0}, 400, "top_k"),
    ({"min_p": 2}, 400, "min_p"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"min_tokens": 99}, 400, "min_new_tokens"),  # vLLM's name, accepted as an alias
    ({"stop_ids": [10**6]}, 400, "stop_ids"),
    ({"stop": [""]}, 400, "stop"),
    ({"presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"seed": 10**30}, 400, "seed"),
    ({"beam_width": 2, "length_penalty": -1e308}, 400, "length_penalty"),
    ({"temperature": "hot"}, 422, "temperature"),
    ({"max_tokens": 1.5}, 422, "max_tokens"),
    ({"prompt": None}, 422, "prompt"),
    ({"unknown_knob": 1}, 400, "unknown_knob"),
]


@pytest.mark.parametrize("change, status, param", BAD, ids=[json.dumps(c) for c, _, _ in BAD])
def test_bad_completion_requests(client, change, status, param):
    r = client.post("/v1/completions", json={"model": "tinyrun", "prompt": "The dog", **change})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"


def test_invalid_json_and_oversized_bodies(client):
    r = client.post(
        "/v1/completions", content=b'{"model": "tinyrun", "prompt": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/completions", json=[1, 2, 3])
    assert r.status_code == 422 and "error" in r.json()
    r = client.post("/v1/completions", json={"model": "tinyrun", "prompt": "x" * 30_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: the limit is counted while reading
        for _ in range(30):
            yield b" " * 1000

    r = client.post("/v1/completions", content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    for path, body in (
        ("/v1/tokenize", {}),
        ("/v1/detokenize", {"tokens": [-1]}),
        ("/v1/score", {"text": ""}),
        ("/v1/attention", {"text": ""}),
        ("/v1/tokenize", {"text": "a", "model": "x"}),
    ):
        r = client.post(path, json=body)
        assert r.status_code in (400, 404, 422) and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert client.get("/v1/nothing").status_code == 404
    assert client.get("/health").json()["status"] == "ok"


def test_nothing_a_client_sends_crashes_the_server(client):
    """Random values of random types in every field: always an answer (never a 500), then healthy."""
    rng = random.Random(0)
    values = [
        None,
        -1,
        0,
        1,
        2.5,
        -1e308,
        1e308,
        "",
        "x",
        "\x00\ud7ff",
        [],
        [1],
        ["a"],
        [[1, 2]],
        {},
        {"a": 1},
        True,
        10**30,
        [-(10**20)],
        "🙂" * 50,
    ]
    fields = [
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stop",
        "seed",
        "echo",
        "logprobs",
        "top_k",
        "min_p",
        "min_tokens",
        "min_new_tokens",
        "stop_ids",
        "early_stopping",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "beam_width",
        "length_penalty",
        "stream_options",
        "best_of",
    ]
    statuses = set()
    for _ in range(examples(200)):  # 50 in the fast tier
        body = {"model": "tinyrun", "prompt": "The dog", "max_tokens": 3}
        for f in rng.sample(fields, rng.randint(1, 3)):
            body[f] = rng.choice(values)
        r = client.post("/v1/completions", json=body)
        statuses.add(r.status_code)
        assert r.status_code in (200, 400, 404, 413, 422), (body, r.text)
        if r.status_code != 200:
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert {200, 400, 422} <= statuses
    assert client.get("/health").json()["status"] == "ok"
    assert complete(client, prompt="The dog", max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_api_key_is_required_on_every_v1_call(models):
    with TestClient(create_app(models, api_key="s3cret")) as c:
        assert c.get("/v1/models").status_code == 401
        r = c.post("/v1/completions", json={"model": "tinyrun", "prompt": "a"}, headers={"Authorization": "Bearer no"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert c.get("/v1/models", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/").status_code == 200 and c.get("/health").status_code == 200  # the page loads, asks for the key


# ---------------------------------------------------------------------------------- equality
KNOBS = [
    {"temperature": 0},
    {"temperature": 0.9},
    {"temperature": 0.8, "top_k": 5, "repetition_penalty": 1.3},
    {"temperature": 1.0, "top_p": 0.8, "min_p": 0.05, "no_repeat_ngram_size": 2},
]
PROMPTS = ["The dog", "Once upon a time there was", "A"]


def generate_cli(capsys, run, prompt, knobs, max_tokens, seed):
    """Token ids of `tinylm generate --json` with the same knobs."""
    args = [
        "generate",
        "--checkpoint",
        str(run),
        "--prompt",
        prompt,
        "--seed",
        str(seed),
        "--json",
        "--max-new-tokens",
        str(max_tokens),
        "--temperature",
        str(knobs["temperature"]),
    ]
    for key in ("top_k", "top_p", "min_p", "repetition_penalty", "no_repeat_ngram_size"):
        if key in knobs:
            args += ["--" + key.replace("_", "-"), str(knobs[key])]
    capsys.readouterr()
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


@pytest.mark.slow  # ~40 generations through the CLI and the server
def test_server_equals_tinylm_generate_alone_and_batched(client, models, run, capsys):
    """max_tokens 48 > the context (32): the sliding window is exercised too."""
    cases = [(p, k, 10 + i) for i, (p, k) in enumerate((p, k) for p in PROMPTS for k in KNOBS)]
    want = [generate_cli(capsys, run, p, k, 48, seed) for p, k, seed in cases]
    body = lambda p, k, seed: {"prompt": p, "max_tokens": 48, "seed": seed, **k}  # noqa: E731
    alone = [complete(client, **body(*case))["choices"][0]["tinylm"]["token_ids"] for case in cases]
    assert alone == want
    scheduler = models["tinyrun"].scheduler
    scheduler.max_rows_seen = 0
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:
        together = list(
            pool.map(lambda case: complete(client, **body(*case))["choices"][0]["tinylm"]["token_ids"], cases)
        )
    assert together == want
    assert scheduler.max_rows_seen >= 4  # they were decoded as one batch


# --------------------------------------------------------------------------------- scheduler
@pytest.mark.slow  # ~1 s each: 16 generations alone, then together
@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_scheduler_rows_joining_and_leaving_get_their_tokens_alone(models, positions):
    """Rows of different lengths and knobs join a running batch at different steps, some leave
    early, some slide past the context: each gets exactly what it gets alone."""
    model = models["tinyrun"].model
    if positions == "rope":
        torch.manual_seed(1)
        model = GPT(
            ModelConfig(
                vocab_size=model.config.vocab_size,
                context_length=32,
                d_model=32,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                positions="rope",
            )
        ).eval()
    ctx = model.config.context_length
    prompts = [[2, 5, 6, 7], [2, 9], list(range(2, 40)), [2, 11, 12, 13, 14, 15, 16]]
    cfgs = [
        GenerationConfig(max_new_tokens=40, temperature=0),
        GenerationConfig(max_new_tokens=30, temperature=1.0, seed=5),
        GenerationConfig(
            max_new_tokens=25, temperature=0.7, top_k=10, repetition_penalty=1.3, no_repeat_ngram_size=2, seed=9
        ),
        GenerationConfig(max_new_tokens=7, temperature=1.0, top_p=0.9, seed=3, stop_ids=(3,)),
    ]
    with pytest.warns(UserWarning, match="longer than the context"):
        fitted = fit_prompts(prompts, ctx)
    alone = {
        (i, j): generate_many(model, [p], dataclasses.replace(c, seed_per_row=True))[0].tokens
        for i, p in enumerate(fitted)
        for j, c in enumerate(cfgs)
    }
    scheduler = Scheduler(model, max_batch=6)  # fewer slots than rows: some wait for others to leave
    got, logprobs = {}, {}
    done = threading.Event()

    def emitter(key):
        def emit(event):
            if isinstance(event, TokenEvent):
                logprobs.setdefault(key, []).append(event.logprob)
            if isinstance(event, DoneEvent):
                got[key] = event.tokens
                if len(got) == len(alone):
                    done.set()

        return emit

    torch.manual_seed(0)
    for n, (i, j) in enumerate(alone):
        scheduler.add(Row(fitted[i], cfgs[j], emitter((i, j)), logprobs=2))
        if n % 3 == 2:
            done.wait(0.01)  # later rows join a batch already decoding
    assert done.wait(60)
    scheduler.close()
    assert got == alone
    assert scheduler.max_rows_seen == 6
    assert all(lp < 0 and math.isfinite(lp) for lps in logprobs.values() for lp in lps)


def test_serve_command_warns_off_loopback_and_passes_its_limits(run, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(
        tinylm.cli,
        "serve_models",
        lambda models, host, port, limits, key, runs: seen.update(
            models=list(models), host=host, port=port, limits=limits, key=key
        ),
    )
    assert main(["serve", "--checkpoint", str(run), "--host", "0.0.0.0", "--port", "8123", "--max-tokens", "64"]) == 0
    assert "WITHOUT AUTHENTICATION" in capsys.readouterr().err
    assert seen["models"] == ["tinyrun"] and seen["host"] == "0.0.0.0" and seen["port"] == 8123
    assert seen["limits"] == Limits(max_tokens=64, max_choices=16, max_body_bytes=1_000_000) and seen["key"] is None
    assert main(["serve", "--checkpoint", str(run), "--api-key", "k"]) == 0
    assert "WARNING" not in capsys.readouterr().err  # loopback by default
    assert main(["serve", "--checkpoint", str(run), "--tokenizer", "a", "--tokenizer", "b"]) == 2
    assert "one per checkpoint" in capsys.readouterr().err
    assert main(["serve"]) == 2


def test_a_knob_that_bans_every_token_fails_that_row_only():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=8, context_length=32, d_model=16, n_layers=1, n_heads=2)).eval()
    scheduler = Scheduler(model)
    events = {"banned": [], "fine": []}
    finished = concurrent.futures.Future(), concurrent.futures.Future()
    for (name, cfg), future in zip(
        (
            ("banned", GenerationConfig(max_new_tokens=20, min_new_tokens=20, no_repeat_ngram_size=1, stop_ids=(3,))),
            ("fine", GenerationConfig(max_new_tokens=20, temperature=0)),
        ),
        finished,
    ):

        def emit(event, name=name, future=future):
            events[name].append(event)
            if isinstance(event, (DoneEvent, ErrorEvent)) and not future.done():
                future.set_result(event)

        scheduler.add(Row([2, 4], cfg, emit))
    banned, fine = (f.result(timeout=30) for f in finished)
    scheduler.close()
    # 8 ids: <pad>, <unk>, <sos>, <eos> and 4 more; each may appear once, <eos> is banned by min_tokens
    assert isinstance(banned, ErrorEvent) and banned.param == "no_repeat_ngram_size"
    assert "ban the whole vocabulary" in banned.message
    assert isinstance(fine, DoneEvent) and len(fine.tokens) == 20  # the other row of the batch is unharmed


@pytest.mark.parametrize(
    "route, body",
    [
        ("/v1/completions", '{"model": "tinyrun", "prompt": "Once \\ud800 upon", "echo": true, "max_tokens": 2}'),
        ("/v1/completions", '{"model": "tinyrun", "prompt": ["ok", "x\\udfff"], "echo": true, "stream": true}'),
        ("/v1/completions", '{"model": "tinyrun", "prompt": "ok", "stop": ["\\ud83d"]}'),
        ("/v1/score", '{"text": "a lone \\ud800"}'),
        ("/v1/tokenize", '{"text": "\\udc00"}'),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(client, route, body):
    """JSON's \\ud800 escape reads as a lone surrogate, which no UTF-8 text holds: refused up front,
    never a 500 or a cut stream."""
    r = client.post(route, content=body.encode(), headers={"Content-Type": "application/json"})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "invalid_text", r.text
    assert error["param"] in ("prompt", "stop", "text") and "lone surrogate" in error["message"]


def test_scoring_over_the_limit_is_a_413_naming_it(models):
    limits = Limits(max_tokens=256, max_choices=8, max_score_tokens=50)
    with TestClient(create_app(models, limits)) as small:
        long = "Once upon a time " * 4  # 68 characters: 69 tokens with <sos>
        for route, body in (
            ("/v1/completions", {"model": "tinyrun", "prompt": long, "echo": True, "logprobs": 1, "max_tokens": 0}),
            ("/v1/score", {"text": long}),
            ("/v1/tinylm/score", {"text": long}),
        ):
            r = small.post(route, json=body)
            error = r.json()["error"]
            assert r.status_code == 413 and error["code"] == "score_too_large", (route, r.text)
            assert "limit of 50 (tinylm serve --max-score-tokens)" in error["message"]
        fits = small.post("/v1/score", json={"text": long[:40]})
        assert fits.status_code == 200 and len(fits.json()["token_logprobs"]) == 40
        assert small.get("/v1/models").json()["tinylm_limits"]["max_score_tokens"] == 50
