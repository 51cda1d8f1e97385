"""report.md / report.html: numbers come from the run's files, missing parts are said to be missing."""

from __future__ import annotations

import json

import pytest
import yaml

from tinylm.cli import main
from tinylm.config import RunConfig
from tinylm.errors import TinyLMError
from tinylm.evaluation.plots import plot_curves
from tinylm.evaluation.report import build_report, write_run_report
from tinylm.studies import tinystories_report


def write_training_run(run, metrics=True):
    cfg = RunConfig()
    cfg.model.vocab_size, cfg.model.d_attn, cfg.model.d_ff, cfg.model.n_kv_heads = 777, 128, 512, 4
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    (run / "prepare.json").write_text(
        json.dumps(
            {
                "splits": ["train", "valid"],
                "documents": {"train": 90, "valid": 10},
                "tokens": {"train": 12345, "valid": 1234},
                "bytes": {"train": 54321, "valid": 5432},
            }
        )
    )
    (run / "eval.json").write_text(
        json.dumps(
            {
                "parameters": 424242,
                "steps": 60,
                "train_seconds": 12.5,
                "tokens_per_s": 3210.0,
                "stopped_because": "max_steps",
                "best_val_loss": 2.3456,
                "final_train_loss": 2.1111,
                "eval": {"valid": {"token_ppl": 10.4321, "bpb": 1.2345, "word_ppl": 20.9876, "tokens": 1234}},
            }
        )
    )
    (run / "samples.json").write_text(json.dumps([{"prompt": "Once", "continuation": " upon a time", "new_tokens": 3}]))
    if metrics:
        (run / "metrics.csv").write_text(
            "step,tokens,lr,train_loss,val_loss,val_ppl,tokens_per_s,elapsed_s\n"
            "30,100,1e-3,3.00000,3.10000,22.198,100,1\n60,200,1e-3,2.11110,2.34560,10.441,100,2\n"
        )


def test_training_run_report_reads_every_number_from_files(tmp_path):
    write_training_run(tmp_path)
    path = write_run_report(tmp_path)[0]
    md = path.read_text()
    for expected in (
        "| vocabulary | 777 |",
        "| parameters (total) | 424,242 |",
        "| valid | 10 | 1,234 | 5,432 |",
        "10.4321",
        "1.2345",
        "20.9876",
        "| 60 | 2.1111 | 2.3456 | 10.44 |",
        "upon a time",
        "## Machine",
    ):
        assert expected in md, expected
    assert "INCOMPLETE" not in md and "missing" not in md
    page = (tmp_path / "report.html").read_text()
    assert "10.4321" in page and "<table>" in page and "upon a time" in page
    assert "data:image" not in page  # no curves.png in this run, and no broken image either


@pytest.mark.slow  # draws the curves PNG
def test_html_is_one_page_with_tables_embedded_curves_and_escaped_text(tmp_path):
    write_training_run(tmp_path)
    (tmp_path / "samples.json").write_text(
        json.dumps([{"prompt": "Once <b>&", "continuation": " a <b>& b", "new_tokens": 3}])
    )
    plot_curves(tmp_path / "metrics.csv", tmp_path / "curves.png")
    md, page, missing = write_run_report(tmp_path)
    assert missing == [] and "![loss and perplexity curves](curves.png)" in md.read_text()
    html = page.read_text()
    assert "<table>" in html and "<th>setting</th>" in html and "<td>777</td>" in html
    assert html.count('src="data:image/png;base64,') == 1 and 'src="curves.png"' not in html
    assert "Once &lt;b&gt;&amp; a &lt;b&gt;&amp; b" in html and "<b>&" not in html


def test_report_command_picks_the_experiments_report_when_the_run_has_one(tmp_path, capsys):
    write_training_run(tmp_path)
    assert main(["report", str(tmp_path)]) == 0
    assert "# tinylm run:" in (tmp_path / "report.md").read_text()
    (tmp_path / "experiments.json").write_text(json.dumps({"parts": {}}))
    assert main(["report", str(tmp_path)]) == 0
    md = (tmp_path / "report.md").read_text()
    assert "# tinylm experiments:" in md and "## KV cache" in md and "INCOMPLETE" in capsys.readouterr().out


def test_a_binary_eval_json_makes_its_section_missing_not_a_crash(tmp_path, capsys):
    write_training_run(tmp_path)
    (tmp_path / "eval.json").write_bytes(b"\xff\xfe\x00binary")
    assert main(["report", str(tmp_path)]) == 0
    assert "eval.json (perplexity of the run's result checkpoint)" in capsys.readouterr().out


def test_run_without_metrics_is_reported_incomplete(tmp_path, capsys):
    write_training_run(tmp_path, metrics=False)
    doc = build_report(tmp_path)
    assert any("metrics.csv" in m for m in doc.missing)
    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "INCOMPLETE: 1 part(s) missing" in out and "metrics.csv" in out
    assert "**INCOMPLETE REPORT: 1 part(s) missing**" in (tmp_path / "report.md").read_text()


