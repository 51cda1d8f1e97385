"""Word embeddings: .vec / FastText .bin / gensim readers, FastText training, the embedding
matrix (pad zero, specials noise, OOV subword or noise), freeze and projection, trainer hook."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest
import torch
from conftest import make_stories

from tinylm.config import EmbeddingsConfig, ModelConfig
from tinylm.errors import TinyLMError
from tinylm.models.embeddings import (
    apply_pretrained_embeddings,
    build_embedding_matrix,
    load_vectors,
    read_fasttext_bin,
    read_gensim,
    read_vec,
    token_sentences,
    train_fasttext,
    write_vec,
)
from tinylm.models.gpt import GPT
from tinylm.tokenizers import WordTokenizer

DIM = 8


@pytest.fixture(scope="module")
def word_tok():
    return WordTokenizer(lowercase=True).train(make_stories(80), 60)


@pytest.fixture
def vec_file(tmp_path, word_tok):
    """A .vec with vectors for the vocabulary's first 20 words plus words the vocabulary lacks."""
    words = word_tok.words[:20] + ["zebra", "quantum"]
    rng = np.random.default_rng(0)
    matrix = rng.normal(0, 0.5, size=(len(words), DIM)).astype(np.float32)
    path = tmp_path / "tiny.vec"
    write_vec(path, words, matrix)
    return path, dict(zip(words, matrix))


@pytest.fixture(scope="module")
def ft_sentences():
    return [s.lower().replace(".", " .").replace(",", " ,").split() for s in make_stories(150)]


@pytest.fixture(scope="module")
def gensim_ft(ft_sentences):
    from gensim.models import FastText

    model = FastText(vector_size=DIM, min_count=1, workers=1, seed=1, bucket=5000, min_n=3, max_n=5)
    model.build_vocab(corpus_iterable=ft_sentences)
    model.train(corpus_iterable=ft_sentences, total_examples=len(ft_sentences), epochs=2)
    return model


def test_read_vec_keeps_only_wanted_words(vec_file):
    path, truth = vec_file
    src = read_vec(path, keep={"zebra", "the", "absent"})
    assert src.dim == DIM and set(src.vectors) == {"zebra", "the"} & set(truth)
    np.testing.assert_allclose(src.vectors["zebra"], truth["zebra"], atol=1e-5)
    assert len(read_vec(path).vectors) == len(truth)


def test_matrix_from_vec(vec_file, word_tok):
    path, truth = vec_file
    src = load_vectors("auto", str(path), set(word_tok.words))
    matrix, report = build_embedding_matrix(word_tok, src, oov="subword", seed=0)
    assert matrix.shape == (word_tok.vocab_size, DIM)
    assert report.found == 20 and report.subword == 0  # a .vec has no subwords: OOV -> noise
    assert report.random == word_tok.vocab_size - 4 - 20 and report.specials == 4
    assert abs(report.coverage - 20 / (word_tok.vocab_size - 4)) < 1e-9
    for w in word_tok.words[:20]:
        np.testing.assert_allclose(matrix[word_tok._word_to_id[w]], truth[w], atol=1e-5)
    assert not matrix[0].any()  # <pad>
    found_std = np.std(np.stack([truth[w] for w in word_tok.words[:20]]))
    noise = matrix[4 + 20 :]
    assert 0.5 * found_std < noise.std() < 1.6 * found_std  # noise has the scale of real vectors
    again, _ = build_embedding_matrix(word_tok, src, oov="noise", seed=0)
    np.testing.assert_array_equal(matrix, again)  # seeded
    small, _ = build_embedding_matrix(word_tok, src, oov="noise", noise_std=1e-3, seed=0)
    assert small[4 + 20 :].std() < 2e-3


def test_vec_bad_files(tmp_path):
    bad = tmp_path / "bad.vec"
    bad.write_text("hello world\nthe 1 2\n")
    with pytest.raises(TinyLMError, match="line 1 must be the header"):
        read_vec(bad)
    bad.write_text("2 3\nthe 1 2 3\ncat 1 2\n")
    with pytest.raises(TinyLMError, match="line 3 has 2 values, expected 3"):
        read_vec(bad)
    bad.write_text("2 3\nthe 1 2 3\ncat 1 x 3\n")
    with pytest.raises(TinyLMError, match="line 3 has a value that is not a number"):
        read_vec(bad)
    bad.write_text("3 3\nthe 1 2 3\ncat 1 2 3\n")
    with pytest.raises(TinyLMError, match="announces 3 vectors but the file holds 2"):
        read_vec(bad)
    with pytest.raises(TinyLMError, match="does not exist"):
        read_vec(tmp_path / "none.vec")
    bad.write_bytes(b"\xff\xfe\x00binary")
    with pytest.raises(TinyLMError, match="UTF-8"):
        read_vec(bad)


