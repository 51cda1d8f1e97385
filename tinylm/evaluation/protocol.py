"""The TinyStories BLEU protocol: prompt with the first P tokens of N held-out stories, let the
model continue, compare with each story's real continuation.

    stories           N drawn at random with the protocol's seed (as the reports did), or the
                      first N in file order (``selection="first"``)
    prompt            the first ``prompt_tokens`` tokens of the story (after ``<sos>``)
    reference         the rest of the story, as far as it fits in the context after the prompt
                      (or at most ``max_continuation`` tokens when that cap is set)
    hypothesis        the model's continuation, ``len(reference)`` new tokens at most (stops early
                      at ``<eos>``), one seed per sample
    per_sample_ppl    exp(mean NLL) of the *reference* continuation under the model given the
                      prompt: how likely the model finds the real story, not its own sample
    sentence_bleu4    BLEU-4 of that one sample (NLTK's sentence_bleu, the protocol's smoothing);
                      their mean is the "average BLEU over N samples" some reports published,
                      given beside corpus BLEU as ``sentence_bleu``

Stories of at most ``prompt_tokens`` tokens have nothing to continue: they are skipped and
counted. When fewer usable stories exist than asked for, all of them are used and the result says so.
"""

from __future__ import annotations

import csv
import dataclasses
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tabulate import tabulate

from tinylm.config import BleuSelection, BleuSmoothing, GenerationConfig, check_fields, option
from tinylm.constants import IGNORE_INDEX, PAD_ID
from tinylm.data.tokens import pad_rows
from tinylm.errors import TinyLMError
from tinylm.evaluation.bleu import BLEU_MEANING, BLEU_TOKEN_PATTERN, corpus_bleu_n, sacrebleu_score, sentence_bleu_n
from tinylm.generation.generate import generate_many
from tinylm.models.gpt import eval_mode

log = logging.getLogger(__name__)

CSV_COLUMNS = ["prompt", "reference_continuation", "hypothesis_continuation", "per_sample_ppl", "sentence_bleu4"]
SAMPLING_TEMPERATURES = (0.7, 1.0, 1.2)  # the reports' temperature sweep


@dataclass
class BleuProtocol:
    n_samples: int = option(50, ge=1)
    prompt_tokens: int = option(5, ge=1)
    max_continuation: int | None = option(None, "None: the rest of the story (what fits in the context)", ge=1)
    seed: int = 0
    smoothing: BleuSmoothing = "method1"
    selection: BleuSelection = "random"  # random: N stories drawn with `seed`


@dataclass
class Decoding:
    """One decoding setting. ``beam_width`` > 1 means beam search (deterministic)."""

    name: str
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    beam_width: int = 1
    no_repeat_ngram_size: int = 0  # n-gram blocking (0: off), the usual remedy for beam search's loops
    use_cache: bool = True  # False: every step runs the whole sequence (a model without a KV cache)

    def generation(self, max_new_tokens: int, seed: int | None, stop_ids: tuple[int, ...]) -> GenerationConfig:
        """This setting as generation knobs."""
        knobs = dict(beam_width=self.beam_width) if self.beam_width > 1 else dict(temperature=self.temperature)
        if self.beam_width == 1:
            knobs.update(top_k=self.top_k, top_p=self.top_p, seed=seed)
        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            no_repeat_ngram_size=self.no_repeat_ngram_size,
            stop_ids=stop_ids,
            use_cache=self.use_cache,
            **knobs,
        )


@dataclass
class Sample:
    index: int  # position of the story in the evaluated file
    prompt_ids: list[int]
    reference_ids: list[int]


@dataclass
class SampleSet:
    samples: list[Sample]
    requested: int
    available: int  # stories in the file
    skipped_too_short: int  # stories with no token after the prompt
    cut_to_context: int = 0  # references shortened to what fits in the context after the prompt
    notes: list[str] = field(default_factory=list)


def select_samples(tokenizer, texts: list[str], protocol: BleuProtocol, context_length: int) -> SampleSet:
    """``n_samples`` stories long enough to have a continuation: drawn in a seeded random order, or
    the first ones in file order."""
    P = check_fields(protocol, "BLEU protocol ").prompt_tokens
    room = context_length - 1 - P  # <sos> + prompt + continuation must fit in the context
    if room < 1:
        raise TinyLMError(f"a prompt of {P} tokens leaves no room for a continuation in a context of {context_length}")
    cap = room if protocol.max_continuation is None else min(protocol.max_continuation, room)
    order = list(range(len(texts)))
    if protocol.selection == "random":
        random.Random(protocol.seed).shuffle(order)
    samples, skipped, cut = [], 0, 0
    for i in order:
        if len(samples) == protocol.n_samples:
            break
        ids = tokenizer.encode(texts[i])
        if len(ids) <= P:
            skipped += 1
            continue
        cut += protocol.max_continuation is None and len(ids) - P > room
        samples.append(Sample(i, ids[:P], ids[P : P + cap]))
    notes = []
    if skipped:
        notes.append(f"skipped {skipped} stories of at most {P} tokens (prompt length >= story length)")
    if cut:
        notes.append(
            f"{cut} of {len(samples)} references are longer than the context leaves after the prompt; "
            f"they are cut to {room} tokens"
        )
    if len(samples) < protocol.n_samples:
        notes.append(
            f"asked for {protocol.n_samples} samples, only {len(samples)} usable stories exist; using them all"
        )
    if not samples:
        raise TinyLMError(f"no story in the evaluation text is longer than the {P}-token prompt")
    return SampleSet(samples, protocol.n_samples, len(texts), skipped, cut, notes)


