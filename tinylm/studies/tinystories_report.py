"""`report.md` and `report.html` of a `tinylm experiments` run (it has ``experiments.json``): the
training run's sections (tinylm.evaluation.report) plus every table and figure of the TinyStories
assignment. Every number is read from the parts' files; a part that has not run, failed or is
stale is listed at the top as missing.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from tinylm.evaluation import report
from tinylm.evaluation.report import Doc, safely
from tinylm.studies.stages import start_part_section
from tinylm.studies.tinystories_compare import comparison_table
from tinylm.studies.tinystories_fluency import section_fluency
from tinylm.studies.tinystories_protocols import section_protocols

# the parts that judge a trained model's output (tinylm.studies.tinystories chooses which model)
QUALITY_PARTS = ("bleu", "decoding", "fluency", "generations", "kv_cache", "attention", "protocols")


def _mib(n) -> str:
    return "missing" if n is None else f"{n / 2**20:.2f} MiB"


def _sentence_bleu4(s: dict) -> str:
    return f"{s['sentence_bleu']['bleu4']:.4f}" if "sentence_bleu" in s else "missing"


def _bleu_rows(settings):
    rows = []
    for s in settings:
        if "missing" in s:
            rows.append((s["name"], *(["missing"] * 6), "missing: " + s["missing"]))
            continue
        bleu = [s[f"bleu{n}"] for n in (1, 2, 3, 4)]
        rows.append((s["name"], *bleu, _sentence_bleu4(s), f"{s['sacrebleu']['bleu']:.2f}", f"{s['tokens_per_s']:.0f}"))
    return rows


BLEU_HEADERS = ["BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "sentence BLEU-4", "sacreBLEU", "tokens/s"]


def _section_bleu(doc: Doc, run: Path, bleu, ev):
    if not start_part_section(doc, "BLEU and perplexity", bleu, "bleu", "the BLEU protocol"):
        return
    pr = bleu["protocol"]
    drawn = (
        "the first ones in file order" if pr.get("selection") == "first" else f"drawn at random with seed {pr['seed']}"
    )
    rest = (
        "the rest of the story, as far as the context holds"
        if pr.get("max_continuation") is None
        else f"the next tokens, at most {pr['max_continuation']}"
    )
    doc.p(
        f"{bleu['samples']} validation stories (of {bleu['requested']} requested; {drawn}), prompt = their first "
        f"{pr['prompt_tokens']} tokens, reference = {rest}; sample k decodes with seed {pr['seed']} + k. "
        f"BLEU-1..4: cumulative, uniform weights, NLTK-style corpus BLEU with smoothing `{pr['smoothing']}` "
        f"(SmoothingFunction().method1: zero counts become 0.1) on tokens `{bleu['bleu_tokenization']}`. "
        f"Sentence BLEU-4: the mean over the samples of each one's own BLEU-4 (NLTK's `sentence_bleu`, the same "
        f'smoothing `{pr["smoothing"]}`): the "average BLEU over 50 samples" two reports published, which '
        "weighs every sample alike and is lifted by smoothing wherever a sample shares no 4-gram. "
        "sacreBLEU: 0-100, signature "
        f"`{(bleu['settings'] or [{}])[0].get('sacrebleu', {}).get('signature', 'missing')}`."
    )
    doc.p(bleu["meaning"])
    for note in bleu.get("notes", []):
        doc.p(f"**note:** {note}")
    doc.table(["temperature", *BLEU_HEADERS], _bleu_rows(bleu["settings"]))
    if bleu.get("judged"):  # the samples came from the tinylm-settings model, so its perplexity goes beside them
        ev = report.read_json(run / bleu["judged"] / "eval.json")
    whose = f"the judged model ({bleu['judged']}/)" if bleu.get("judged") else "this run's model"
    valid = (ev or {}).get("eval", {}).get("valid", {})
    doc.table(
        ["perplexity", "value", "meaning"],
        [
            ("validation token ppl", valid.get("token_ppl"), f"every validation story, from <sos>; {whose}"),
            ("validation word ppl", valid.get("word_ppl"), "same NLL per whitespace word"),
            (
                "reference continuation ppl",
                bleu["reference_ppl"],
                f"the {bleu['reference_tokens']:,} real continuation tokens given their prompts "
                "(not the model's own samples)",
            ),
            ("mean per-sample ppl", bleu["mean_per_sample_ppl"], "mean of the CSV's per_sample_ppl column"),
        ],
    )
    files = ", ".join(f"`{s['csv']}`" for s in bleu["settings"] if s.get("csv"))
    doc.p(
        f"Per-sample CSVs (prompt, reference_continuation, hypothesis_continuation, per_sample_ppl, "
        f"sentence_bleu4): {files}"
    )


def _section_generations(doc: Doc, generations, run_samples):
    doc.h("Example generations")
    if generations and not generations.get("error"):
        table = generations.get("table")
        if table and table.get("rows"):
            doc.p(
                f"Validation stories drawn as for BLEU: their first tokens as the prompt, the rest of the story as "
                f"the ground truth, and one continuation per temperature of the same length (top-k {table['top_k']})."
            )
            doc.table(
                ["prompt", "ground truth", *table["temperatures"]],
                [(r["prompt"], r["ground_truth"], *(r[t] for t in table["temperatures"])) for r in table["rows"]],
            )
        doc.p(
            f"The preset's prompts: top-k {generations['top_k']}, top-p {generations['top_p']}, "
            f"at most {generations['max_new_tokens']} new tokens."
        )
        for s in generations["samples"]:
            doc.p(f"**T={s['temperature']}**, prompt `{s['prompt']}`")
            doc.code(s.get("text") or f"{s['prompt_as_tokenized']} {s['continuation']}".strip())
        return
    doc.lack("generations.json (example generations at several temperatures)")
    report.sample_blocks(doc, run_samples)  # the baseline's own samples, when it wrote them


def _section_decoding(doc: Doc, run: Path, dec):
    if not start_part_section(doc, "Decoding comparison", dec, "decoding", "the decoding comparison"):
        return
    doc.p(
        f"The same {dec['samples']} prompts; BLEU as above; tokens/s = new tokens / generation time, "
        f"torch threads: {dec.get('threads')}, one prompt at a time."
    )
    rows = [
        (*base, f"{s['speed_vs_sampling']:.2f}x" if "speed_vs_sampling" in s else "missing")
        for s, base in zip(dec["settings"], _bleu_rows(dec["settings"]))
    ]
    doc.table(["decoding", *BLEU_HEADERS, "speed vs sampling"], rows)
    _figure(doc, run, dec, "BLEU and decoding speed of each setting")
    files = ", ".join(f"`{s['csv']}`" for s in dec["settings"] if s.get("csv"))
    if files:
        doc.p(f"Per-sample CSVs (the BLEU protocol's columns): {files}")
    _decoding_examples(doc, dec)
    for s in dec["settings"]:
        if "missing" in s:
            doc.missing.append(f"decoding {s['name']}: {s['missing']}")


def _decoding_examples(doc: Doc, dec: dict) -> None:
    examples = dec.get("examples")
    if not examples:
        doc.lack("decoding.json has no example continuations (run the decoding part again to add them)")
        return
    names = [s["name"] for s in dec["settings"] if s["name"] in examples[0]]
    doc.p(
        f"The first {len(examples)} distinct prompts of these, each setting's continuation side by side (the same "
        "tokens the BLEU numbers above were computed on; its sentence BLEU-4 in brackets):"
    )
    doc.table(
        ["prompt", "real continuation", *names],
        [
            (e["prompt"], e["reference"], *(f"{e[n]['text']} ({e[n]['sentence_bleu4']:.3f})" for n in names))
            for e in examples
        ],
    )
    prompted = dec.get("prompt_examples")
    if prompted:
        doc.p(
            "The reports' own example prompts, continued by each setting (no reference story: these are read, "
            "not scored):"
        )
        doc.table(["prompt", *names], [(e["prompt"], *(e.get(n, "missing") for n in names)) for e in prompted])


def _section_kv(doc: Doc, kv):
    if not start_part_section(doc, "KV cache", kv, "kv_cache", "the KV-cache timing"):
        return
    doc.p(
        f"A batch of {kv.get('batch', 1)} prompts (the first tokens of validation stories) decoded together, "
        f"torch threads: {kv['threads']}, "
        + (
            "one timed run of each"
            if kv["repeats"] == 1
            else f"median of {kv['repeats']} alternated runs (cache, no cache, ...)"
        )
        + "; "
        f"context {kv['context_length']}; sampling is seeded per row. Cache memory: keys and values of every layer "
        "for the batch (float32); the cache never holds more than the context. Rows whose prompt + new tokens "
        f"pass the context of {kv['context_length']} decode with a sliding window (tinylm.generation): when the "
        f"cache is full it is emptied and re-filled with the last {kv['context_length'] // 2} tokens of each row "
        f"(positions restart at 0), while the uncached path reads the last {kv['context_length']} tokens at every "
        "step; the two therefore see different windows past the context, and their tokens may differ there."
    )
    doc.table(
        [
            "decoding",
            "batch x new tokens",
            "total tokens per row",
            "cache memory",
            "with cache tok/s",
            "without tok/s",
            "speed-up",
            "same tokens",
            "past the context",
        ],
        [
            (
                r.get("decoding", "greedy"),
                f"{r.get('batch', 1)} x {r['new_tokens']}",
                r.get("total_tokens", "missing"),
                _mib(r.get("cache_bytes")),
                f"{r['cache_tokens_per_s']:.0f}",
                f"{r['nocache_tokens_per_s']:.0f}",
                f"{r['speedup']:.2f}x",
                r["same_tokens"],
                "sliding window" if r["beyond_context"] else "no",
            )
            for r in kv["rows"]
        ],
    )


def _figure(doc: Doc, run: Path, part: dict, alt: str) -> None:
    if part.get("png") and (run / part["png"]).is_file():
        doc.img(part["png"], alt)
    elif part.get("png"):
        doc.lack(part["png"])


def _each(row) -> str:
    return ", ".join(f"{x:.1f}" for x in row.get("seconds_each", [row["seconds"]]))


def _tradeoff_start(part: dict) -> str:
    """Where a part's trade-off runs start, in a sentence."""
    start = part.get("start") or {}
    if start.get("val_loss") is None:
        return "Each run trains a fresh model."
    windows = f" in {part['context_length']}-token windows" if part.get("context_length") else ""
    return (
        f"Each run continues from the judged model's checkpoint (`{start['from']}`, validation loss "
        f"{start['val_loss']:.3f} nats, perplexity {math.exp(start['val_loss']):.2f}, on the whole validation "
        f"split{windows}), where the reports measured, at "
        f"{start['lr_scale']:g} of its learning rates on a cosine of its own, without the weight average."
    )


