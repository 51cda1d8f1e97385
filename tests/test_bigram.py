"""Neural bigram: pair convention, exact NLL against torch's cross-entropy, training reaches the
count-based bigram optimum, weight decay, early stopping bookkeeping, sweep, sampling, save/load."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_ngram import sample

from tinylm.constants import EOS_ID, SOS_ID
from tinylm.errors import TinyLMError
from tinylm.models.bigram import NeuralBigramLM, pair_nll, stream_pairs
from tinylm.models.ngram import NGramLM
from tinylm.training.bigram import BigramConfig, sweep_bigram, train_bigram

V = 12


def make_stream(n_docs: int, length: int, seed: int) -> np.ndarray:
    trans = np.random.default_rng(123).dirichlet(np.full(V - 4, 0.3), size=V)  # one bigram source, ids 4..V-1
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n_docs):
        prev, doc = SOS_ID, []
        for _ in range(length):
            prev = int(rng.choice(np.arange(4, V), p=trans[prev]))
            doc.append(prev)
        out += [SOS_ID, *doc, EOS_ID]
    return np.array(out)


TRAIN, VALID = make_stream(60, 60, 0), make_stream(5, 60, 1)
FAST = BigramConfig(
    d_embed=16,
    lr=3e-2,
    min_lr=3e-3,
    warmup_steps=10,
    batch_size=256,
    max_steps=400,
    eval_interval=50,
    patience=0,
    threads=1,
)


def test_pairs_stay_inside_documents():
    x = np.array([SOS_ID, 5, 6, EOS_ID, SOS_ID, 7, EOS_ID])
    prev, nxt = stream_pairs(x, V)
    assert list(zip(prev.tolist(), nxt.tolist())) == [(SOS_ID, 5), (5, 6), (6, EOS_ID), (SOS_ID, 7), (7, EOS_ID)]
    prev, nxt = stream_pairs(x, V, score_eos=False)
    assert EOS_ID not in nxt.tolist() and len(nxt) == 3


def test_pair_nll_equals_torch_cross_entropy():
    model = NeuralBigramLM(V, 8)
    prev, nxt = stream_pairs(VALID, V)
    with torch.no_grad():
        ref = F.cross_entropy(model(torch.from_numpy(prev)), torch.from_numpy(nxt), reduction="sum")
    assert pair_nll(model, prev, nxt, rows_per_chunk=3) == pytest.approx(float(ref), rel=1e-5)
    nll, n = model.score(VALID, score_eos=True)
    assert n == len(prev) and nll == pytest.approx(float(ref), rel=1e-5)


@pytest.mark.slow  # 1000 training steps
def test_training_reaches_the_maximum_likelihood_bigram():
    """With no weight decay and enough width, the training NLL approaches that of the count-based
    maximum-likelihood bigram (the optimum of the same objective)."""
    res = train_bigram(
        TRAIN, VALID, V, FAST.__class__(**{**FAST.__dict__, "weight_decay": 0.0, "max_steps": 1000, "lr": 5e-2})
    )
    ml = NGramLM(2, V, "add_k", k=1e-9).fit(TRAIN)
    ml_nll, n = ml.score(TRAIN, score_eos=True)
    nn_nll, n2 = res.model.score(TRAIN, score_eos=True)
    assert n == n2
    assert nn_nll / n < ml_nll / n * 1.03
    unigram_nll, _ = NGramLM(1, V, "add_k", k=1e-9).fit(TRAIN).score(TRAIN, score_eos=True)
    assert nn_nll < 0.9 * unigram_nll
    assert res.best_val_loss < 0.9 * np.log(V - 4)  # far better than uniform over the 8 words
    assert res.best_val_loss == pytest.approx(min(h["val_loss"] for h in res.history))
    # the weights kept are those of the best validation loss
    assert res.model.score(VALID, score_eos=True)[0] / len(stream_pairs(VALID, V)[0]) == pytest.approx(
        res.best_val_loss, rel=1e-5
    )


@pytest.mark.slow  # two 200-step trainings
def test_weight_decay_shrinks_the_weights():
    norms = {}
    for wd in (0.0, 1.0):
        cfg = BigramConfig(**{**FAST.__dict__, "weight_decay": wd, "max_steps": 200})
        norms[wd] = float(train_bigram(TRAIN, VALID, V, cfg).model.embed.weight.detach().norm())
    assert norms[1.0] < 0.8 * norms[0.0]


def test_early_stopping_stops_when_validation_stalls():
    cfg = BigramConfig(**{**FAST.__dict__, "max_steps": 5000, "eval_interval": 20, "patience": 2, "weight_decay": 0.0})
    res = train_bigram(TRAIN[:200], VALID, V, cfg)  # a tiny training set: validation loss soon stops improving
    assert res.stopped_because == "early_stopping" and res.steps < 5000


@pytest.mark.slow  # four trainings
def test_sweep_sorts_by_validation_loss():
    results = sweep_bigram(
        TRAIN,
        VALID,
        V,
        d_embeds=(4, 16),
        weight_decays=(0.0, 0.5),
        base=BigramConfig(**{**FAST.__dict__, "max_steps": 100}),
    )
    assert len(results) == 4
    losses = [r.best_val_loss for r in results]
    assert losses == sorted(losses)
    assert {(r.config.d_embed, r.config.weight_decay) for r in results} == {(4, 0.0), (4, 0.5), (16, 0.0), (16, 0.5)}


def test_generate_save_load(tmp_path):
    model = NeuralBigramLM(V, 8)
    a = sample(model, [SOS_ID], 20, temperature=1.0, seed=5)
    assert a == sample(model, [SOS_ID], 20, temperature=1.0, seed=5)
    assert all(0 <= t < V and t != SOS_ID for t in a)
    greedy = sample(model, [SOS_ID], 10, temperature=0.0, stop_ids=())
    assert greedy == sample(model, [SOS_ID], 10, temperature=1.0, top_k=1, seed=1, stop_ids=())
    path = model.save(tmp_path / "bigram.pt")
    back = NeuralBigramLM.load(path)
    assert back.score(VALID) == pytest.approx(model.score(VALID))


def test_bad_input():
    model = NeuralBigramLM(V, 8)
    with pytest.raises(TinyLMError, match="outside the model's vocabulary of 12"):
        model.score(np.array([SOS_ID, 4, 40, EOS_ID]))
    with pytest.raises(TinyLMError, match="empty"):
        train_bigram(np.array([], dtype=np.int64), VALID, V, FAST)
    with pytest.raises(TinyLMError, match="does not exist"):
        NeuralBigramLM.load("/nonexistent/bigram.pt")


@pytest.mark.slow  # 300 training steps
def test_count_matrix_mode_optimises_the_same_objective_as_pairs():
    """mode="counts": the loss of a step is the exact mean NLL over every training pair, so the
    trained model matches the maximum-likelihood bigram closely and quickly."""
    cfg = BigramConfig(**{**FAST.__dict__, "mode": "counts", "weight_decay": 0.0, "max_steps": 300, "lr": 5e-2})
    res = train_bigram(TRAIN, VALID, V, cfg)
    ml_nll, n = NGramLM(2, V, "add_k", k=1e-9).fit(TRAIN).score(TRAIN, score_eos=True)
    nn_nll, _ = res.model.score(TRAIN, score_eos=True)
    assert nn_nll / n < ml_nll / n * 1.01
    with pytest.raises(TinyLMError, match="mode"):
        train_bigram(TRAIN, VALID, V, BigramConfig(mode="minibatch"))


def test_adam_l2_adds_the_decay_to_the_gradient_and_adamw_decouples_it():
    """With no decay the two optimizers take the same steps; with a large one they differ."""
    runs = {}
    for name in ("adamw", "adam_l2"):
        for wd in (0.0, 0.5):
            cfg = BigramConfig(
                **{**FAST.__dict__, "weight_decay": wd, "max_steps": 30, "patience": 0, "optimizer": name}
            )
            runs[name, wd] = train_bigram(TRAIN, VALID, V, cfg)
    w = {k: r.model.embed.weight.detach() for k, r in runs.items()}
    assert torch.equal(w["adamw", 0.0], w["adam_l2", 0.0])
    assert not torch.allclose(w["adamw", 0.5], w["adam_l2", 0.5], atol=1e-4)
    with pytest.raises(TinyLMError, match="optimizer 'sgd'"):
        train_bigram(TRAIN, VALID, V, BigramConfig(**{**FAST.__dict__, "optimizer": "sgd"}))
