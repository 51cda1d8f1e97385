"""Muon: the same update as torch.optim.Muon, only the blocks' weight matrices, and a combined
Muon + AdamW optimizer that saves and restores like one torch optimizer."""
import copy
import dataclasses

import pytest
import torch

from tinylm.config import ModelConfig, TrainConfig, check_config
from tinylm.errors import TinyLMError
from tinylm.models.gpt import GPT
from tinylm.training.optim import Muon, MuonWithAdamW, make_optimizer, orthogonalize


def _matrices(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(8, 5, generator=g), torch.randn(4, 12, generator=g)]


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_matches_torch_optim_muon(nesterov):
    ours = [torch.nn.Parameter(m.clone()) for m in _matrices()]
    ref = [torch.nn.Parameter(m.clone()) for m in _matrices()]
    kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    opt = Muon(ours, ns_dtype="bfloat16", **kw)  # torch's reference runs Newton-Schulz in bfloat16
    ref_opt = torch.optim.Muon(ref, adjust_lr_fn="original", **kw)
    for step in range(3):
        grads = _matrices(seed=10 + step)
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    for p, q, start in zip(ours, ref, _matrices()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
        assert (p - start).abs().max() > 1e-2  # it moved


def test_orthogonalize_pushes_singular_values_towards_one():
    g = torch.randn(64, 16) @ torch.diag(torch.logspace(-1, 1, 16))  # condition number 100
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.5 and s.max() < 1.3, s


def _model():
    return GPT(ModelConfig(vocab_size=50, context_length=16, d_model=16, n_layers=2, n_heads=2,
                           positions="rope", norm="rmsnorm", ffn="swiglu", bias=False))


def test_muon_takes_only_the_blocks_weight_matrices():
    model = _model()
    opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1))
    muon, adamw = opt.parts
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    expected = {id(p) for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    assert muon_ids == expected and len(expected) == 2 * 7  # q, k, v, out, gate, up, down per block
    adam_ids = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert adam_ids.isdisjoint(muon_ids)
    assert muon_ids | adam_ids == {id(p) for p in model.parameters()}  # the tied embedding/head once, in AdamW
    assert model.tok_emb.weight is model.lm_head.weight and id(model.tok_emb.weight) in adam_ids
    # weight decay per step is lr x wd in both parts; the schedule scales Muon's rate by lr_scale
    assert muon.param_groups[0]["weight_decay"] * 0.02 == pytest.approx(0.1 * 1e-3)
    assert muon.param_groups[0]["lr_scale"] == pytest.approx(20.0)


def test_muon_with_adamw_state_round_trip():
    torch.manual_seed(0)
    cfg = TrainConfig(optimizer="muon", lr=1e-3)
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    x = torch.randint(0, 50, (2, 16))
    opt_a = make_optimizer(a, cfg)
    for _ in range(2):
        a(x, x)[1].backward()
        opt_a.step()
        opt_a.zero_grad()
    b.load_state_dict(a.state_dict())
    opt_b = make_optimizer(b, cfg)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # torch's load keeps same-device tensors as they are
    for model, opt in ((a, opt_a), (b, opt_b)):
        model(x, x)[1].backward()
        opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    sd = opt_a.state_dict()
    assert sorted(sd["state"]) == list(range(len(list(a.parameters()))))  # one numbering, like torch


def test_bad_optimizer_settings_are_named():
    with pytest.raises(TinyLMError, match="train.optimizer='sgd' is not one of adamw, muon"):
        check_config(TrainConfig(optimizer="sgd"), "train.")
    with pytest.raises(TinyLMError, match=r"train.muon_lr must be > 0 \(got 0.0\)"):
        check_config(dataclasses.replace(TrainConfig(optimizer="muon"), muon_lr=0.0), "train.")
    with pytest.raises(TinyLMError, match="needs a model with transformer blocks"):
        make_optimizer(torch.nn.Linear(2, 2), TrainConfig(optimizer="muon"))
    assert isinstance(make_optimizer(_model(), TrainConfig(optimizer="muon")), MuonWithAdamW)