def _section_accum(doc: Doc, run: Path, acc):
    if not start_part_section(doc, "Gradient accumulation", acc, "accumulation", "the accumulation runs"):
        return
    rows = acc["rows"]
    r0 = rows[0] if rows else {}
    if "epochs" not in acc:  # a file without the two comparisons: equal micro-batches only
        doc.p(
            f"Each run trains a fresh model on the same {r0.get('micro_batches')} micro-batches of "
            f"{r0.get('micro_batch')} sequences; accumulation k makes {r0.get('micro_batches')}/k optimizer steps. "
            "Epoch time is projected from the measured time per micro-batch."
        )
    else:
        split = (
            f"the first {acc['train_stories']:,} of the {acc['all_train_stories']:,} training stories"
            if acc["train_stories"] < acc["all_train_stories"]
            else f"all {acc['train_stories']:,} training stories"
        )
        doc.p(
            f"{_tradeoff_start(acc)} Each run trains on {split}, in micro-batches of {r0.get('micro_batch')} rows, "
            f"in the trainer's seeded order (torch threads: {acc['threads']}; one run per setting). Two "
            f"comparisons: **equal tokens**, every k trains {acc['epochs']} epoch(s), so k makes k times fewer "
            "updates of a k times larger batch; **equal updates**, every k makes the updates the largest k makes "
            "in those epochs, so k sees k / largest of their tokens. The largest k's run belongs to both. Seconds "
            "per epoch are measured: the median over the run's epochs of the trainer's time between epoch ends. "
            "Activation memory is per micro-batch (bytes autograd saves), so accumulation does not change it. "
            "The reports compared at equal tokens: each trained every k on the same data and printed the time "
            "per epoch and the loss reached."
        )
    headers = [
        "comparison",
        "accumulation",
        "effective batch",
        "epochs",
        "updates",
        "final train loss",
        "epoch's mean train loss",
        "final valid loss",
        "seconds",
        "s / epoch (measured)",
        "tokens/s",
        "peak activation memory",
    ]
    table = []
    for r in rows:
        per_epoch = (
            f"{r['epoch_seconds']:.0f}"
            if r.get("epoch_seconds") is not None
            else f"{r['projected_epoch_seconds']:.0f} (projected)"
        )
        table.append(
            (
                r.get("comparison") or "equal micro-batches",
                r["accum_steps"],
                r["effective_batch"],
                f"{r['epochs']:g}" if r.get("epochs") else "-",
                r["optimizer_steps"],
                r["final_train_loss"],
                " / ".join(f"{x:.4f}" for x in r.get("epoch_train_losses") or []) or "-",
                r["final_val_loss"],
                f"{r['seconds']:.1f}",
                per_epoch,
                f"{r['tokens_per_s']:.0f}",
                _mib(r["peak_activation_bytes"]),
            )
        )
    doc.table(headers, table)
    _figure(doc, run, acc, "training loss of each accumulation setting at equal tokens and at equal updates")
    if acc.get("missing"):
        doc.lack(acc["missing"])


