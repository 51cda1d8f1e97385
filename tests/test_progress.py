"""Progress while training: a bar on a terminal, a line every log_interval steps elsewhere."""

import io
import subprocess
import sys

import pytest

from tinylm.config import TrainConfig
from tinylm.training.progress import Progress, format_seconds, seconds_left


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 9.4, 75, 3600, 3725)] == ["0s", "9s", "1m 15s", "1h 00m", "1h 02m"]


def test_seconds_left_is_the_nearer_budget_at_this_sessions_pace():
    tc = TrainConfig(max_steps=1000)
    assert seconds_left(tc, 0, 0, 5.0) is None  # no step yet, no wall budget: unknown
    assert seconds_left(tc, 0, 100, 50.0) == pytest.approx(450.0)  # 900 steps at 0.5 s
    assert seconds_left(tc, 400, 500, 50.0) == pytest.approx(250.0)  # a resumed session: its own pace
    tc.max_minutes = 2
    assert seconds_left(tc, 0, 100, 50.0) == pytest.approx(70.0)  # the clock ends first
    assert seconds_left(tc, 0, 100, 500.0) == 0.0


def test_without_a_terminal_a_line_every_log_interval_steps():
    lines, stream = [], io.StringIO()
    progress = Progress(TrainConfig(max_steps=40, log_interval=10), 0, lines.append, stream)
    for step in range(1, 41):
        progress.update(step, 3.0 - step / 100, 1234.5, step * 0.5)
    progress.close()
    assert len(lines) == 4 and stream.getvalue() == ""
    assert lines[1] == "train: step 20/40 | loss 2.8000 | 1,234 tokens/s | elapsed 10s | ETA 10s"


def test_on_a_terminal_a_bar_and_no_lines():
    lines, stream = [], _Terminal()
    progress = Progress(TrainConfig(max_steps=20, log_interval=5), 0, lines.append, stream)
    for step in range(1, 21):
        progress.update(step, 2.0, 100.0, float(step))
    progress.close()
    assert lines == [] and "20/20" in stream.getvalue()


@pytest.mark.slow  # a real `tinylm train` with its stderr piped, as under nohup or CI
def test_train_prints_progress_lines_when_stderr_is_not_a_terminal(tmp_path, stories_file):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinylm.cli",
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
            "train.max_steps=6",
            "train.log_interval=3",
            "train.eval_interval=6",
            "train.threads=1",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "train: step" in line]
    assert [line.split(" | ")[0].split("train: step ")[1] for line in lines] == ["3/6", "6/6"], proc.stderr
    assert all(" tokens/s | elapsed " in line and "| ETA " in line for line in lines)
