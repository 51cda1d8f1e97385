"""Cached, keyed, atomic stages: how both studies resume where they stopped.

A stage's result is one JSON object in a file of the run directory, saved with ``key``, a hash of
every input that determines it. A later run with the same key reuses the file; another key, a
damaged file or a saved failure (an ``error`` field) computes it again. The file is written under
a temporary name and renamed over the old one, so an interrupted run leaves the old file or the
new one, never a part of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tinylm.evaluation.report import Doc, read_json


def stage_key(inputs) -> str:
    """A short hash of ``inputs`` as JSON (keys sorted; what JSON cannot hold, as its str)."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Stage:
    path: Path
    key: str

    def saved(self) -> dict | None:
        """What the file holds, whatever its key (None: no file, or not a JSON object)."""
        saved = read_json(self.path)
        return saved if isinstance(saved, dict) else None

    def fresh(self) -> dict | None:
        """The saved result (without its key) when it was computed under this key and did not fail."""
        saved = self.saved()
        if saved is None or saved.get("key") != self.key or saved.get("error"):
            return None
        return {k: v for k, v in saved.items() if k != "key"}

    def compute(self, run: Callable[[], dict]) -> dict:
        """``run()``'s result with its wall time as ``seconds``, saved under the key."""
        start = time.perf_counter()
        result = run()
        result["seconds"] = round(time.perf_counter() - start, 2)
        self.save(result)
        return result

    def save(self, result: dict) -> None:
        """``result`` written under the key, whole or not at all: a run stopped mid-write keeps the old file."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(
            json.dumps({**result, "key": self.key}, indent=2, ensure_ascii=False, default=float), encoding="utf-8"
        )
        os.replace(tmp, self.path)

    def run(self, compute: Callable[[], dict], say: Callable[[str], None]) -> dict:
        """The fresh saved result (said so), or ``compute()``'s."""
        saved = self.fresh()
        if saved is None:
            return self.compute(compute)
        say(f"reusing {self.path.parent.name}/{self.path.name}")
        return saved


def start_part_section(doc: Doc, heading: str, part: dict | None, name: str, what: str) -> bool:
    """A part's report section begins: its heading; False (noting what is missing) when the part
    has not run (``part`` is None) or saved its error."""
    doc.h(heading)
    if part is None:
        doc.lack(f"{name}.json ({what}: this part has not run)")
        return False
    if part.get("error"):
        doc.lack(f"{what}: the part failed: {part['error']}")
        return False
    return True