def _sign_test(above: int, rounds: int) -> float:
    """One-sided sign test: the chance of at least ``above`` of ``rounds`` fair coin flips landing
    heads, i.e. of a variant that costs nothing looking this slow by drift alone."""
    return sum(math.comb(rounds, k) for k in range(above, rounds + 1)) / 2**rounds


def _spread_sentence(rows: list[dict]) -> str:
    """Each variant's range of run times against plain's (the first row's), and its ratio to plain
    round by round: the runs of one round ran back to back, so their ratio cancels what drifts
    between rounds, and the count of rounds it lost is the paired test of a cost."""
    plain = rows[0]["seconds_each"]
    said = []
    for r in rows[1:]:
        each = r.get("seconds_each") or []
        if min(each) > max(plain) or max(each) < min(plain):
            where = "outside"
        elif min(each) >= min(plain) and max(each) <= max(plain):
            where = "inside"
        else:
            where = "overlapping"
        ratios = [x / y for x, y in zip(each, plain)]
        above = sum(ratio > 1 for ratio in ratios)
        said.append(
            f"{r.get('label') or r['name']}: {min(each):.1f}-{max(each):.1f} s, "
            f"{where} plain's range (round by round against plain: "
            f"{', '.join(f'{x:.2f}' for x in ratios)}; median {statistics.median(ratios):.2f}, slower in "
            f"{above} of {len(ratios)} rounds, one-sided sign test p = {_sign_test(above, len(ratios)):.3f})"
        )
    return f"Spread of the runs: plain {min(plain):.1f}-{max(plain):.1f} s; " + "; ".join(said) + "."


