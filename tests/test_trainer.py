"""Trainer guard rails and options: NaN stop, early stopping, TensorBoard, precision, compile."""

import copy
import math

import pytest
import torch
import yaml
from conftest import prepared_stories_run, with_overrides

from tinylm.errors import TinyLMError
from tinylm.models.checkpoint import load_checkpoint, model_state, save_checkpoint
from tinylm.training.metrics import read_metrics
from tinylm.training.precision import make_grad_scaler
from tinylm.training.trainer import build_model, train


@pytest.fixture(scope="module")
def prepared_run(tmp_path_factory):
    return prepared_stories_run(tmp_path_factory.mktemp("trainer"), threads=1)


_cfg = with_overrides


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(prepared_run, tmp_path):
    base, prepared = prepared_run
    cfg = _cfg(base, max_steps=20, save_interval=2, eval_interval=100)
    calls = {"n": 0}

    def poison(module, args, output):  # the 7th forward (step 7) produces NaN
        calls["n"] += 1
        return output * math.nan if calls["n"] == 7 else output

    import tinylm.training.trainer as trainer_mod

    real_build = trainer_mod.build_model

    def build_with_hook(*a, **k):
        model = real_build(*a, **k)
        model.blocks[0].register_forward_hook(poison)
        return model

    trainer_mod.build_model = build_with_hook
    try:
        with pytest.raises(TinyLMError, match=r"training loss became nan at step 7;"):
            train(cfg, prepared, tmp_path)
    finally:
        trainer_mod.build_model = real_build
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step-0000004", "step-0000006"]
    model, _, meta = load_checkpoint(tmp_path / "checkpoints/step-0000006")
    assert meta["step"] == 6
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.slow  # 15 steps and 3 evaluations
def test_early_stopping_on_validation_loss(prepared_run, tmp_path):
    base, prepared = prepared_run
    # lr 0: the validation loss never improves after the first evaluation
    cfg = _cfg(base, max_steps=50, eval_interval=5, early_stopping_patience=2, lr=0.0, min_lr=0.0, warmup_steps=0)
    result = train(cfg, prepared, tmp_path)
    assert result.stopped_because == "early_stopping"
    assert result.steps == 15  # evaluations at 5 (best), 10 (no gain), 15 (no gain) -> stop


@pytest.mark.slow  # imports tensorboard
def test_metrics_csv_and_tensorboard(prepared_run, tmp_path):
    base, prepared = prepared_run
    cfg = _cfg(base, max_steps=4, log_interval=1, eval_interval=2, tensorboard=True)
    train(cfg, prepared, tmp_path)
    rows = (tmp_path / "metrics.csv").read_text().strip().splitlines()
    assert rows[0].split(",")[:4] == ["step", "tokens", "lr", "train_loss"] and len(rows) == 5
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in acc.Scalars("valid/loss")] == [2, 4]


def test_bf16_autocast_trains_on_cpu(prepared_run, tmp_path):
    base, prepared = prepared_run
    cfg = _cfg(base, max_steps=3, precision="bf16", eval_interval=3)
    result = train(cfg, prepared, tmp_path)
    assert math.isfinite(result.final_train_loss)
    model, _, _ = load_checkpoint(tmp_path / "checkpoints/last")
    assert model.tok_emb.weight.dtype == torch.float32  # master weights stay float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, _ = model(torch.tensor([[2, 5, 6]]))
    assert logits.dtype == torch.bfloat16  # autocast really lowers the matmuls


def test_unsupported_precision_combinations_are_one_line_errors(prepared_run, tmp_path):
    base, prepared = prepared_run
    with pytest.raises(TinyLMError, match="precision=fp16 needs a CUDA device"):
        train(_cfg(base, precision="fp16", device="cpu"), prepared, tmp_path)
    with pytest.raises(TinyLMError, match="train.precision='fp8' is not one of fp32, bf16, fp16"):
        train(_cfg(base, precision="fp8"), prepared, tmp_path)
    assert not make_grad_scaler(torch.device("cpu"), "bf16").is_enabled()


