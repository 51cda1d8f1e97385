"""tinylm's numbers beside the ones the four TinyStories reports published (`tinylm experiments`).

The reports' values live in ``tinylm/studies/data/tinystories_reports.yaml``, each as printed and
cited by the report's title; this module reads them and the run's part files and lays both out
in one table, a column per source, a row per quantity. Cells are text: the reports print their
numbers in many forms ("38 min/epoch", "3.48x"), and they are shown as printed.
"""

from __future__ import annotations

from functools import partial
from importlib import resources

import yaml

from tinylm.evaluation.report import format_number

REPORTS_FILE = "studies/data/tinystories_reports.yaml"


def published() -> list[dict]:
    """The reports' entries (title, hardware, bleu, kv_cache, ...), in file order."""
    return yaml.safe_load((resources.files("tinylm") / REPORTS_FILE).read_text(encoding="utf-8"))["reports"]


_num = partial(format_number, digits=None, missing="-")  # a published value as printed ("-": not given)
# the rows of the table, each a quantity both tinylm and the reports give
QUANTITIES = (
    "hardware",
    "training time",
    "validation perplexity",
    "BLEU-1 / 2 / 3 / 4",
    "decoding comparison",
    "KV cache",
    "gradient accumulation",
    "gradient checkpointing",
)


def _join(parts) -> str:
    parts = [p for p in parts if p]
    return "; ".join(parts) if parts else "-"


def _bleu_cell(b: dict) -> str:
    if b.get("bleu4") is not None:
        scores = " / ".join(_num(b.get(f"bleu{n}")) for n in (1, 2, 3, 4))
        return f"{b['setting']}: {scores}"
    return f"{b['setting']}: BLEU {_num(b.get('bleu'))} (order not stated)" if b.get("bleu") is not None else ""


def _budget(r: dict) -> str:
    """What the report trained for, as printed: time, steps, epochs, batch."""
    tr, printed = r.get("training") or {}, r.get("training_time") or ""
    return _join(
        [
            printed,
            f"{tr['steps']:,} steps" if tr.get("steps") and "steps" not in printed else "",
            f"{tr['epochs']} epochs" if tr.get("epochs") and "epoch" not in printed else "",
            f"batch {tr['batch_size']}" if tr.get("batch_size") else "",
        ]
    )


def _report_column(r: dict) -> dict[str, str]:
    vp, ev = r.get("validation_perplexity") or {}, r.get("eval_perplexity") or {}
    per_epoch = vp.get("per_epoch") or []
    ppl = _join(
        [
            f"final {_num(vp.get('final'))}" if vp.get("final") is not None else "",
            f"epoch {len(per_epoch)} (last of its epoch table) {_num(per_epoch[-1])}" if per_epoch else "",
            f"best {_num(vp.get('best'))}" if vp.get("best") is not None else "",
            f"on the 50 BLEU samples {_num(ev.get('value'))}" if ev.get("value") is not None else "",
        ]
    )
    if ppl != "-":
        ppl += f" (after: {_budget(r)})"
    dec = (r.get("decoding_comparison") or {}).get("rows") or []
    dec_cell = _join(
        f"{d['setting']}: BLEU{'-4' if d.get('bleu4') is not None else ''} "
        f"{_num(d.get('bleu4', d.get('bleu')))}, {_num(d.get('tokens_per_s'))} tok/s"
        for d in dec
    )
    kv = r.get("kv_cache") or {}
    kv_cell = _join(
        [
            str(kv.get("speedup")) if kv.get("speedup") else "",
            f"batch {kv['batch']}" if kv.get("batch") else "",
            f"{_num(kv.get('without_cache', {}).get('tokens_per_s'))} -> "
            f"{_num(kv.get('with_cache', {}).get('tokens_per_s'))} tok/s"
            if kv.get("with_cache")
            else "",
        ]
    )
    acc = (r.get("grad_accumulation") or {}).get("rows") or []
    acc_cell = _join(
        f"k={a['accum_steps']}: loss {_num(a.get('final_loss'))}, "
        f"{a.get('time') or _num(a.get('time_per_epoch_s')) + ' s/epoch'}"
        for a in acc
    )
    ck = r.get("grad_checkpointing") or {}
    mem = [ck.get(k) for k in ("memory_without", "memory_with")]
    if mem[0] is None and ck.get("memory_without_mib") is not None:
        mem = [f"{ck['memory_without_mib']} MiB", f"{ck['memory_with_mib']} MiB"]
    if mem[0] is None and ck.get("memory_without_gb") is not None:
        mem = [f"{ck['memory_without_gb']} GB", f"{ck['memory_with_gb']} GB"]
    time = [ck.get(f"time_{w}") or _num(ck.get(f"time_{w}_s")) + " s" for w in ("without", "with")]
    ck_cell = _join([f"memory {mem[0]} -> {mem[1]}" if mem[0] else "", f"time {time[0]} -> {time[1]}" if ck else ""])
    bleu_cell = _join(_bleu_cell(b) for b in r.get("bleu") or [])
    hardware, train_time = r.get("hardware") or "-", r.get("training_time") or "-"
    return dict(zip(QUANTITIES, (hardware, train_time, ppl, bleu_cell, dec_cell, kv_cell, acc_cell, ck_cell)))