def _section_ckpt(doc: Doc, run: Path, ck):
    if not start_part_section(doc, "Gradient checkpointing", ck, "checkpointing", "the checkpointing runs"):
        return
    if ck.get("missing"):
        doc.lack(ck["missing"])
        doc.table(
            ["run", "peak activation memory"], [(r["name"], _mib(r["peak_activation_bytes"])) for r in ck["rows"]]
        )
        return
    cuda = any(r.get("cuda_peak_bytes") for r in ck["rows"])
    doc.p(
        f"{_tradeoff_start(ck)} "
        f"Plain training vs tinylm's checkpointing (our autograd.Function) vs `torch.utils.checkpoint`, every block "
        f"recomputed in backward, the same micro-batches, torch threads: {ck['threads']}, median of "
        f"{ck.get('repeats', 1)} runs each in alternated rounds. Memory: peak bytes autograd holds for backward in "
        "one micro-batch step"
        + (
            "; CUDA peak: `torch.cuda.max_memory_allocated` over the run."
            if cuda
            else " (no GPU here, so no CUDA peak memory column)."
        )
    )
    doc.table(
        [
            "run",
            "peak activation memory",
            "memory vs plain",
            *(["CUDA peak"] if cuda else []),
            "seconds",
            "each run (s)",
            "time vs plain",
            "tokens/s",
            "final train loss",
        ],
        [
            (
                r.get("label") or r["name"],
                _mib(r["peak_activation_bytes"]),
                f"{r['memory_ratio']:.2f}" if "memory_ratio" in r else "missing",
                *([_mib(r.get("cuda_peak_bytes"))] if cuda else []),
                f"{r['seconds']:.1f}",
                _each(r),
                f"{r['time_ratio']:.2f}",
                f"{r['tokens_per_s']:.0f}",
                r["final_train_loss"],
            )
            for r in ck["rows"]
        ],
    )
    if len(ck["rows"][0].get("seconds_each") or []) > 1:
        doc.p(_spread_sentence(ck["rows"]))
    _figure(doc, run, ck, "memory and time with and without gradient checkpointing")


