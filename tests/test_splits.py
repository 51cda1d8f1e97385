import pytest

from tinylm.data.splits import line_overlap, split_chunks, split_documents
from tinylm.errors import TinyLMError


def test_document_split_is_deterministic_and_disjoint():
    docs = [f"doc {i}" for i in range(100)]
    a = split_documents(docs, 0.1, 0.1, seed=0)
    b = split_documents(docs, 0.1, 0.1, seed=0)
    assert a == b
    assert (len(a["train"]), len(a["valid"]), len(a["test"])) == (80, 10, 10)
    assert sorted(a["train"] + a["valid"] + a["test"]) == sorted(docs)


def test_chunk_split_spreads_over_every_document():
    docs = [("\n\n".join(f"play {p} para {i} " + "x" * 50 for i in range(400))) for p in range(5)]
    out = split_chunks(docs, 0.05, 0.05, chunk_chars=2000)
    for name in ("train", "valid", "test"):
        assert out[name]
    valid_plays = {c.split()[1] for c in out["valid"]}
    assert len(valid_plays) >= 3  # validation text comes from most plays, not one
    total = sum(len(c) for s in out.values() for c in s)
    assert 0.03 < sum(len(c) for c in out["valid"]) / total < 0.08


def test_too_few_documents():
    with pytest.raises(TinyLMError, match="too few to split by document"):
        split_documents(["a", "b"], 0.3, 0.3)
    with pytest.raises(TinyLMError, match="sum to less than 1"):
        split_documents(["a"] * 10, 0.6, 0.5)


def test_overlap_check_finds_a_planted_overlap():
    train = ["\n".join(f"train line {i} of the play" for i in range(200))]
    valid = ["\n".join(f"valid line {i} of the play" for i in range(50))]
    clean = line_overlap(train, valid, sample=100)
    assert (clean["sampled"], clean["sampled_found"], clean["distinct_found"]) == (50, 0, 0)
    planted = [
        "\n".join([f"train line {i} of the play" for i in range(10)] + ["Exit.", "", "  valid line 3 of the play  "])
    ]
    out = line_overlap(train, valid + planted, sample=1000)
    assert out["distinct_lines"] == 61 and out["distinct_found"] == 10  # "Exit." is not in train
    assert out["sampled"] == 62 and out["sampled_found"] == 10
    assert line_overlap(train + ["Exit."], planted, min_words=2)["distinct_lines"] == 11  # "Exit." left out
    sample = line_overlap(train, valid + planted, sample=20, seed=3)
    assert sample == line_overlap(train, valid + planted, sample=20, seed=3) and sample["sampled"] == 20
