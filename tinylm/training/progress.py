"""What a training run shows while it runs: tqdm's bar when stderr is a terminal; otherwise (nohup,
CI, a notebook, a study's log file) a plain line every ``log_interval`` steps with the step, the
loss, tokens/s, the time elapsed and an estimate of the time left, so a run nobody watches still
says how it is going.
"""

from __future__ import annotations

import sys
from typing import Callable, TextIO

from tinylm.config import TrainConfig


def format_seconds(seconds: float) -> str:
    """``75`` -> ``1m 15s``, ``3725`` -> ``1h 02m``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def seconds_left(tc: TrainConfig, first_step: int, step: int, elapsed: float) -> float | None:
    """Time to the nearer of the step budget and the wall-clock budget, at this session's pace.
    Early stopping may end the run sooner: the estimate is an upper bound."""
    estimates = []
    if step > first_step:
        estimates.append((tc.max_steps - step) * elapsed / (step - first_step))
    if tc.max_minutes is not None:
        estimates.append(tc.max_minutes * 60 - elapsed)
    return max(0.0, min(estimates)) if estimates else None


class Progress:
    """``update`` after every optimizer step; ``close`` at the end."""

    def __init__(self, tc: TrainConfig, first_step: int, say: Callable[[str], None], stream: TextIO | None = None):
        self.tc, self.first_step, self.say = tc, first_step, say
        stream = sys.stderr if stream is None else stream
        self.bar = None
        if getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm  # deferred: only a terminal gets a bar

            self.bar = tqdm(
                total=tc.max_steps,
                initial=first_step,
                desc="train",
                unit="step",
                dynamic_ncols=True,
                leave=False,
                file=stream,
            )

    def update(self, step: int, loss: float, tokens_per_s: float, elapsed: float, memory_gib: float | None = None):
        if self.bar is not None:
            postfix = {"loss": f"{loss:.3f}", "tok_s": f"{tokens_per_s:,.0f}"}
            if memory_gib is not None:
                postfix["mem"] = f"{memory_gib:.2f}G"
            self.bar.update(1)
            self.bar.set_postfix(postfix)
            return
        if step % self.tc.log_interval:
            return
        left = seconds_left(self.tc, self.first_step, step, elapsed)
        budget = f"/{self.tc.max_steps:,}" if self.tc.max_minutes is None else ""
        self.say(
            f"train: step {step:,}{budget} | loss {loss:.4f} | {tokens_per_s:,.0f} tokens/s | "
            f"elapsed {format_seconds(elapsed)} | ETA {'?' if left is None else format_seconds(left)}"
            + (f" | {memory_gib:.2f} GiB" if memory_gib is not None else "")
        )

    def message(self, text: str) -> None:
        """A line of its own: above the bar on a terminal, logged like the progress lines elsewhere."""
        if self.bar is not None:
            self.bar.write(text, file=self.bar.fp)
        else:
            self.say(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