def _section_embeddings(doc: Doc, run: Path, emb):
    if not start_part_section(
        doc, "Token embeddings: FastText vs random initialisation", emb, "embedding_init", "the embedding comparison"
    ):
        return
    model = f" ({emb['model']}, {emb['tokens_per_step']:,} tokens a step)" if emb.get("model") else ""
    doc.p(
        f"Each run trains a fresh model{model} for {emb['steps']} steps on the same batches; only the token "
        "embedding rows differ (FastText vectors kept frozen, FastText vectors fine-tuned, or the model's own "
        f"random initialisation). torch threads: {emb['threads']}."
    )
    for note in emb.get("notes", []):
        doc.p(f"**note:** {note}")
    doc.table(
        ["embeddings", "vectors", "coverage", "final train loss", "final valid loss", "valid ppl", "seconds"],
        [
            (
                r.get("label") or r["name"],
                r.get("vectors") or "-",
                "-" if r.get("coverage") is None else f"{r['coverage']:.1%}",
                r["final_train_loss"],
                r["final_val_loss"],
                f"{math.exp(min(r['final_val_loss'], 50)):.2f}",
                f"{r['seconds']:.1f}",
            )
            for r in emb["rows"]
        ],
    )
    _figure(doc, run, emb, "training loss of each embedding initialisation")


def _section_tokenizers(doc: Doc, tk):
    if not start_part_section(
        doc, "Out-of-vocabulary words: <unk> or BPE pieces", tk, "tokenizers", "the tokenizer comparison"
    ):
        return
    if tk.get("missing"):
        doc.lack(tk["missing"])
        return
    doc.p(
        f"The same word vocabulary, trained on the training stories; words outside it become `<unk>`, or are "
        f"spelled with character BPE pieces ({tk['oov_merges']} merges learned on the training words). On the "
        f"{tk['stories']:,} validation stories (this run trains with `tokenizer.oov={tk['configured']}`); 'stories "
        "restored': share of stories whose decoded tokens give back every word."
    )
    doc.table(
        ["out-of-vocabulary words", "vocabulary", "<unk> rate", "tokens per word", "stories restored"],
        [
            (
                "<unk>" if r["oov"] == "unk" else "BPE pieces",
                r["vocab_size"],
                f"{r['unk_rate']:.3%}",
                f"{r['tokens_per_word']:.3f}",
                f"{r['stories_restored']:.1%}",
            )
            for r in tk["rows"]
        ],
    )


def _section_reports(doc: Doc, parts: dict):
    doc.h("Beside the reports")
    doc.p(
        "The four TinyStories reports' published numbers (as printed; `tinylm/studies/data/tinystories_reports.yaml` "
        "says where each comes from) beside this run's. Their models trained for hours on GPUs, on more of "
        "TinyStories, with other vocabularies and sampling settings; this run's budget is in its training-time cell. "
        "Perplexities and BLEU are comparable only in kind (a different vocabulary changes both); speed-ups and "
        "memory ratios depend on hardware and batch size, so compare ratios, not absolute rates."
    )
    doc.table(*comparison_table(parts))


