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


@pytest.mark.parametrize("nesterov", [True, False])
def test_muon_step_on_a_fused_weight_equals_the_steps_on_its_separate_matrices(nesterov):
    """A q/k/v weight of grouped-query shape (q 16 rows, k and v 8) stacked into one parameter:
    with its split sizes Muon makes the very update three separate matrices would get."""
    g = torch.Generator().manual_seed(0)
    sizes = (16, 8, 8)
    parts = [torch.randn(n, 16, generator=g) for n in sizes]
    separate = [torch.nn.Parameter(m.clone()) for m in parts]
    fused = torch.nn.Parameter(torch.cat(parts))
    as_one = torch.nn.Parameter(torch.cat(parts))
    kw = dict(lr=0.05, weight_decay=0.1, momentum=0.9, nesterov=nesterov)
    ref_opt, opt = Muon(separate, **kw), Muon([fused], split_sizes={id(fused): sizes}, **kw)
    one_opt = Muon([as_one], **kw)  # the fused matrix orthogonalised as a whole: another optimizer
    for _ in range(3):
        grads = [torch.randn(n, 16, generator=g) for n in sizes]
        for p, grad in zip(separate, grads):
            p.grad = grad.clone()
        fused.grad, as_one.grad = torch.cat(grads), torch.cat(grads)
        for o in (ref_opt, opt, one_opt):
            o.step()
    torch.testing.assert_close(fused.detach(), torch.cat([p.detach() for p in separate]), rtol=0, atol=1e-6)
    assert (as_one - fused).abs().max() > 1e-3
    assert (fused - torch.cat(parts)).abs().max() > 1e-2  # it moved


def test_orthogonalize_pushes_singular_values_towards_one():
    g = torch.randn(64, 16) @ torch.diag(torch.logspace(-1, 1, 16))  # condition number 100
    s = torch.linalg.svdvals(orthogonalize(g))
    assert s.min() > 0.5 and s.max() < 1.3, s


def _model():
    return GPT(
        ModelConfig(
            vocab_size=50,
            context_length=16,
            d_model=16,
            n_layers=2,
            n_heads=2,
            positions="rope",
            norm="rmsnorm",
            ffn="swiglu",
            bias=False,
        )
    )


def test_muon_takes_only_the_blocks_weight_matrices():
    model = _model()
    opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1))
    muon, adamw = opt.parts
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    expected = {id(p) for n, p in model.named_parameters() if n.startswith("blocks.") and p.dim() == 2}
    assert muon_ids == expected and len(expected) == 2 * 4  # qkv, out, gate_up, down per block
    # the fused matrices are updated part by part: q, k, v (16 rows each here) and gate, up
    assert {muon.split_sizes[id(b.attn.qkv.weight)] for b in model.blocks} == {(16, 16, 16)}
    assert {muon.split_sizes[id(b.ffn.gate_up.weight)] for b in model.blocks} == {(64, 64)}
    assert len(muon.split_sizes) == 2 * 2
    adam_ids = {id(p) for g in adamw.param_groups for p in g["params"]}
    assert adam_ids.isdisjoint(muon_ids)
    assert muon_ids | adam_ids == {id(p) for p in model.parameters()}  # the tied embedding/head once, in AdamW
    assert model.tok_emb.weight is model.lm_head.weight and id(model.tok_emb.weight) in adam_ids
    # weight decay per step is lr x wd in both parts; the schedule scales Muon's rate by lr_scale
    assert muon.param_groups[0]["weight_decay"] * 0.02 == pytest.approx(0.1 * 1e-3)
    assert muon.param_groups[0]["lr_scale"] == pytest.approx(20.0)


def test_value_embedding_tables_go_to_adamw_with_weight_decay_like_tok_emb():
    torch.manual_seed(0)
    model = GPT(
        ModelConfig(vocab_size=50, context_length=16, d_model=16, n_layers=3, n_heads=2, value_embeddings="alternate")
    )
    opt = make_optimizer(model, TrainConfig(optimizer="muon", lr=1e-3, muon_lr=0.02, weight_decay=0.1))
    muon, adamw = opt.parts
    tables = [model.blocks[i].attn.value_embed.weight for i in (0, 2)]
    assert model.blocks[1].attn.value_embed is None
    muon_ids = {id(p) for g in muon.param_groups for p in g["params"]}
    assert len(muon_ids) == 3 * 4 and not any(id(t) in muon_ids for t in tables)  # qkv, out, up, down per block
    decayed = next(g for g in adamw.param_groups if g["weight_decay"] == 0.1)
    assert {id(t) for t in tables} | {id(model.tok_emb.weight)} <= {id(p) for p in decayed["params"]}
    _, loss = model(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16)))
    loss.backward()
    before = tables[0].detach().clone()
    opt.step()
    assert (tables[0] - before).abs().max() > 0


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
