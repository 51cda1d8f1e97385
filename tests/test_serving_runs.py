"""`tinylm serve --runs DIR` through FastAPI's test client: the runs listed, a metrics file read
while it grows (and while its last line is half written), checkpoints loaded into the server and
reloaded, samples per checkpoint, and the logit lens route against the model's own scores."""

import json
import math
import shutil

import pytest
from fastapi.testclient import TestClient
from serving_util import make_run

import tinylm.cli
from tinylm.cli import main
from tinylm.serving.app import create_app
from tinylm.serving.models import load_models
from tinylm.serving.runs import MAX_LOADED, find_runs, read_rows
from tinylm.serving.state import RunsRoot
from tinylm.training.metrics import MetricsLog


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    make_run(root)  # root/tinyrun: checkpoints/best, 3 metrics rows, eval.json
    nested = make_run(root / "study")  # root/study/tinyrun
    (nested / "samples.json").write_text(json.dumps([{"prompt": "Once", "continuation": " upon"}]))
    (nested / "config.yaml").write_text("sample:\n  prompts: ['Once upon', 'The dog']\n  seed: 3\n")
    rows = [
        {"step": s, "tokens": 64 * s, "samples": [{"prompt": "Once", "continuation": f" at {s}"}]} for s in (10, 20, 10)
    ]  # a resumed run wrote step 10 again
    (nested / "eval_samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 3')
    return root


@pytest.fixture()
def client(root):
    models = load_models([str(root / "tinyrun")], [], max_batch=4)
    app = create_app(models, runs=RunsRoot(root, max_batch=4))
    with TestClient(app) as c:
        yield c
    for served in app.state.server.models.values():
        served.scheduler.close()


def test_runs_are_listed_by_their_path_under_the_directory(client, root):
    (root / "not-a-run").mkdir(exist_ok=True)
    body = client.get("/v1/tinylm/runs").json()
    assert body["root"] == root.name
    assert [r["run"] for r in body["runs"]] == ["study/tinyrun", "tinyrun"]
    first = body["runs"][1]
    assert first["rows"] == 3 and first["step"] == 20 and first["best_val_loss"] == 2.8
    assert first["checkpoints"] == ["best"]


def test_detail_gives_the_rows_after_since_and_everything_else(client):
    d = client.get("/v1/tinylm/runs/detail", params={"run": "study/tinyrun", "since": 1}).json()
    assert [r["step"] for r in d["metrics"]] == [10, 20] and d["total"] == 3 and not d["reset"]
    assert d["samples"] == [{"prompt": "Once", "continuation": " upon"}]
    assert [(r["step"], r["samples"][0]["continuation"]) for r in d["eval_samples"]] == [(10, " at 10"), (20, " at 20")]
    assert "prompts" in d["config"]
    assert d["checkpoints"][0]["name"] == "best" and d["checkpoints"][0]["step"] == 30
    assert d["eval"] == {"valid": {"token_ppl": 16.4, "bpb": 4.0}}
    # a client holding more rows than the file (a resumed run rewrote it) gets them all again
    again = client.get("/v1/tinylm/runs/detail", params={"run": "tinyrun", "since": 7}).json()
    assert again["reset"] and again["since"] == 0 and len(again["metrics"]) == 3


def test_a_growing_metrics_file_is_read_to_its_last_whole_line(tmp_path):
    log = MetricsLog(tmp_path / "metrics.csv")
    log.write({"step": 1, "train_loss": 3.5})
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2,8192,1e-3,3.1")  # the trainer is writing this row
    assert [r["step"] for r in read_rows(tmp_path / "metrics.csv")] == [1]
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write(",,,,\n")
    rows = read_rows(tmp_path / "metrics.csv")
    assert [(r["step"], r["train_loss"], r["val_loss"]) for r in rows] == [(1, 3.5, None), (2, 3.1, None)]


def test_unknown_runs_and_checkpoints_are_named(client, root):
    r = client.get("/v1/tinylm/runs/detail", params={"run": "../tinyrun"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "run"
    assert "runs: study/tinyrun, tinyrun" in r.json()["error"]["message"]
    r = client.post("/v1/tinylm/runs/load", json={"run": "tinyrun", "checkpoint": "../../tinyrun"})
    assert r.status_code == 404 and "it has: best" in r.json()["error"]["message"]
    r = client.get("/v1/tinylm/runs/detail", params={"run": "tinyrun", "since": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "since"
    r = client.post("/v1/tinylm/runs/load", json={"run": "tinyrun", "checkpoint": "best", "extra": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_parameter"


def test_without_runs_the_routes_say_how_to_get_them(root):
    models = load_models([str(root / "tinyrun")], [], max_batch=4)
    with TestClient(create_app(models)) as c:
        r = c.get("/v1/tinylm/runs")
    models["tinyrun"].scheduler.close()
    assert r.status_code == 404 and "--runs DIR" in r.json()["error"]["message"]


def test_a_loaded_checkpoint_is_served_and_a_second_load_reloads_it(client, root):
    r = client.post("/v1/tinylm/runs/load", json={"run": "study/tinyrun", "checkpoint": "best"})
    assert r.status_code == 200, r.text
    assert r.json() == {"model": "study-tinyrun-best", "reloaded": False, "step": 30}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tinyrun", "study-tinyrun-best"]
    first = client.app.state.server.models["study-tinyrun-best"]
    done = client.post(
        "/v1/completions",
        json={"model": "study-tinyrun-best", "prompt": "Once", "max_tokens": 4, "min_tokens": 4, "temperature": 0},
    ).json()
    assert done["usage"]["completion_tokens"] == 4
    again = client.post("/v1/tinylm/runs/load", json={"run": "study/tinyrun", "checkpoint": "best"}).json()
    assert again["reloaded"] and again["model"] == "study-tinyrun-best"
    assert client.app.state.server.models["study-tinyrun-best"] is not first and not first.scheduler.alive
    # a checkpoint replaced on disk between the listing and the load is an error naming it
    ckpt = root / "study" / "tinyrun" / "checkpoints" / "best"
    shutil.copytree(ckpt, root / "saved-best")
    (ckpt / "model.safetensors").write_bytes(b"not safetensors")
    try:
        r = client.post("/v1/tinylm/runs/load", json={"run": "study/tinyrun", "checkpoint": "best"})
        assert r.status_code == 400 and "study/tinyrun/best could not be loaded" in r.json()["error"]["message"]
        assert client.app.state.server.models["study-tinyrun-best"].scheduler.alive  # the old one still serves
    finally:
        shutil.rmtree(ckpt)
        shutil.move(root / "saved-best", ckpt)


def test_loads_are_capped(client, root, monkeypatch):
    monkeypatch.setattr("tinylm.serving.runs.MAX_LOADED", 1)
    assert client.post("/v1/tinylm/runs/load", json={"run": "tinyrun", "checkpoint": "best"}).status_code == 200
    r = client.post("/v1/tinylm/runs/load", json={"run": "study/tinyrun", "checkpoint": "best"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_models"
    assert MAX_LOADED > 1


def test_samples_continue_the_runs_prompts_with_its_seeds(client):
    body = {"run": "study/tinyrun", "checkpoint": "best", "max_tokens": 6}
    first = client.post("/v1/tinylm/runs/samples", json=body).json()
    assert [s["prompt"] for s in first["samples"]] == ["Once upon", "The dog"]
    assert any(s["continuation"] for s in first["samples"])  # an untrained model may end one at once
    assert client.post("/v1/tinylm/runs/samples", json=body).json() == first  # the same seeds: the same draws
    # the sample section's seed is used: prompt 0 with seed 3 is what /v1/completions draws with seed 3
    knobs = {"prompt": "Once upon", "max_tokens": 6, "temperature": 0.8, "top_k": 50, "seed": 3}
    served = client.post("/v1/tinylm/runs/load", json={"run": "study/tinyrun", "checkpoint": "best"}).json()["model"]
    done = client.post("/v1/completions", json={"model": served, **knobs}).json()
    assert done["choices"][0]["text"] == first["samples"][0]["continuation"]
    default = client.post("/v1/tinylm/runs/samples", json={**body, "run": "tinyrun"}).json()
    assert [s["prompt"] for s in default["samples"]] == ["ROMEO:"]  # no config.yaml: the sample section's default


def test_find_runs_stops_at_the_depth_tinylm_writes(tmp_path):
    deep = tmp_path / "a" / "b" / "c" / "d"
    for d in (tmp_path / "a" / "b" / "c", deep):
        d.mkdir(parents=True, exist_ok=True)
        MetricsLog(d / "metrics.csv")
    assert list(find_runs(tmp_path)) == ["a/b/c"]


def test_the_lens_route_ends_with_the_models_own_probabilities(client):
    text = "Once upon a time"
    lens = client.post("/v1/tinylm/lens", json={"model": "tinyrun", "text": text, "top": 3}).json()
    score = client.post("/v1/score", json={"model": "tinyrun", "text": text}).json()
    assert lens["layers"] == ["embeddings", "layer 1", "layer 2"]
    assert [t["text"] for t in lens["tokens"][1:]] == list(text)
    assert len(lens["top"]) == 3 and all(len(row) == len(text) + 1 for row in lens["top"])
    assert all(len(cell) == 3 for row in lens["top"] for cell in row)
    final = lens["next_p"][-1]
    assert final[-1] is None
    for p, lp in zip(final[:-1], score["token_logprobs"]):
        assert p == pytest.approx(math.exp(lp), abs=2e-6)
    r = client.post("/v1/tinylm/lens", json={"model": "tinyrun", "text": ""})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text"
    r = client.post("/v1/tinylm/lens", json={"model": "tinyrun", "text": "x", "top": 0})
    assert r.status_code == 422 and r.json()["error"]["param"] == "top"
    long = client.post("/v1/tinylm/lens", json={"model": "tinyrun", "text": "ab" * 40}).json()
    assert len(long["tokens"]) == 32 and "longer than the context" in long["warnings"][0]


def test_a_server_of_runs_alone_starts_with_no_model_and_says_so(root):
    app = create_app({}, runs=RunsRoot(root, max_batch=4))
    with TestClient(app) as c:
        assert c.get("/v1/models").json()["data"] == []
        r = c.post("/v1/tinylm/lens", json={"text": "Once"})
        assert r.status_code == 404 and "no model is served yet" in r.json()["error"]["message"]
        assert c.post("/v1/tinylm/runs/load", json={"run": "tinyrun", "checkpoint": "best"}).status_code == 200
        r = c.post("/v1/tinylm/lens", json={"text": "Once"})  # the one model served: no name needed
        assert r.status_code == 200 and r.json()["model"] == "tinyrun-best"
    for served in app.state.server.models.values():
        served.scheduler.close()


def test_the_serve_command_takes_a_runs_directory(root, tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setattr(
        tinylm.cli,
        "serve_models",
        lambda models, host, port, limits, key, runs: seen.update(models=list(models), runs=runs),
    )
    assert main(["serve", "--runs", str(root)]) == 0  # no --checkpoint: models come from the Runs view
    assert seen["models"] == [] and seen["runs"].root == root and seen["runs"].max_batch == 32
    assert main(["serve", "--runs", str(root), "--checkpoint", str(root / "tinyrun"), "--max-batch", "3"]) == 0
    assert seen["models"] == ["tinyrun"] and seen["runs"].max_batch == 3
    assert main(["serve", "--runs", str(tmp_path / "missing")]) == 2
    assert f"--runs {tmp_path / 'missing'}: no such directory" in capsys.readouterr().err