def _settings_cells(cfg: dict) -> list[str]:
    m, t, d = cfg["model"], cfg["train"], cfg["data"]
    width = f"d_model {m['d_model']}" + (f" (embeddings {m['d_embed']})" if m.get("d_embed") != m["d_model"] else "")
    blocks = f"{m['n_layers']} x {width}, {m['n_heads']} heads, d_ff {m['d_ff']}"
    parts = f"{m['positions']} positions, {m['norm']}, {m.get('ffn', 'gelu')}" + (
        ", QK-norm" if m.get("qk_norm") else ""
    )
    batching = f"{d['batching']}" + (", attention inside each story" if t.get("document_attention") else "")
    optimizer = t.get("optimizer", "adamw") + (f" (weight average {t['ema_decay']})" if t.get("ema_decay") else "")
    decay = f"cosine over the {'wall clock' if t.get('schedule_clock') == 'wall' else 'steps'}"
    rows = f"{t['batch_size']} x {m['context_length']}"
    return [blocks, parts, batching, rows, optimizer, f"{t['lr']}, {decay}", report.stop_rule(t)]


def _judged_sentence(run: Path, column_dir: str) -> str:
    """Which model the quality sections below judged, read from their files."""
    parts = {name: report.read_json(run / f"{name}.json") for name in QUALITY_PARTS}
    judged = [name for name, part in parts.items() if part and part.get("judged") == column_dir]
    if len(judged) == len(parts):
        return f"The quality sections below judge the tinylm-settings model ({column_dir}/)."
    other = [name for name, part in parts.items() if part and name not in judged]
    missing = " (the others have not run)" if len(judged) + len(other) < len(parts) else ""
    return (
        f"Parts that judged the tinylm-settings model ({column_dir}/): {', '.join(judged) or 'none'}; "
        f"the report-settings model: {', '.join(other) or 'none'}{missing}."
    )


def _section_columns(doc: Doc, run: Path, column) -> None:
    """The report-settings model beside the tinylm-settings one: same data, same tokenizer."""
    if not column or column.get("off"):
        return
    if not start_part_section(
        doc, "Report settings and tinylm settings", column, "tinylm_settings", "the second column"
    ):
        return
    side = run / column["run_dir"]
    configs = [report.read_yaml(d / "config.yaml") for d in (run, side)]
    evals = [report.read_json(d / "eval.json") for d in (run, side)]
    if not all(configs) or not all(evals):
        doc.lack("config.yaml and eval.json of both columns")
        return
    names = ["layers and width", "architecture", "batching", "rows x tokens", "optimizer", "learning rate", "stop"]
    rows = [(n, a, b) for n, a, b in zip(names, *(_settings_cells(c) for c in configs))]
    for label, key, fmt in (
        ("parameters", "parameters", "{:,}"),
        ("optimizer steps", "steps", "{:,}"),
        ("training seconds", "train_seconds", "{:.0f}"),
        ("tokens/s", "tokens_per_s", "{:,.0f}"),
    ):
        rows.append((label, *(fmt.format(e[key]) for e in evals)))
    for label, key, fmt in (
        ("valid perplexity per word token", "token_ppl", "{:.2f}"),
        ("bits per byte", "bpb", "{:.4f}"),
    ):
        rows.append((label, *(fmt.format(e["eval"]["valid"][key]) for e in evals)))
    doc.p(
        "The same stories, the same cleaning and the same word vocabulary in both columns, so their "
        "perplexities compare; each column's model is scored story by story from `<sos>` on the validation "
        "split. " + _judged_sentence(run, column["run_dir"])
    )
    doc.table(["", "report settings", "tinylm settings"], rows)
    report.sample_blocks(doc, report.read_json(side / "samples.json"))


