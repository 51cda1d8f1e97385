import json
from unittest import mock

import pytest

from tinylm.data.corpora import (
    load_shakespeare,
    load_text_file,
    load_tinystories,
    read_tinystories_json,
    read_tinystories_text,
    strip_gutenberg,
)
from tinylm.errors import TinyLMError


def test_tinystories_text_format(tmp_path):
    p = tmp_path / "TinyStories-valid.txt"
    p.write_text("First story.\nSecond line.\n<|endoftext|>\n  Second story. \n<|endoftext|>\n\n")
    assert read_tinystories_text(p) == ["First story.\nSecond line.", "Second story."]
    assert load_tinystories(p) == ["First story.\nSecond line.", "Second story."]


def test_tinystories_json_shards(tmp_path):
    for i in range(2):
        (tmp_path / f"data0{i}.json").write_text(
            json.dumps([{"story": f"story {i}a", "summary": "x"}, {"story": f"story {i}b"}])
        )
    assert read_tinystories_json(tmp_path) == ["story 0a", "story 0b", "story 1a", "story 1b"]
    assert load_tinystories(str(tmp_path / "data01.json")) == ["story 1a", "story 1b"]
    (tmp_path / "bad.json").write_text(json.dumps([{"text": "no story field"}]))
    with pytest.raises(TinyLMError, match='no "story" field'):
        read_tinystories_json(tmp_path / "bad.json")


@pytest.mark.slow  # imports datasets
def test_hub_path_calls_datasets_streaming_with_limit():
    rows = [{"text": f"hub story {i}"} for i in range(10)]
    with mock.patch("datasets.load_dataset", return_value=iter(rows)) as load:
        stories = load_tinystories("roneneldan/TinyStories", split="valid", limit=3)
    load.assert_called_once_with("roneneldan/TinyStories", split="validation", streaming=True)
    assert stories == ["hub story 0", "hub story 1", "hub story 2"]


@pytest.mark.slow  # imports datasets
def test_hub_failure_is_one_line_error():
    with mock.patch("datasets.load_dataset", side_effect=ConnectionError("no network\nmore")):
        with pytest.raises(TinyLMError, match="could not load roneneldan/TinyStories split train"):
            load_tinystories("roneneldan/TinyStories")


def test_jsonl_and_txt(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert load_text_file(p) == ["one", "two"]
    p.write_text('{"text": "one"}\n{"body": "x"}\n')
    with pytest.raises(TinyLMError, match=r"d.jsonl:2 has no \"text\" field"):
        load_text_file(p)
    t = tmp_path / "book.txt"
    t.write_text("Call me Ishmael.\n")
    assert load_text_file(t) == ["Call me Ishmael.\n"]


@pytest.mark.parametrize("content, message", [(None, "does not exist"), ("", "is empty"), ("  \n", "is empty")])
def test_missing_or_empty_files(tmp_path, content, message):
    p = tmp_path / "x.txt"
    if content is not None:
        p.write_text(content)
    with pytest.raises(TinyLMError, match=message):
        load_text_file(p)


@pytest.mark.slow  # reads 42 plays
def test_shakespeare_one_edition_per_play_and_no_boilerplate():
    works = load_shakespeare()
    assert len(works) == 42  # the package's modern-spelling (_gut) editions; no First Folio twins
    assert "hamlet" in works and not any(k.endswith("_f") for k in works)
    text = "".join(works.values())
    assert "Gutenberg" not in text and len(text) > 4_500_000
    assert "To be, or not to be" in works["hamlet"]


def test_strip_gutenberg_header_footer_and_licence():
    raw = (
        "The Project Gutenberg EBook of X\n\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\n"
        "<<THIS ELECTRONIC VERSION IS COPYRIGHT 1990-1993 BY WORLD LIBRARY, INC.>>\n\n"
        "ACT I.\n\nHAM.\nWords, words, words.\n\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nLicence text"
    )
    out = strip_gutenberg(raw)
    assert out == "ACT I.\n\nHAM.\nWords, words, words.\n"