@torch.no_grad()
def reference_nll(model, samples: list[Sample], bos_id: int | None, batch_size: int = 32) -> list[tuple[float, int]]:
    """(sum of NLL in nats, number of tokens) of each reference continuation given the start token + prompt."""
    device = next(model.parameters()).device
    with eval_mode(model):
        out: list[tuple[float, int]] = []
        start_ids = [] if bos_id is None else [bos_id]
        for b in range(0, len(samples), batch_size):
            chunk = samples[b : b + batch_size]
            seqs = [[*start_ids, *s.prompt_ids, *s.reference_ids] for s in chunk]
            x = pad_rows([q[:-1] for q in seqs], PAD_ID)
            # only the continuation is scored: the start token and prompt are context
            y = pad_rows(
                [[IGNORE_INDEX] * (len(q) - 1 - len(s.reference_ids)) + s.reference_ids for q, s in zip(seqs, chunk)],
                IGNORE_INDEX,
            )
            _, nll = model(x.to(device), y.to(device), loss_reduction="none")
            nll = nll.view(x.shape).cpu()
            out += [(float(nll[r].sum()), len(s.reference_ids)) for r, s in enumerate(chunk)]
    return out


def continue_sample(
    model,
    sample: Sample,
    setting: Decoding,
    max_new_tokens: int,
    seed: int,
    bos_id: int | None,
    stop_ids: tuple[int, ...],
) -> list[int]:
    prompt = ([] if bos_id is None else [bos_id]) + sample.prompt_ids
    try:  # the row's own seeded stream: what `tinylm generate`, the server and a batch of samples draw
        cfg = dataclasses.replace(setting.generation(max_new_tokens, seed, stop_ids), seed_per_row=True)
        return generate_many(model, [prompt], cfg)[0].tokens
    except TinyLMError as exc:  # a bad knob (temperature < 0, top_p outside (0, 1], ...) names itself
        raise TinyLMError(f"decoding setting {setting.name}: {exc}") from exc


def decode_all(model, sample_set: SampleSet, settings: list[Decoding], seed: int, **ids):
    """Every sample's continuation under every setting, and the wall time each setting spent.

    The settings take turns sample by sample (A B C, A B C, ...), so load from other jobs on a
    shared machine hits them alike and their tokens/s compare fairly; one short untimed
    generation per setting first pays one-time costs."""
    outs = {st.name: [] for st in settings}
    seconds = {st.name: 0.0 for st in settings}
    for st in settings:
        continue_sample(model, sample_set.samples[0], st, 2, seed, **ids)
    for k, s in enumerate(sample_set.samples):
        for st in settings:
            t0 = time.perf_counter()
            new = continue_sample(model, s, st, len(s.reference_ids), seed + k, **ids)
            seconds[st.name] += time.perf_counter() - t0
            outs[st.name].append(new[: len(s.reference_ids)])
    return outs, seconds