@pytest.mark.slow  # two training runs; tests/test_grad_checkpoint.py is the fast check
def test_gradient_checkpointing_run_equals_plain_run(prepared_run, tmp_path):
    base, prepared = prepared_run
    base = _cfg(base, max_steps=3, eval_interval=3)
    base.model.dropout = 0.1
    plain = train(base, prepared, tmp_path / "plain")
    ckpt = train(_cfg(base, grad_checkpointing=True), prepared, tmp_path / "ckpt")
    assert ckpt.final_train_loss == plain.final_train_loss
    a = load_checkpoint(tmp_path / "plain/checkpoints/last")[0].state_dict()
    b = load_checkpoint(tmp_path / "ckpt/checkpoints/last")[0].state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.slow  # compiles the model
def test_compiled_model_checkpoints_store_plain_weight_names(prepared_run, tmp_path):
    base, prepared = prepared_run
    model = build_model(base, prepared.tokenizer.vocab_size)
    compiled = torch.compile(model)  # wrapping only; nothing is compiled until called
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    state = model_state(compiled)
    assert not any(k.startswith("_orig_mod.") for k in state) and "tok_emb.weight" in state
    save_checkpoint(tmp_path / "c", compiled, prepared.tokenizer, base)
    loaded, _, _ = load_checkpoint(tmp_path / "c")
    assert torch.equal(loaded.tok_emb.weight, model.tok_emb.weight)


def test_cli_bad_training_inputs_are_one_line_errors(tmp_path, stories_file, capsys):
    from tinylm.cli import main

    common = [
        "train",
        "--out",
        str(tmp_path / "run"),
        "data.source=tinystories",
        f"data.train={stories_file}",
        "tokenizer.vocab_size=300",
        "model.context_length=32",
        "model.d_model=32",
        "model.n_layers=1",
        "model.n_heads=4",
        "train.progress=false",
        "train.max_steps=2",
    ]
    for extra, match in (
        (["train.precision=fp16", "train.device=cpu"], "fp16 needs a CUDA device"),
        (["train.grad_accum_steps=0"], "grad_accum_steps must be >= 1"),
        (["train.global_batch_size=7", "train.grad_accum_steps=2"], "not divisible by world size 1"),
        (["train.batch_size=100000"], "larger than the train split"),
    ):
        assert main(common + extra) == 2
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if ": error: " in line]  # after the prepare lines
        assert len(errors) == 1 and match in errors[0] and "Traceback" not in err, err


@pytest.mark.slow
def test_a_fresh_run_into_an_old_directory_starts_a_new_metrics_log(prepared_run, tmp_path):
    base, prepared = prepared_run
    for steps in (6, 4):  # the second run must not append to the first one's rows
        train(_cfg(base, max_steps=steps, eval_interval=2, log_interval=1, progress=False), prepared, tmp_path)
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]


@pytest.mark.slow  # trains two epochs
def test_epochs_stop_after_whole_passes_with_one_row_per_epoch(prepared_run, tmp_path):
    base, prepared = prepared_run
    cfg = _cfg(base, epochs=2, max_steps=10_000, eval_interval=1000, eval_batches=1)
    n_units = (prepared.splits["train"].n_tokens - 1) // cfg.model.context_length  # packed windows
    per_epoch = n_units // cfg.train.batch_size
    result = train(cfg, prepared, tmp_path)
    assert result.steps == 2 * per_epoch
    rows = read_metrics(tmp_path / "epochs.csv")
    assert [r["epoch"] for r in rows] == [1, 2] and [r["step"] for r in rows] == [per_epoch, 2 * per_epoch]
    assert all(math.isclose(r["val_ppl"], math.exp(r["val_loss"]), rel_tol=1e-3) for r in rows)
    assert all(math.isclose(r["train_ppl"], math.exp(r["train_loss"]), rel_tol=1e-3) for r in rows)


