"""N-gram and neural bigram models behind the GPT's forward: the same probabilities as their own
scoring, `tinylm evaluate` on their files, and clear refusals (generation, attention, a wrong tokenizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import make_stories

from tinylm.cli import main
from tinylm.constants import EOS_ID, SOS_ID
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.interop.loading import load_any_checkpoint
from tinylm.models.bigram import NeuralBigramLM
from tinylm.models.ngram import NGramLM
from tinylm.models.short_context import ShortContextLM, load_short_context
from tinylm.tokenizers.bpe import BPETokenizer

TEXTS = make_stories(40)
# new pairs of the same sentences: no token the models have not seen (tiny Kneser-Ney can give an unseen one p = 0)
HELD_OUT = make_stories(2, seed=5)


def stream(tok, texts) -> np.ndarray:
    return np.array([i for t in texts for i in (SOS_ID, *tok.encode(t), EOS_ID)], dtype=np.int64)


@pytest.fixture(scope="module")
def tok():
    return BPETokenizer().train(TEXTS, 300)


@pytest.fixture(scope="module")
def ngram(tok):
    return NGramLM(3, tok.vocab_size, "kneser_ney").fit(stream(tok, TEXTS))


@pytest.fixture(scope="module")
def bigram(tok):
    torch.manual_seed(0)
    return NeuralBigramLM(tok.vocab_size, 16)


@pytest.mark.parametrize("smoothing", ["kneser_ney", "add_k", "interpolated"])
@pytest.mark.parametrize("padding", ["single", "order"])
def test_ngram_logits_are_its_distribution_and_evaluate_is_its_score(tok, smoothing, padding):
    lm = NGramLM(4, tok.vocab_size, "kneser_ney", start_padding=padding).fit(stream(tok, TEXTS)).smoothed(smoothing)
    model = ShortContextLM(lm)
    ids = [SOS_ID, *tok.encode(HELD_OUT[0])]
    logits, _ = model(torch.tensor([ids]))
    for t in range(len(ids)):
        assert np.allclose(np.exp(logits[0, t].double().numpy()), lm.distribution(ids[: t + 1]), rtol=1e-6)
    # every document from its <sos>, <eos> not scored: the n-gram's own score of the stream
    nll, n = lm.score(stream(tok, HELD_OUT))
    m = evaluate_texts(model, tok, HELD_OUT)
    assert np.isfinite(nll) and m["tokens"] == n and m["nll"] == pytest.approx(nll, rel=1e-6)


def test_a_document_longer_than_a_window_keeps_each_tokens_context(tok, ngram):
    lm = ngram.smoothed("interpolated")  # the uniform component: no probability is 0 across the joins
    model = ShortContextLM(lm)
    model.config.context_length = 16  # many strided windows; an order-3 model sees its two tokens in each
    long = " ".join(TEXTS[:6])
    nll, n = lm.score(stream(tok, [long]))
    m = evaluate_texts(model, tok, [long])
    assert np.isfinite(nll) and m["tokens"] == n > 100 and m["nll"] == pytest.approx(nll, rel=1e-6)


def test_bigram_logits_and_evaluate(tok, bigram):
    model = ShortContextLM(bigram)
    ids = [SOS_ID, *tok.encode(HELD_OUT[1])]
    logits, _ = model(torch.tensor([ids]))
    assert torch.allclose(logits[0], bigram(torch.tensor(ids)), atol=0)
    nll, n = bigram.score(stream(tok, HELD_OUT))
    m = evaluate_texts(model, tok, HELD_OUT)
    assert m["tokens"] == n and m["nll"] == pytest.approx(nll, rel=1e-6)
    assert model.num_parameters() == bigram.num_parameters() == tok.vocab_size * 16 * 2 + tok.vocab_size


def test_files_load_with_the_tokenizer_beside_them_and_tinylm_evaluate_scores_them(
    tmp_path, tok, ngram, bigram, capsys
):
    tok.save(tmp_path / "tokenizer.json")
    ngram.save(tmp_path / "ngram-3.npz")
    bigram.save(tmp_path / "bigram.pt")
    data = tmp_path / "held_out.txt"
    data.write_text(HELD_OUT[0], encoding="utf-8")
    for name, lm in (("ngram-3.npz", ngram), ("bigram.pt", bigram)):
        model, loaded_tok, source = load_any_checkpoint(tmp_path / name)
        assert source == {"format": model.config.kind} and loaded_tok.vocab_size == tok.vocab_size
        assert main(["evaluate", "--checkpoint", str(tmp_path / name), "--data", str(data), "--json"]) == 0
        out = json.loads(capsys.readouterr().out)
        nll, n = lm.score(stream(tok, HELD_OUT[:1]))
        assert out["tokens"] == n
        assert out["bpb"] == pytest.approx(nll / (np.log(2) * len(HELD_OUT[0].encode())), rel=1e-6)
    counts = ngram.V + sum(int(level.keys.shape[0]) for level in ngram.levels[2:])
    assert load_short_context(tmp_path / "ngram-3.npz").num_parameters() == counts


def test_refusals_name_the_problem(tmp_path, tok, ngram):
    model = ShortContextLM(ngram)
    with pytest.raises(TinyLMError, match="scoring only"):
        model.new_kv_cache(1)
    with pytest.raises(TinyLMError, match="no attention"):
        model(torch.tensor([[SOS_ID, 5]]), attention_out=[])
    with pytest.raises(TinyLMError, match="vocabulary"):
        model(torch.tensor([[SOS_ID, tok.vocab_size]]))
    ngram.save(tmp_path / "ngram-3.npz")
    with pytest.raises(TinyLMError, match="tokenizer.json does not exist; give its tokenizer"):
        load_any_checkpoint(tmp_path / "ngram-3.npz")
    BPETokenizer().train(TEXTS, 280).save(tmp_path / "small.json")
    with pytest.raises(TinyLMError, match="280 pieces but the model .* has 300"):
        load_any_checkpoint(tmp_path / "ngram-3.npz", tmp_path / "small.json")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(TinyLMError, match="not a tinylm neural bigram file"):
        load_short_context(tmp_path / "junk.pt")
    with pytest.raises(TinyLMError, match="NGramLM or a NeuralBigramLM"):
        ShortContextLM(torch.nn.Linear(2, 2))
