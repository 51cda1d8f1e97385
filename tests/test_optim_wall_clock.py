"""train.schedule_clock=wall: the learning-rate decay follows elapsed / max_minutes instead of
step / max_steps (tinylm/training/optim.py lr_at, used by the trainer)."""

import csv
import math

import pytest
from conftest import make_stories, tiny_run_config

from tinylm.config import TrainConfig, check_config
from tinylm.data.prepare import prepare
from tinylm.errors import TinyLMError
from tinylm.training import trainer as trainer_module
from tinylm.training.optim import lr_at, wall_schedule_enabled


def test_the_decay_follows_the_further_spent_budget_time_or_steps():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=1000, max_minutes=60, schedule_clock="wall")
    assert lr_at(4, cfg, wall_fraction=0.9) == pytest.approx(5e-4)  # warmup stays in steps
    assert lr_at(10, cfg, wall_fraction=0.0) == pytest.approx(1e-3)
    assert lr_at(20, cfg, wall_fraction=0.5) == pytest.approx(1e-4 + 0.5 * 9e-4)  # time further spent: its midpoint
    assert lr_at(20, cfg, wall_fraction=1.0) == pytest.approx(1e-4)  # early step, budget spent: min_lr
    assert lr_at(20, cfg, wall_fraction=3.0) == pytest.approx(1e-4)  # clamped
    quarter = 1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 0.25))
    assert lr_at(250, cfg, wall_fraction=0.25) == pytest.approx(quarter)
    by_steps = 1e-4 + 0.5 * 9e-4 * (1 + math.cos(math.pi * 240 / 990))  # steps further spent than time
    assert lr_at(250, cfg, wall_fraction=0.1) == pytest.approx(by_steps)
    assert lr_at(1000, cfg, wall_fraction=0.25) == pytest.approx(1e-4)  # the steps ran out first: min_lr
    # without a fraction the step schedule is unchanged
    assert lr_at(505, cfg) == pytest.approx(1e-4 + 0.5 * 9e-4)
    linear = TrainConfig(lr=1e-3, min_lr=0.0, warmup_steps=0, schedule="linear", max_minutes=1, schedule_clock="wall")
    assert lr_at(3, linear, wall_fraction=0.75) == pytest.approx(2.5e-4)


def test_wall_clock_needs_a_budget_and_a_known_name():
    assert not wall_schedule_enabled(TrainConfig())
    assert wall_schedule_enabled(TrainConfig(max_minutes=5, schedule_clock="wall"))
    with pytest.raises(TinyLMError, match="train.schedule_clock=wall needs a wall budget: set train.max_minutes"):
        check_config(TrainConfig(schedule_clock="wall"), "train.")
    with pytest.raises(TinyLMError, match="train.schedule_clock='hours' is not one of steps, wall"):
        check_config(TrainConfig(max_minutes=5, schedule_clock="hours"), "train.")


class FakeTime:
    """perf_counter advancing 6 s per call: the trainer reads it twice per step (lr, budget check)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 6.0
        return self.now


def test_trainer_decays_over_the_wall_budget(tmp_path, monkeypatch):
    data = tmp_path / "stories.txt"
    data.write_text("".join(f"{s}\n<|endoftext|>\n" for s in make_stories()), encoding="utf-8")
    cfg = tiny_run_config(
        tmp_path / "run",
        data,
        threads=1,
        max_steps=1000,
        max_minutes=1.0,
        warmup_steps=1,
        lr=1e-3,
        min_lr=1e-5,
        schedule_clock="wall",
        log_interval=1,
        eval_interval=1000,
    )
    prepared = prepare(cfg, tmp_path / "run")
    monkeypatch.setattr(trainer_module, "time", FakeTime())
    result = trainer_module.train(cfg, prepared, tmp_path / "run")
    assert result.stopped_because == "max_minutes"
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    lrs = [float(r["lr"]) for r in rows]
    elapsed = [float(r["elapsed_s"]) for r in rows]
    assert elapsed[-1] >= 60.0 and len(rows) == result.steps < 10  # stopped by the clock, not max_steps
    # step s (s >= warmup) used the fraction measured just before it: 12 s per step, first at 6 s
    for s in range(1, len(lrs)):
        expected = lr_at(s, cfg.train, wall_fraction=(6.0 + 12.0 * s) / 60.0)
        assert lrs[s] == pytest.approx(expected, rel=1e-3)
    assert lrs[1] > lrs[-1] and lrs[-1] < 2e-4  # near min_lr when the budget runs out