def test_not_a_run_directory(tmp_path, capsys):
    with pytest.raises(TinyLMError, match="not a tinylm run directory"):
        write_run_report(tmp_path)
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_experiment_report_lists_every_missing_part(tmp_path):
    write_training_run(tmp_path)
    (tmp_path / "experiments.json").write_text(
        json.dumps({"quick": True, "command": "tinylm experiments --quick", "parts": {}})
    )
    md = tinystories_report.write_experiments_report(tmp_path)[0].read_text()
    for part in (
        "bleu.json",
        "decoding.json",
        "kv_cache.json",
        "accumulation.json",
        "checkpointing.json",
        "attention.json",
        "curves.png",
    ):
        assert part in md, part
    assert "INCOMPLETE REPORT" in md and "`tinylm experiments --quick` (quick)" in md


def test_experiment_tables_show_the_files_numbers(tmp_path):
    write_training_run(tmp_path)
    (tmp_path / "experiments.json").write_text(json.dumps({"quick": False, "parts": {}}))
    sacre = {"bleu": 3.1415, "signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0"}
    bleu_row = {
        "name": "T0.7",
        "bleu1": 0.4321,
        "bleu2": 0.2109,
        "bleu3": 0.1098,
        "bleu4": 0.0567,
        "sacrebleu": sacre,
        "sentence_bleu": {"bleu1": 0.5, "bleu2": 0.3, "bleu3": 0.2, "bleu4": 0.0789},
        "tokens_per_s": 456.0,
        "csv": "bleu_samples_T0.7.csv",
    }
    (tmp_path / "bleu.json").write_text(
        json.dumps(
            {
                "protocol": {"prompt_tokens": 5, "max_continuation": 60, "seed": 0, "smoothing": "method1"},
                "samples": 48,
                "requested": 50,
                "notes": ["asked for 50 samples, only 48 usable stories exist; using them all"],
                "reference_ppl": 17.25,
                "reference_tokens": 2000,
                "mean_per_sample_ppl": 19.5,
                "bleu_tokenization": "x",
                "meaning": "BLEU: weak for stories",
                "settings": [bleu_row],
            }
        )
    )
    (tmp_path / "decoding.json").write_text(
        json.dumps(
            {
                "samples": 48,
                "threads": 2,
                "settings": [
                    {**bleu_row, "name": "sample_T1", "speed_vs_sampling": 1.0},
                    {"name": "beam5", "beam_width": 5, "missing": "beam search is not available"},
                ],
            }
        )
    )
    (tmp_path / "kv_cache.json").write_text(
        json.dumps(
            {
                "threads": 1,
                "repeats": 3,
                "context_length": 64,
                "batch": 20,
                "rows": [
                    {
                        "decoding": "greedy",
                        "batch": 20,
                        "prompt_tokens": 9,
                        "new_tokens": 32,
                        "cache_bytes": 5 * 2**20,
                        "cache_tokens_per_s": 812.0,
                        "nocache_tokens_per_s": 203.0,
                        "speedup": 4.0,
                        "same_tokens": True,
                        "total_tokens": 41,
                        "beyond_context": False,
                    },
                    {
                        "decoding": "greedy",
                        "batch": 20,
                        "prompt_tokens": 9,
                        "new_tokens": 503,
                        "cache_bytes": 5 * 2**20,
                        "cache_tokens_per_s": 700.0,
                        "nocache_tokens_per_s": 70.0,
                        "speedup": 10.0,
                        "same_tokens": False,
                        "total_tokens": 512,
                        "beyond_context": True,
                    },
                ],
            }
        )
    )
    (tmp_path / "accumulation.json").write_text(
        json.dumps(
            {
                "threads": 2,
                "rows": [
                    {
                        "accum_steps": 4,
                        "effective_batch": 128,
                        "optimizer_steps": 16,
                        "micro_batches": 64,
                        "micro_batch": 32,
                        "final_train_loss": 4.5678,
                        "final_val_loss": 4.6789,
                        "seconds": 33.3,
                        "tokens_per_s": 999.0,
                        "projected_epoch_seconds": 123.0,
                        "peak_activation_bytes": 3 * 2**20,
                    }
                ],
            }
        )
    )
    md = tinystories_report.write_experiments_report(tmp_path)[0].read_text()
    assert "| T0.7 | 0.4321 | 0.2109 | 0.1098 | 0.0567 | 0.0789 | 3.14 | 456 |" in md
    assert "tok:13a" in md and "only 48 usable" in md and "17.2500" in md
    assert "| greedy | 20 x 32 | 41 | 5.00 MiB | 812 | 203 | 4.00x | yes | no |" in md
    assert "| greedy | 20 x 503 | 512 | 5.00 MiB | 700 | 70 | 10.00x | no | sliding window |" in md
    assert "re-filled with the last 32 tokens" in md  # what happens past the context of 64
    assert "greedy, batch 20 x 32: 4.00x" in md  # beside the reports' speed-ups
    # a file from before the two comparisons: its epoch time is marked as projected
    assert (
        "| equal micro-batches | 4 | 128 | - | 16 | 4.5678 | - | 4.6789 | 33.3 | 123 (projected) | 999 | 3.00 MiB |"
        in md
    )
    assert "decoding.json has no example continuations" in md
    assert "decoding beam5: beam search is not available" in md  # listed in the INCOMPLETE banner