JUDGED = ("BLEU-1 / 2 / 3 / 4", "decoding comparison", "KV cache")  # cells of the model the quality parts judge


def _ours(parts: dict, ev: dict | None, judged: bool = True) -> dict[str, str]:
    """tinylm's column for the run whose eval.json is ``ev``; ``judged``: the quality parts judged its model."""
    ev, machine = ev or {}, parts.get("machine") or {}
    valid = (ev.get("eval") or {}).get("valid") or {}
    gpu = machine.get("cuda") or "no GPU"
    hardware = f"{machine.get('cpu')}, {machine.get('train_threads')} torch threads, {gpu}" if machine else "-"
    train_time = f"{ev.get('train_seconds', 0) / 60:.1f} min, {ev.get('steps')} steps" if ev else "-"
    if ev.get("tokens_per_s") and ev.get("train_seconds"):
        train_time += f", {ev['tokens_per_s'] * ev['train_seconds'] / 1e6:.2f}M training positions"
    bleu = parts.get("bleu") or {}
    bleu_cell = _join(
        f"{s['name']}: {s['bleu1']:.3f} / {s['bleu2']:.3f} / {s['bleu3']:.3f} / {s['bleu4']:.3f}"
        + (f" (sentence-averaged BLEU-4 {s['sentence_bleu']['bleu4']:.4f})" if "sentence_bleu" in s else "")
        for s in bleu.get("settings", [])
        if "bleu4" in s
    )
    dec = parts.get("decoding") or {}
    dec_cell = _join(
        f"{s['name']}: BLEU-4 {s['bleu4']:.3f}, {s['tokens_per_s']:.0f} tok/s"
        for s in dec.get("settings", [])
        if "bleu4" in s
    )
    kv = parts.get("kv_cache") or {}
    kv_cell = _join(
        f"{r.get('decoding', 'greedy')}, batch {r.get('batch', 1)} x {r['new_tokens']}: {r['speedup']:.2f}x"
        for r in kv.get("rows", [])
    )
    acc = parts.get("accumulation") or {}
    acc_cell = _join(
        f"k={r['accum_steps']} ({r.get('comparison') or 'equal micro-batches'}): valid loss "
        f"{r['final_val_loss']:.3f}, {r['seconds']:.0f} s"
        for r in acc.get("rows", [])
    )
    if (acc.get("start") or {}).get("val_loss") is not None:
        acc_cell += f" (continued from valid loss {acc['start']['val_loss']:.3f})"
    ck = parts.get("checkpointing") or {}
    ck_cell = _join(
        f"{r.get('label') or r['name']}: memory x{r['memory_ratio']:.2f}, time x{r['time_ratio']:.2f}"
        for r in ck.get("rows", [])[1:]
        if "memory_ratio" in r
    )
    ppl = f"{valid['token_ppl']:.2f} (every validation story)" if valid.get("token_ppl") else "-"
    if judged and bleu.get("reference_ppl"):
        ppl += f"; on the BLEU samples' continuations {bleu['reference_ppl']:.2f}"
    if ppl != "-":
        ppl += f" (after: {train_time})"
    cells = dict(zip(QUANTITIES, (hardware, train_time, ppl, bleu_cell, dec_cell, kv_cell, acc_cell, ck_cell)))
    return {q: cell if judged or q not in JUDGED else "-" for q, cell in cells.items()}


def comparison_table(parts: dict) -> tuple[list[str], list[tuple]]:
    """(headers, rows): a row per quantity, tinylm's column first, then one per report."""
    reports = published()
    column = parts.get("tinylm_settings_eval")
    ours = [_ours(parts, parts.get("eval"), judged=not column)]
    headers = ["", "tinylm, report settings" if column else "tinylm (this run)"]
    if column:  # its own training, the quality parts and the trade-off runs continued from its model
        tradeoffs = {q for q in QUANTITIES if q.startswith("gradient")}
        continued = (parts.get("accumulation") or {}).get("start", {}).get("val_loss") is not None
        own, judged = ours[0], _ours(parts, column)
        ours = [{q: "-" if continued and q in tradeoffs else c for q, c in own.items()}]
        ours.append({q: "-" if not continued and q in tradeoffs else c for q, c in judged.items()})
        headers.append("tinylm settings")
    columns = ours + [_report_column(r) for r in reports]
    headers += [f'"{r["title"]}"' for r in reports]
    return headers, [(q, *(c[q] for c in columns)) for q in QUANTITIES]
