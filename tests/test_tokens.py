import numpy as np
import pytest
import torch

from tinylm.constants import EOS_ID, IGNORE_INDEX, PAD_ID, SOS_ID
from tinylm.data.tokens import Batches, encode_split, load_split
from tinylm.errors import TinyLMError
from tinylm.tokenizers import CharTokenizer


@pytest.fixture
def split(tmp_path):
    docs = ["abc", "hello world", "zz"]
    tok = CharTokenizer().train(docs)
    return encode_split("train", docs, tok, tmp_path), tok


def test_memmap_cache_round_trip(split, tmp_path):
    s, tok = split
    again = load_split(tmp_path, "train")
    assert isinstance(again.ids, np.memmap) and again.ids.dtype == np.uint16
    assert again.n_docs == 3 and again.n_tokens == 3 + 11 + 2 + 3 * 2
    doc = again.document(1)
    assert doc[0] == SOS_ID and doc[-1] == EOS_ID and tok.decode(doc) == "hello world"
    assert again.n_bytes == 16 and again.n_words == 4


def test_packed_batches_are_shifted_by_one_and_deterministic(split):
    s, _ = split
    b = Batches(s, context_length=4, mode="packed", seed=1)
    x, y = b.get(step=3, row_start=0, n_rows=6)
    assert x.shape == y.shape == (6, 4)
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = b.get(step=3, row_start=2, n_rows=4)  # rows of a bigger batch are the same rows
    assert torch.equal(x2, x[2:]) and torch.equal(y2, y[2:])
    x3, _ = b.get(step=4, row_start=0, n_rows=6)
    assert not torch.equal(x, x3)


def test_story_batches_pad_and_ignore_padding(split):
    s, tok = split
    b = Batches(s, context_length=8, mode="stories", seed=0)
    x, y = b.get(step=0, row_start=0, n_rows=16)
    for row_x, row_y in zip(x, y):
        n = int((row_y != IGNORE_INDEX).sum())
        if n < 8:  # a whole story: starts at <sos>, ends with <eos> as the last target
            assert row_x[0] == SOS_ID and row_y[n - 1] == EOS_ID
        assert torch.all(row_x[n:] == PAD_ID) and torch.all(row_y[n:] == IGNORE_INDEX)
        assert torch.equal(row_x[1:n], row_y[: n - 1])
    # "hello world" (13 tokens with sos/eos) is longer than the window: a window of it is taken
    assert int((y != IGNORE_INDEX).sum(1).max()) == 8


def test_split_shorter_than_context_is_an_error(split):
    s, _ = split
    with pytest.raises(TinyLMError, match="fewer than one context window"):
        Batches(s, context_length=64)