def test_an_epoch_visits_every_story_once(prepared_run):
    from tinylm.data.tokens import Batches

    _, prepared = prepared_run
    split = prepared.splits["train"]
    longest = int(max(split.offsets[1:] - split.offsets[:-1]))
    batches = Batches(split, longest, "stories", seed=3, epoch_rows=4)  # whole stories, no windows
    per_epoch = batches.steps_per_epoch
    assert per_epoch == split.n_docs // 4

    def units(epoch: int) -> list[int]:
        return torch.cat([batches.epoch_units(epoch * per_epoch + i, 0, 4) for i in range(per_epoch)]).tolist()

    assert len(set(units(0))) == per_epoch * 4  # no story twice in an epoch
    assert units(0) != units(1)  # a new order each epoch
    # a step's rows are those stories, from their <sos>
    x, _ = batches.get(0, 0, 4)
    starts = split.offsets[units(0)[:4]]
    assert x[:, 0].tolist() == [int(split.ids[s]) for s in starts]
    # rank-style slices of a step are the rows of the whole step
    x_all, _ = batches.get(5, 0, 4)
    assert torch.equal(torch.cat([batches.get(5, 0, 2)[0], batches.get(5, 2, 2)[0]]), x_all)
    with pytest.raises(TinyLMError, match="fewer than"):
        Batches(split, 32, "stories", epoch_rows=split.n_docs + 1)


def test_label_smoothing_trains_on_the_smoothed_loss_and_validates_on_the_plain_one(prepared_run):
    base, prepared = prepared_run
    torch.manual_seed(0)
    model = build_model(base, prepared.tokenizer.vocab_size)
    x = torch.randint(4, 100, (2, 16))
    y = torch.randint(4, 100, (2, 16))
    y[0, -3:] = -100
    logits, loss = model(x, y, loss_reduction="sum", label_smoothing=0.1)
    expected = torch.nn.functional.cross_entropy(
        logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100, reduction="sum", label_smoothing=0.1
    )
    assert torch.allclose(loss, expected)
    _, plain = model(x, y, loss_reduction="sum")
    assert not torch.allclose(loss, plain)
    from tinylm.training.trainer import accumulate_gradients  # the trainer's own path passes it on

    mean, n = accumulate_gradients(model, [(x, y)], torch.device("cpu"), label_smoothing=0.1)
    assert n == 29 and mean == pytest.approx(float(expected.detach()) / 29, rel=1e-5)
    with pytest.raises(TinyLMError, match="label_smoothing"):
        train(_cfg(base, label_smoothing=1.0), prepared, "unused-dir")


@pytest.mark.slow  # three tiny runs
def test_max_tokens_sets_the_step_count_stops_exactly_and_resume_keeps_it(tmp_path):
    cfg, prepared = prepared_stories_run(
        tmp_path, threads=1, max_steps=1000, save_interval=3, eval_interval=3, keep_last=5, log_interval=1
    )
    step_tokens = cfg.train.batch_size * cfg.model.context_length  # 4 rows of 32 positions
    cfg.train.max_tokens = 6 * step_tokens
    full = train(copy.deepcopy(cfg), prepared, tmp_path / "full")
    rows = read_metrics(tmp_path / "full/metrics.csv")
    assert full.steps == 6 and int(rows[-1]["tokens"]) == 6 * step_tokens  # max_steps=1000 is replaced
    saved = yaml.safe_load((tmp_path / "full/config.yaml").read_text())["train"]
    assert saved["max_tokens"] == 6 * step_tokens and saved["max_steps"] == 6  # the schedule followed 6 steps

    resumed = train(copy.deepcopy(cfg), prepared, tmp_path / "resumed", resume=full.checkpoint_dir / "step-0000003")
    again = read_metrics(tmp_path / "resumed/metrics.csv")
    assert resumed.steps == 6 and [(r["step"], r["train_loss"]) for r in again if int(r["step"]) > 3] == [
        (r["step"], r["train_loss"]) for r in rows if int(r["step"]) > 3
    ]  # the same losses, bit for bit

    cfg.train.max_tokens = 6 * step_tokens + 1  # a budget between steps: the step that reaches it is the last
    assert train(copy.deepcopy(cfg), prepared, tmp_path / "over").steps == 7

    cfg.train.epochs = 2
    with pytest.raises(TinyLMError, match="train.max_tokens and train.epochs both set the step count"):
        train(copy.deepcopy(cfg), prepared, tmp_path / "both")


