"""benchmarks/serve_rounds.py: rounds of bench_serve.py gathered into medians and ratios."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_rounds.py"


def load():
    spec = importlib.util.spec_from_file_location("serve_rounds", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def write_round(path: Path, engine_rates: dict[str, dict[int, float]]) -> None:
    runs = [
        {"engine": engine, "clients": c, "tokens_per_s": t, "ttft_p50_ms": 10.0, "ttft_p95_ms": 20.0, "errors": 0}
        for engine, rates in engine_rates.items()
        for c, t in rates.items()
    ]
    path.write_text(json.dumps({"runs": runs}))


def test_medians_and_ratios_over_rounds(tmp_path, capsys):
    for k, scale in enumerate((1.0, 2.0, 1.5)):  # three rounds of the new tree (both engines), then the old one
        write_round(
            tmp_path / f"new_{k}.json", {"process": {1: 100 * scale, 16: 600 * scale}, "thread": {1: 50, 16: 90}}
        )
        write_round(tmp_path / f"old_{k}.json", {"process": {1: 100, 16: 300 + k}})
    mod = load()
    out = tmp_path / "plot.png"
    assert (
        mod.main(
            [
                "--series",
                f"new={tmp_path}/new_*.json@process",
                "--series",
                f"thread={tmp_path}/new_*.json@thread",
                "--series",
                f"old={tmp_path}/old_*.json",
                "--reference",
                "old",
                "--plot",
                str(out),
            ]
        )
        == 0
    )
    lines = {tuple(c.strip() for c in line.split("|")[1:3]): line for line in capsys.readouterr().out.splitlines()}
    # new at 16 clients: runs 600, 1200, 900 -> median 900; 1 client: median 150 -> 6.00x; old's median 301 -> 2.99x
    assert "| 600, 1200, 900 | 900 | 6.00x | 2.99x |" in lines[("new", "16")]
    assert "| 90, 90, 90 | 90 | 1.80x | 0.30x |" in lines[("thread", "16")]
    assert out.stat().st_size > 10_000


def test_a_series_that_matches_no_file_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="a label and a glob"):
        load().main(["--series", f"x={tmp_path}/none_*.json", "--reference", "x"])


def test_panels_set_the_knob_setting_in_every_glob(tmp_path, capsys):
    for t, rate in (("0.8", 400), ("0", 800)):
        for k in range(2):
            write_round(tmp_path / f"new_T{t}_{k}.json", {"process": {1: 100, 32: rate}})
            write_round(tmp_path / f"old_T{t}_{k}.json", {"process": {1: 100, 32: 200}})
    out = tmp_path / "panels.png"
    series = ["--series", f"new={tmp_path}/new_T{{T}}_*.json", "--series", f"old={tmp_path}/old_T{{T}}_*.json"]
    panels = ["--panel", "sampled=0.8", "--panel", "greedy=0"]
    assert load().main(series + panels + ["--reference", "old", "--plot", str(out)]) == 0
    printed = capsys.readouterr().out
    sampled, greedy = printed[printed.index("sampled:") : printed.index("greedy:")], printed[printed.index("greedy:") :]
    assert "| new | 32 | 400, 400 | 400 | 4.00x | 2.00x |" in sampled
    assert "| new | 32 | 800, 800 | 800 | 8.00x | 4.00x |" in greedy
    assert out.stat().st_size > 10_000