@pytest.mark.slow  # trains FastText with gensim
def test_fasttext_bin_oov_from_subwords_like_get_word_vector(tmp_path, gensim_ft, word_tok):
    """A FastText .bin written by gensim, read through the `fasttext` package: OOV rows equal
    fastText's get_word_vector and gensim's subword vector (two implementations agree)."""
    from gensim.models.fasttext import save_facebook_model

    path = tmp_path / "tiny.bin"
    save_facebook_model(gensim_ft, str(path))
    src = read_fasttext_bin(path, keep=set(word_tok.words))
    assert src.dim == DIM and src.subword is not None
    matrix, report = build_embedding_matrix(word_tok, src, oov="subword")
    assert report.found + report.subword == word_tok.vocab_size - 4 and report.random == 0
    fasttext = pytest.importorskip("fasttext")
    reference = fasttext.load_model(str(path))
    for w in word_tok.words:
        row = matrix[word_tok._word_to_id[w]]
        np.testing.assert_allclose(row, reference.get_word_vector(w), atol=1e-5)
        np.testing.assert_allclose(row, gensim_ft.wv[w], atol=1e-5)
    oov = "catdogs"
    assert oov not in gensim_ft.wv.key_to_index
    np.testing.assert_allclose(src.subword(oov), reference.get_word_vector(oov), atol=1e-5)
    bad = tmp_path / "not.bin"
    bad.write_bytes(b"\x00" * 64)
    with pytest.raises(TinyLMError, match="not a FastText .bin model"):
        read_fasttext_bin(bad)


@pytest.mark.slow  # trains FastText with gensim
def test_gensim_keyed_vectors(tmp_path, gensim_ft, word_tok):
    from gensim.models import KeyedVectors

    kv = KeyedVectors(DIM)
    kv.add_vectors(["the", "cat"], np.ones((2, DIM), dtype=np.float32) * [[1], [2]])
    kv.save(str(tmp_path / "plain.kv"))
    src = read_gensim(tmp_path / "plain.kv")
    assert src.subword is None and src.vectors["cat"][0] == 2
    gensim_ft.save(str(tmp_path / "ft.model"))  # a whole FastText model: subwords come along
    src = load_vectors("gensim", str(tmp_path / "ft.model"), {"the"})
    np.testing.assert_allclose(src.subword("catdogs"), gensim_ft.wv["catdogs"], atol=1e-6)
    (tmp_path / "junk.kv").write_text("junk")
    with pytest.raises(TinyLMError, match="not a saved gensim"):
        read_gensim(tmp_path / "junk.kv")


@pytest.mark.slow  # trains FastText with gensim
def test_train_fasttext_covers_the_vocabulary_and_is_seeded(word_tok):
    ids = np.concatenate([[2, *word_tok.encode(s), 3] for s in make_stories(80)])
    sentences = token_sentences(ids, word_tok)
    known = set(word_tok.words)
    assert len(sentences) == 80
    assert sentences[0] == [w if w in known else "<unk>" for w in word_tok.split(make_stories(80)[0])]
    a = train_fasttext(sentences, 16, seed=3, epochs=2)
    b = train_fasttext(sentences, 16, seed=3, epochs=2)
    matrix, report = build_embedding_matrix(word_tok, a)
    assert report.found == word_tok.vocab_size - 4 and a.dim == 16
    np.testing.assert_array_equal(a.vectors["the"], b.vectors["the"])
    with pytest.raises(TinyLMError, match="empty corpus"):
        train_fasttext([], 16)


def _model(vocab_size, d_model=16, **kw):
    return GPT(ModelConfig(vocab_size=vocab_size, context_length=16, d_model=d_model, n_layers=1, n_heads=2, **kw))