def test_bleu_perplexities_are_the_judged_models(tmp_path):
    """BLEU's samples come from the model a part judged; the perplexity beside them must be its own."""
    write_training_run(tmp_path)  # the run's own model: token ppl 10.4321
    (tmp_path / "experiments.json").write_text(json.dumps({"quick": False, "parts": {}}))
    (tmp_path / "column").mkdir()
    (tmp_path / "column" / "eval.json").write_text(
        json.dumps({"eval": {"valid": {"token_ppl": 8.7654, "word_ppl": 12.3456}}})
    )
    bleu = {
        "protocol": {"prompt_tokens": 5, "max_continuation": None, "seed": 0, "smoothing": "method1"},
        "samples": 2,
        "requested": 2,
        "reference_ppl": 9.5,
        "reference_tokens": 100,
        "mean_per_sample_ppl": 9.9,
        "bleu_tokenization": "x",
        "meaning": "BLEU",
        "settings": [],
        "judged": "column",
    }
    (tmp_path / "bleu.json").write_text(json.dumps(bleu))
    md = tinystories_report.write_experiments_report(tmp_path)[0].read_text()
    assert "| validation token ppl | 8.7654 | every validation story, from <sos>; the judged model (column/) |" in md
    assert "| validation word ppl | 12.3456 |" in md
    del bleu["judged"]  # a run without the second column judges its own model
    (tmp_path / "bleu.json").write_text(json.dumps(bleu))
    md = tinystories_report.write_experiments_report(tmp_path)[0].read_text()
    assert "| validation token ppl | 10.4321 | every validation story, from <sos>; this run's model |" in md


def test_a_malformed_part_file_makes_only_its_section_missing(tmp_path):
    write_training_run(tmp_path)
    (tmp_path / "experiments.json").write_text(json.dumps({"parts": {}}))
    (tmp_path / "kv_cache.json").write_text(json.dumps({"rows": [{"new_tokens": 3}]}))  # no timing keys
    doc = tinystories_report.build_report(tmp_path)
    assert any(m.startswith("kv: a file has an unexpected format (KeyError") for m in doc.missing)
    # the rest of the report is there
    assert "10.4321" in tinystories_report.write_experiments_report(tmp_path)[0].read_text()


def test_beside_the_reports_gives_each_perplexity_its_training_budget():
    from tinylm.studies.tinystories_compare import comparison_table

    eval_json = {
        "train_seconds": 2700.0,
        "steps": 450,
        "tokens_per_s": 1200.0,
        "eval": {"valid": {"token_ppl": 12.345}},
    }
    headers, rows = comparison_table({"eval": eval_json})
    cells = {row[0]: row[1:] for row in rows}
    ours, r000, r001, r002, r003 = cells["validation perplexity"]
    assert ours == "12.35 (every validation story) (after: 45.0 min, 450 steps, 3.24M training positions)"
    assert (
        r002
        == "final 9.41; epoch 3 (last of its epoch table) 7.49; on the 50 BLEU samples 9.41 (after: 3 epochs; batch 32)"
    )
    assert r000.endswith("(after: 10.5 hours (50,000 steps; section 2.3 and 5.1); batch 32)")
    assert r003.endswith("(after: 1 hr 45 mins approx per epoch, 10 epochs (full dataset))")  # epochs not repeated
    assert cells["hardware"][2].startswith("a CPU, model not stated")  # report 001


def test_checkpointing_spread_counts_the_rounds_each_variant_lost():
    assert tinystories_report._sign_test(7, 8) == 9 / 256
    assert tinystories_report._sign_test(0, 5) == 1.0
    rows = [
        {"name": "plain", "seconds_each": [10.0, 11.0, 10.0, 12.0]},
        {"name": "ckpt", "label": "checkpointed", "seconds_each": [11.0, 12.0, 10.5, 11.0]},
    ]
    said = tinystories_report._spread_sentence(rows)
    assert "plain 10.0-12.0 s" in said
    assert "checkpointed: 10.5-12.0 s, inside plain's range" in said
    rows.append({"name": "torch", "seconds_each": [9.5, 13.0, 12.5, 13.5]})
    rows.append({"name": "slow", "seconds_each": [12.5, 13.0, 12.5, 13.5]})
    said = tinystories_report._spread_sentence(rows)
    assert "torch: 9.5-13.5 s, overlapping plain's range" in said and "slow: 12.5-13.5 s, outside" in said
    assert "1.10, 1.09, 1.05, 0.92" in said
    assert "median 1.07, slower in 3 of 4 rounds, one-sided sign test p = 0.312" in said