def test_on_evaluate_sees_each_evaluation_and_changes_nothing(tmp_path):
    cfg, prepared = prepared_stories_run(tmp_path, threads=1, max_steps=6, eval_interval=2, log_interval=1)
    cfg.model.dropout = 0.1  # a callback that drew from the global generator would shift the dropout masks
    seen = []

    def draw(model, step, tokens):
        seen.append((step, tokens, model.training))
        torch.rand(1000)  # what a sampler draws must not reach the run

    train(copy.deepcopy(cfg), prepared, tmp_path / "with", on_evaluate=draw)
    train(copy.deepcopy(cfg), prepared, tmp_path / "without")
    step_tokens = cfg.train.batch_size * cfg.model.context_length
    assert seen == [(2, 2 * step_tokens, False), (4, 4 * step_tokens, False), (6, 6 * step_tokens, False)]
    losses = [[r["train_loss"] for r in read_metrics(tmp_path / run / "metrics.csv")] for run in ("with", "without")]
    assert losses[0] == losses[1]


def test_document_attention_reaches_the_training_and_validation_losses(prepared_run, tmp_path):
    base, prepared = prepared_run
    runs = {
        on: train(
            _cfg(base, max_steps=2, log_interval=1, eval_interval=2, document_attention=on),
            prepared,
            tmp_path / str(on),
        )
        for on in (False, True)
    }
    logs = {on: read_metrics(tmp_path / str(on) / "metrics.csv") for on in runs}
    # the same seed, batches and weights: only the attention mask tells the two runs apart
    first = {on: float(logs[on][0]["train_loss"]) for on in runs}
    assert math.isfinite(first[True]) and first[True] != pytest.approx(first[False], rel=1e-6)
    assert float(logs[True][-1]["val_loss"]) != pytest.approx(float(logs[False][-1]["val_loss"]), rel=1e-6)
    saved = yaml.safe_load((tmp_path / "True" / "config.yaml").read_text())
    assert saved["train"]["document_attention"] is True


def test_document_attention_with_stories_batching_is_refused(prepared_run):
    base, _ = prepared_run
    cfg = _cfg(base, document_attention=True)
    cfg.data.batching = "stories"
    with pytest.raises(TinyLMError, match="document_attention=true is for data.batching=packed"):
        cfg.validate()


def test_init_from_starts_from_a_checkpoints_weights_with_a_fresh_optimizer(prepared_run, tmp_path):
    cfg, prepared = prepared_run
    first = train(with_overrides(cfg, max_steps=4), prepared, tmp_path / "first")
    start = first.checkpoint_dir / "last"
    # lr 0: the continued run's weights stay the checkpoint's, step for step
    again = train(with_overrides(cfg, max_steps=2, lr=0.0, init_from=str(start)), prepared, tmp_path / "again")
    expected = load_checkpoint(start)[0].state_dict()
    for name, value in load_checkpoint(again.checkpoint_dir / "last")[0].state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert again.steps == 2  # its own step count, not the first run's
    other = with_overrides(cfg, model={"d_model": 48}, max_steps=1, init_from=str(start))
    with pytest.raises(TinyLMError, match=r"train.init_from=.*does not match model"):
        train(other, prepared, tmp_path / "other")