def test_apply_frozen_with_projection(tmp_path, vec_file, word_tok, caplog):
    path, truth = vec_file
    model = _model(word_tok.vocab_size, d_model=16, d_embed=DIM, tie_weights=False)
    assert model.embed_proj is not None and model.tok_emb.weight.shape == (word_tok.vocab_size, DIM)
    cfg = EmbeddingsConfig(kind="vec", path=str(path), freeze=True)
    with caplog.at_level(logging.INFO, logger="tinylm.models.embeddings"):
        report = apply_pretrained_embeddings(model, word_tok, cfg, out_dir=tmp_path)
    assert report.found == 20 and "20/" in caplog.records[0].getMessage() and (tmp_path / "embeddings.json").is_file()
    w = word_tok.words[0]
    np.testing.assert_allclose(model.tok_emb.weight[word_tok._word_to_id[w]].detach().numpy(), truth[w], atol=1e-5)
    before = model.tok_emb.weight.detach().clone()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    x = torch.tensor([word_tok.encode("the cat saw the dog .")])
    _, loss = model(x[:, :-1], x[:, 1:])
    loss.backward()
    assert model.tok_emb.weight.grad is None and model.embed_proj.weight.grad is not None
    opt.step()
    assert torch.equal(model.tok_emb.weight, before)


def test_width_and_tying_errors(vec_file, word_tok):
    path, _ = vec_file
    with pytest.raises(TinyLMError, match=r"vectors are 8-dimensional .* set model.d_embed=8"):
        apply_pretrained_embeddings(
            _model(word_tok.vocab_size, d_model=16), word_tok, EmbeddingsConfig(kind="vec", path=str(path))
        )
    with pytest.raises(TinyLMError, match="tie_weights=true needs the embedding width"):
        _model(word_tok.vocab_size, d_model=16, d_embed=DIM)
    tied = _model(word_tok.vocab_size, d_model=DIM)
    with pytest.raises(TinyLMError, match="freeze the output layer too"):
        apply_pretrained_embeddings(tied, word_tok, EmbeddingsConfig(kind="vec", path=str(path), freeze=True))
    with pytest.raises(TinyLMError, match="needs embeddings.path"):
        apply_pretrained_embeddings(tied, word_tok, EmbeddingsConfig(kind="vec"))
    with pytest.raises(TinyLMError, match="embeddings.oov"):
        apply_pretrained_embeddings(tied, word_tok, EmbeddingsConfig(kind="vec", path=str(path), oov="zero"))


@pytest.mark.slow  # trains FastText with gensim
def test_trainer_hook_trains_fasttext_and_keeps_frozen_rows(tmp_path, stories_file):
    from conftest import tiny_run_config

    from tinylm.data.prepare import prepare
    from tinylm.training.trainer import train

    cfg = tiny_run_config(tmp_path / "run", stories_file, max_steps=3, eval_interval=3)
    cfg.tokenizer.type, cfg.tokenizer.vocab_size, cfg.tokenizer.lowercase = "word", 80, True
    cfg.model.d_embed, cfg.model.tie_weights = 12, False
    cfg.embeddings = EmbeddingsConfig(kind="train", freeze=True, train_epochs=1)
    prepared = prepare(cfg, tmp_path / "run")
    result = train(cfg, prepared, tmp_path / "run")
    report = (tmp_path / "run" / "embeddings.json").read_text()
    assert '"found": 76' in report and '"freeze": true' in report
    from tinylm.models.checkpoint import load_checkpoint

    model = load_checkpoint(tmp_path / "run" / "checkpoints" / "last")[0]
    rows = model.tok_emb.weight.detach().numpy()
    assert rows.shape == (80, 12) and not rows[0].any()
    # frozen: after training the rows are still exactly the FastText vectors (same seed, same stream)
    source = train_fasttext(token_sentences(prepared.splits["train"].ids, prepared.tokenizer), 12, seed=0, epochs=1)
    expected, _ = build_embedding_matrix(prepared.tokenizer, source)
    np.testing.assert_allclose(rows[4:], expected[4:], atol=1e-6)
    assert (result.steps, result.stopped_because) == (3, "max_steps")
    # the trained vectors are kept next to the token cache: a second run reads them back, same rows
    first = json.loads(report)
    assert first["cached"] is None and first["train_seconds"] > 0 and first["kind"] == "train"
    caches = list(prepared.data_dir.glob("fasttext-trained-*.npz"))
    assert len(caches) == 1
    train(cfg, prepared, tmp_path / "run2")
    second = json.loads((tmp_path / "run2" / "embeddings.json").read_text())
    assert second["cached"] == caches[0].name and second["found"] == first["found"]
    again = load_checkpoint(tmp_path / "run2" / "checkpoints" / "last")[0].tok_emb.weight.detach().numpy()
    np.testing.assert_array_equal(again, rows)