def _section_attention(doc: Doc, run: Path, att):
    if not start_part_section(doc, "Attention maps", att, "attention", "the attention maps"):
        return
    for t in att["texts"]:
        if "missing" in t:
            doc.lack(f"attention map for `{t['text']}`: {t['missing']}")
            continue
        doc.p(
            f"`{t['text']}`: {t['layers']} layers x {t['heads']} heads; rows sum to 1 within "
            f"{t['max_row_sum_error']:.1e}, largest weight above the diagonal {t['max_weight_above_diagonal']:.1e}. "
            f"Browse every layer and head: [{t['html']}]({t['html']})"
        )
        if t.get("clearest_heads"):
            found = "; ".join(
                f"layer {h['layer']} head {h['head']} puts {h['weight']:.2f} of its weight on {h['pattern']}"
                for h in t["clearest_heads"]
            )
            doc.p(f"Measured on these weights (mean over the queries from the third token on): {found}.")
        for png in t["pngs"]:
            if (run / png).is_file():
                doc.img(png, png)
            else:
                doc.lack(f"{png}")


def _section_machine(doc: Doc, machine):
    doc.h("Machine")
    if machine and not machine.get("error"):
        threads = (
            f"{machine.get('train_threads', machine['torch_threads'])} / "
            f"{machine.get('decode_threads', machine['torch_threads'])}"
        )
        doc.table(
            ["machine", "value"],
            [
                ("CPU", machine["cpu"]),
                ("cores", machine["cpu_count"]),
                ("torch threads (training / decoding)", threads),
                ("CUDA", machine["cuda"] or "no"),
                ("platform", machine["platform"]),
                ("Python / torch", f"{machine['python']} / {machine['torch']}"),
                ("load average (1 min) at the end", str(machine.get("load_average_1m"))),
                ("date", machine["date_utc"]),
            ],
        )
    else:
        doc.p(f"(no machine.json; the machine writing this report:) {report.this_machine()}")


def build_report(run_dir: str | Path) -> Doc:
    run = report.open_run(run_dir, (*report.RUN_FILES, "experiments.json"))
    read = lambda name: report.read_json(run / name)  # noqa: E731
    ev, manifest = read("eval.json"), read("experiments.json") or {}
    doc = Doc()
    safely(doc, report.section_config, run, ev, read("baseline.json"), read("prepare.json"))
    parts = {
        name: read(f"{name}.json")
        for name in ("eval", "machine", "bleu", "decoding", "kv_cache", "accumulation", "checkpointing")
    }
    column = read("tinylm_settings.json") or {}
    if column.get("run_dir"):
        parts["tinylm_settings_eval"] = report.read_json(run / column["run_dir"] / "eval.json")
    safely(doc, _section_reports, {k: v for k, v in parts.items() if isinstance(v, dict) and not v.get("error")})
    safely(doc, report.section_training, run, ev, want_curves=True)
    safely(doc, report.section_eval, ev)
    safely(doc, _section_columns, run, read("tinylm_settings.json"))
    safely(doc, _section_bleu, run, read("bleu.json"), ev)
    safely(doc, _section_generations, read("generations.json"), read("samples.json"))
    safely(doc, _section_decoding, run, read("decoding.json"))
    safely(doc, section_fluency, run, read("fluency.json"))
    safely(doc, section_protocols, run, read("protocols.json"))
    safely(doc, _section_kv, read("kv_cache.json"))
    safely(doc, _section_accum, run, read("accumulation.json"))
    safely(doc, _section_ckpt, run, read("checkpointing.json"))
    safely(doc, _section_embeddings, run, read("embedding_init.json"))
    safely(doc, _section_tokenizers, read("tokenizers.json"))
    safely(doc, _section_attention, run, read("attention.json"))
    safely(doc, _section_machine, read("machine.json"))
    for part, status in (manifest.get("parts") or {}).items():
        if status == "stale":  # left alone by --only although its settings changed
            doc.missing.append(f"{part}.json is stale (computed with other settings; re-run without --only)")
    intro = (
        (
            f"Produced by `{manifest['command']}`{' (quick)' if manifest.get('quick') else ''}; every number below "
            "is read from the files in this directory."
        )
        if manifest.get("command")
        else None
    )
    return report.with_head(doc, f"tinylm experiments: {run.name}", intro)


def write_experiments_report(run_dir: str | Path) -> tuple[Path, Path, list[str]]:
    """Write report.md and report.html of an experiments run; returns both paths and what the report lacks."""
    return report.save_report(build_report(run_dir), Path(run_dir))
