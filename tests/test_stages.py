"""The studies' cached stages: written atomically, reused under the same key, recomputed otherwise."""

from __future__ import annotations

import json

import pytest

from tinylm.studies import stages
from tinylm.studies.stages import Stage, stage_key


def counting(result: dict):
    calls = []

    def compute() -> dict:
        calls.append(1)
        return dict(result)

    return compute, calls


def test_the_key_is_a_short_hash_of_the_inputs_in_any_key_order():
    assert stage_key({"a": 1, "b": [2, 3]}) == stage_key({"b": [2, 3], "a": 1})
    assert stage_key({"a": 1}) != stage_key({"a": 2}) and len(stage_key({"a": 1})) == 16


def test_the_same_key_reuses_the_file_and_another_key_recomputes_it(tmp_path):
    path = tmp_path / "stage-ngram.json"
    compute, calls = counting({"rows": [1, 2]})
    said = []
    first = Stage(path, "k1").run(compute, said.append)
    saved = json.loads(path.read_text())
    assert first["rows"] == [1, 2] and first["seconds"] >= 0 and calls == [1] and said == []
    assert saved == {"rows": [1, 2], "seconds": first["seconds"], "key": "k1"}
    again = Stage(path, "k1").run(compute, said.append)
    assert again == first and calls == [1] and said == [f"reusing {tmp_path.name}/stage-ngram.json"]
    changed, _ = counting({"rows": [3]})
    assert Stage(path, "k2").run(changed, said.append)["rows"] == [3]
    assert json.loads(path.read_text())["key"] == "k2" and Stage(path, "k1").fresh() is None


def test_a_damaged_file_or_a_saved_failure_is_computed_again(tmp_path):
    path = tmp_path / "bleu.json"
    path.write_text('{"key": "k", "rows": [')  # cut off mid-write by an older tinylm
    assert Stage(path, "k").saved() is None and Stage(path, "k").fresh() is None
    Stage(path, "k").compute(lambda: {"error": "no stories"})
    assert Stage(path, "k").saved()["error"] == "no stories" and Stage(path, "k").fresh() is None
    compute, calls = counting({"bleu4": 0.1})
    assert Stage(path, "k").run(compute, print)["bleu4"] == 0.1 and calls == [1]


def test_an_interrupted_write_leaves_the_old_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "stage-gpt-base.json"
    Stage(path, "old").compute(lambda: {"valid_ppl": 12.5})
    before = path.read_bytes()

    def interrupted(src, dst):
        raise OSError("the machine went down before the rename")

    monkeypatch.setattr(stages.os, "replace", interrupted)
    with pytest.raises(OSError, match="went down"):
        Stage(path, "new").compute(lambda: {"valid_ppl": 9.0})
    assert path.read_bytes() == before and Stage(path, "old").fresh()["valid_ppl"] == 12.5
    monkeypatch.undo()
    Stage(path, "new").compute(lambda: {"valid_ppl": 9.0})
    assert Stage(path, "new").fresh()["valid_ppl"] == 9.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stage-gpt-base.json"]  # the temporary file is renamed