def run_bleu(
    model,
    tokenizer,
    texts: list[str],
    protocol: BleuProtocol,
    settings: list[Decoding],
    csv_dir: str | Path | None = None,
    csv_prefix: str = "bleu_samples_",
) -> dict:
    """BLEU (sacrebleu, corpus and sentence-averaged BLEU-1..4), speed and per-sample CSVs
    (``<csv_prefix><setting>.csv``) for each decoding setting.

    Prompts start with the tokenizer's start id and decoding stops at its stop ids (tinylm: <sos>,
    <eos>; llama2.c: BOS=1, stops at 1 and 2)."""
    bos_id, stop_ids = tokenizer.bos_id, tuple(tokenizer.stop_ids)
    names = [st.name for st in settings]
    if len(set(names)) != len(names):
        raise TinyLMError(f"decoding settings must be different (got {', '.join(names)})")
    sample_set = select_samples(tokenizer, texts, protocol, model.config.context_length)
    for note in sample_set.notes:
        log.info(f"bleu: {note}")
    nll = reference_nll(model, sample_set.samples, bos_id)
    ppls = [math.exp(s / n) for s, n in nll]
    total_nll, total_tokens = sum(s for s, _ in nll), sum(n for _, n in nll)
    prompts = [tokenizer.decode(s.prompt_ids) for s in sample_set.samples]
    references = [tokenizer.decode(s.reference_ids) for s in sample_set.samples]
    result = {
        "protocol": asdict(protocol),
        "samples": len(sample_set.samples),
        "requested": sample_set.requested,
        "available_stories": sample_set.available,
        "skipped_too_short": sample_set.skipped_too_short,
        "cut_to_context": sample_set.cut_to_context,
        "notes": sample_set.notes,
        "reference_ppl": math.exp(total_nll / total_tokens),
        "reference_tokens": total_tokens,
        "mean_per_sample_ppl": sum(ppls) / len(ppls),
        "bleu_tokenization": f"lowercased, regex {BLEU_TOKEN_PATTERN}",
        "meaning": BLEU_MEANING,
        "settings": [],
    }
    csv_dir = Path(csv_dir) if csv_dir is not None else None
    all_outs, all_seconds = decode_all(model, sample_set, settings, protocol.seed, bos_id=bos_id, stop_ids=stop_ids)
    for setting in settings:
        outs, seconds = all_outs[setting.name], all_seconds[setting.name]
        hyps = [tokenizer.decode(o) for o in outs]
        n_new = sum(len(o) for o in outs)
        per_sample = [sentence_bleu_n(h, r, protocol.smoothing) for h, r in zip(hyps, references)]
        row = {
            **asdict(setting),
            **corpus_bleu_n(hyps, references, protocol.smoothing),
            "sentence_bleu": {k: sum(b[k] for b in per_sample) / len(per_sample) for k in per_sample[0]},
            "sacrebleu": sacrebleu_score(hyps, references),
            "new_tokens": n_new,
            "seconds": seconds,
            "tokens_per_s": n_new / max(seconds, 1e-9),
        }
        if csv_dir is not None:
            csv_dir.mkdir(parents=True, exist_ok=True)
            path = csv_dir / f"{csv_prefix}{setting.name}.csv"
            write_samples_csv(path, prompts, references, hyps, ppls, [b["bleu4"] for b in per_sample])
            row["csv"] = path.name
        result["settings"].append(row)
        log.info(
            f"bleu: {setting.name}: BLEU-4 {row['bleu4']:.4f}, sacreBLEU {row['sacrebleu']['bleu']:.2f}, "
            f"{row['tokens_per_s']:.0f} tokens/s"
        )
    return result


def write_samples_csv(path: Path, prompts, references, hypotheses, ppls, bleu4s) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(CSV_COLUMNS)
        w.writerows(
            [p, r, h, f"{ppl:.6g}", f"{b:.6g}"]
            for p, r, h, ppl, b in zip(prompts, references, hypotheses, ppls, bleu4s)
        )


def format_bleu(result: dict) -> str:
    """The protocol, its notes and one row per decoding setting, as text for a terminal."""
    p = result["protocol"]
    lines = [
        f"BLEU protocol    {result['samples']} stories (asked {result['requested']}), prompt = first "
        f"{p['prompt_tokens']} tokens, continuation <= {p['max_continuation']} tokens, seed {p['seed']}"
    ]
    lines += [f"note             {note}" for note in result["notes"]]
    lines += [
        f"reference ppl    {result['reference_ppl']:.4f}   (exp mean NLL of the real continuations given "
        f"their prompts, {result['reference_tokens']:,} tokens)",
        BLEU_MEANING,
        f"BLEU-n: NLTK-style corpus BLEU, smoothing {p['smoothing']}; sentence BLEU-4: the mean of the "
        "samples' own BLEU-4 (same smoothing); sacreBLEU: 0-100 with the signature below",
    ]
    rows = []
    for s in result["settings"]:
        if "missing" in s:
            rows.append([s["name"], f"missing: {s['missing']}"])
            continue
        scores = [s[f"bleu{n}"] for n in (1, 2, 3, 4)] + [s["sentence_bleu"]["bleu4"], s["sacrebleu"]["bleu"]]
        rows.append([s["name"], *scores, s["tokens_per_s"], s.get("csv", "")])
    lines.append(
        tabulate(
            rows,
            ["setting", "BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "sentence BLEU-4", "sacreBLEU", "tok/s", "csv"],
            floatfmt=("", ".4f", ".4f", ".4f", ".4f", ".4f", ".2f", ".0f", ""),
        )
    )
    sig = next((s["sacrebleu"]["signature"] for s in result["settings"] if "sacrebleu" in s), None)
    if sig:
        lines.append(f"sacreBLEU signature: {sig}")
    return "\n".join(lines)
