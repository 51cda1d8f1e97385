"""Checkpoint directories: atomic replacement, interrupted saves, keep-last-K pruning."""

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinylm.config import ModelConfig, TrainConfig
from tinylm.errors import TinyLMError
from tinylm.models import checkpoint as ckpt_mod
from tinylm.models.checkpoint import load_checkpoint, prune_step_checkpoints, resolve_checkpoint_dir, save_checkpoint
from tinylm.models.gpt import GPT, state_dict_by_parts
from tinylm.tokenizers import new_tokenizer
from tinylm.training.optim import make_optimizer, param_groups
from tinylm.training.resume import ResumeState, restore_optimizer


@pytest.fixture
def model_and_tokenizer():
    tok = new_tokenizer("char").train(["hello world"], 40)
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=tok.vocab_size, context_length=8, d_model=16, n_layers=1, n_heads=2)), tok


def test_kill_during_save_leaves_previous_checkpoint_loadable(model_and_tokenizer, tmp_path, monkeypatch):
    model, tok = model_and_tokenizer
    path = tmp_path / "best"
    save_checkpoint(path, model, tok)
    before = (path / "model.safetensors").read_bytes()
    with torch.no_grad():
        model.tok_emb.weight.add_(1.0)

    def crash(*a, **k):  # the process dies while writing the new files
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt_mod, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model, tok)
    monkeypatch.undo()
    assert (path / "model.safetensors").read_bytes() == before
    loaded, _, _ = load_checkpoint(path)
    assert not torch.equal(loaded.tok_emb.weight, model.tok_emb.weight)
    # the next save cleans the half-written temporary directory and replaces the checkpoint
    save_checkpoint(path, model, tok)
    assert not (tmp_path / "best.tmp").exists()
    assert torch.equal(load_checkpoint(path)[0].tok_emb.weight, model.tok_emb.weight)


def test_kill_between_the_two_renames_is_recovered(model_and_tokenizer, tmp_path, monkeypatch):
    model, tok = model_and_tokenizer
    path = tmp_path / "last"
    save_checkpoint(path, model, tok)
    real_replace = os.replace

    def replace_then_die(src, dst):
        real_replace(src, dst)
        if str(dst).endswith("last.old"):  # old checkpoint moved aside, new one not yet in place
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(ckpt_mod.os, "replace", replace_then_die)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model, tok)
    monkeypatch.undo()
    assert not path.exists()
    assert resolve_checkpoint_dir(path) == tmp_path / "last.old"
    load_checkpoint(path)


def test_prune_keeps_the_newest_k_step_checkpoints(model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    for step in (5, 10, 15, 100):
        save_checkpoint(tmp_path / f"step-{step:07d}", model, tok, info={"step": step})
    save_checkpoint(tmp_path / "best", model, tok)
    removed = prune_step_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in removed) == ["step-0000005", "step-0000010"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "step-0000015", "step-0000100"]


def test_run_directory_without_best_or_last_resolves_to_newest_step(model_and_tokenizer, tmp_path):
    model, tok = model_and_tokenizer
    for step in (9, 12):
        save_checkpoint(tmp_path / "checkpoints" / f"step-{step:07d}", model, tok, info={"step": step})
    assert resolve_checkpoint_dir(tmp_path) == tmp_path / "checkpoints/step-0000012"


def _swiglu_gqa_model(tok):
    torch.manual_seed(0)
    return GPT(
        ModelConfig(
            vocab_size=tok.vocab_size, context_length=8, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, ffn="swiglu"
        )
    )


def test_a_checkpoint_saved_before_the_qkv_fusion_loads_with_equal_logits(model_and_tokenizer, tmp_path):
    """model.safetensors under the old names (attn.q_proj/k_proj/v_proj, ffn.gate/up; split here by
    hand) loads through load_checkpoint, the fused model computing the same logits."""
    _, tok = model_and_tokenizer
    model = _swiglu_gqa_model(tok).eval()
    path = save_checkpoint(tmp_path / "old", model, tok)
    state = load_file(str(path / "model.safetensors"))
    for i in range(2):
        b = f"blocks.{i}."
        for kind in ("weight", "bias"):
            q, k, v = state.pop(f"{b}attn.qkv.{kind}").split((16, 8, 8))
            gate, up = state.pop(f"{b}ffn.gate_up.{kind}").chunk(2)
            state.update(
                {
                    f"{b}attn.q_proj.{kind}": q,
                    f"{b}attn.k_proj.{kind}": k,
                    f"{b}attn.v_proj.{kind}": v,
                    f"{b}ffn.gate.{kind}": gate,
                    f"{b}ffn.up.{kind}": up,
                }
            )
    save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    loaded, _, _ = load_checkpoint(path)
    x = torch.randint(0, tok.vocab_size, (2, 8))
    assert torch.equal(loaded(x)[0], model(x)[0])


def test_resuming_an_optimizer_state_from_before_the_fusion_is_refused_by_name(model_and_tokenizer, tmp_path):
    """An old run's optimizer numbered q, k, v (gate, up) as separate parameters: more entries than
    the fused model has. Resume names the cause instead of failing on a shape."""
    _, tok = model_and_tokenizer
    model = _swiglu_gqa_model(tok)
    separate = [torch.nn.Parameter(t.clone()) for t in state_dict_by_parts(model).values()]
    old_opt = torch.optim.AdamW(param_groups(torch.nn.ParameterList(separate), 0.1), lr=1e-3)
    for p in separate:
        p.grad = torch.ones_like(p)
    old_opt.step()
    state = ResumeState(tmp_path, 1, {}, old_opt.state_dict(), {}, [], {})
    opt = make_optimizer(model, TrainConfig())
    with pytest.raises(
        TinyLMError,
        match=r"is for \d+ parameters, the model has \d+: a run saved before tinylm "
        r"fused attention's q, k, v",
    ):
        restore_optimizer(opt, state)
