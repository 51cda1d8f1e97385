"""Weight averaging: the EMA arithmetic, checkpoints/ema written beside the run, the run's result
evaluated with the averaged weights, and exact resume with Muon + EMA."""

import copy

import pytest
import torch
from conftest import prepared_stories_run

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.models.checkpoint import load_checkpoint, model_state
from tinylm.models.gpt import GPT
from tinylm.pipeline import run_pipeline
from tinylm.training.ema import EMA
from tinylm.training.metrics import read_metrics
from tinylm.training.trainer import train


def test_ema_follows_its_formula():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=20, context_length=8, d_model=8, n_layers=1, n_heads=2))
    ema = EMA(model, decay=0.9)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for n_update in range(1, 30):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        ema.update(model)
        d = min(0.9, (1 + n_update) / (10 + n_update))
        for n, p in model.named_parameters():
            expected[n] = d * expected[n] + (1 - d) * p.detach()
    averaged = ema.averaged_model(model)
    for n, p in averaged.named_parameters():
        torch.testing.assert_close(p, expected[n], rtol=1e-5, atol=1e-6)
    assert averaged.lm_head.weight is averaged.tok_emb.weight  # the copy keeps the tie
    assert not torch.equal(averaged.tok_emb.weight, model.tok_emb.weight)  # the model itself is untouched
    with pytest.raises(ValueError, match="decay"):
        EMA(model, 1.0)


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory):
    cfg, prepared = prepared_stories_run(
        tmp_path_factory.mktemp("ema"),
        threads=1,
        max_steps=12,
        save_interval=4,
        eval_interval=4,
        keep_last=5,
        optimizer="muon",
        ema_decay=0.8,
    )
    cfg.model.dropout = 0.1  # resume must also restore the dropout stream
    return cfg, prepared


def test_ema_checkpoint_holds_the_average_and_resume_is_exact(prepared_run, tmp_path):
    cfg, prepared = prepared_run
    full = train(copy.deepcopy(cfg), prepared, tmp_path / "full")
    ema_model, _, meta = load_checkpoint(full.checkpoint_dir / "ema")
    last_model, _, _ = load_checkpoint(full.checkpoint_dir / "last")
    assert meta["ema_updates"] == 12 and meta["ema_decay"] == 0.8
    assert any(not torch.equal(a, b) for a, b in zip(ema_model.parameters(), last_model.parameters()))

    resumed = train(copy.deepcopy(cfg), prepared, tmp_path / "resumed", resume=full.checkpoint_dir / "step-0000008")
    assert resumed.steps == 12

    def rows(run):
        return [(r["step"], r["train_loss"]) for r in read_metrics(run / "metrics.csv") if int(r["step"]) > 8]

    assert rows(tmp_path / "resumed") == rows(tmp_path / "full")
    for name in ("last", "ema"):
        a, b = (
            model_state(load_checkpoint(run / "checkpoints" / name)[0])
            for run in (tmp_path / "full", tmp_path / "resumed")
        )
        assert all(torch.equal(a[k], b[k]) for k in a), name


def test_resume_without_the_saved_average_is_named(prepared_run, tmp_path):
    cfg, prepared = prepared_run
    run = train(copy.deepcopy(cfg), prepared, tmp_path / "run")
    (run.checkpoint_dir / "step-0000008" / "ema.safetensors").unlink()
    with pytest.raises(TinyLMError, match="ema.safetensors"):
        train(copy.deepcopy(cfg), prepared, tmp_path / "again", resume=run.checkpoint_dir / "step-0000008")
    bad = copy.deepcopy(cfg)
    bad.train.ema_decay = 1.5
    with pytest.raises(TinyLMError, match="ema_decay"):
        train(bad, prepared, tmp_path / "bad")


@pytest.mark.slow
def test_pipeline_reports_the_averaged_model(prepared_run, tmp_path):
    cfg, _ = prepared_run
    summary = run_pipeline(copy.deepcopy(cfg), tmp_path / "run")
    assert summary["checkpoint"] == "checkpoints/ema"
    assert summary["eval"]["valid"]["bpb"] != summary["eval_best"]["valid"]["bpb"]
