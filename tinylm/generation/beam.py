"""Beam search over a batch of prompts, driving the decoding core (``generation.batch.Batch``):
its rows are the beams, reordered and duplicated by beam each step.

The rules follow Hugging Face's beam search so that outputs can be compared token for token:

* each prompt keeps ``k`` running beams; beam 0 starts at score 0, the others at -1e9 so the
  first step does not pick the same token k times;
* a step adds each beam's next-token log probabilities to its score and takes the best ``2k``
  (beam, token) candidates of the prompt; a candidate that ends (stop token, or the last
  allowed step) becomes a finished hypothesis only if it ranks in the first ``k``; the best
  ``k`` candidates that do not end continue;
* a finished hypothesis scores ``sum log p / generated_length ** length_penalty`` (the
  generated length counts the stop token); ``length_penalty=0`` means no normalisation, > 0
  favours longer outputs; the best ``k`` are kept;
* a prompt is done when it holds ``k`` finished hypotheses and no running beam can beat the
  worst of them (best running score / current length ** length_penalty), or, with
  ``early_stopping=True``, as soon as it holds ``k``.

Returned per prompt: ``num_return_sequences`` ``Generated`` records, best first, tokens without
the stop token. History rules (repetition penalty, n-gram ban, min_new_tokens) apply to the log
probabilities; temperature, top-k, top-p and min-p do not apply (beam search does not sample).
"""

from __future__ import annotations

import torch

from tinylm.config import GenerationConfig
from tinylm.generation.batch import Batch, Row
from tinylm.generation.core import Generated, fit_prompts, model_device
from tinylm.generation.processors import HistoryProcessor
from tinylm.models.gpt import eval_mode

START_PENALTY = -1e9  # initial score of beams 1..k-1 (HF's value)


class _Prompt:
    """Beam bookkeeping for one prompt: running beams and the best finished hypotheses."""

    def __init__(self, k: int):
        self.k = k
        self.finished: list[tuple[float, list[int], str]] = []  # (score, tokens, reason), best first
        self.done = False

    def add_finished(self, score: float, tokens: list[int], reason: str) -> None:
        self.finished.append((score, tokens, reason))
        self.finished.sort(key=lambda h: -h[0])  # stable: an earlier equal score stays ahead
        del self.finished[self.k :]


def beam_search(model, prompts, cfg: GenerationConfig, between_steps=None) -> list[list[Generated]]:
    """``between_steps()`` is called before each step's forward: a server's other clients get a
    turn on the model there (``Scheduler.give_turn``), so a long beam does not stop their streams."""
    cfg.validate(model.config.vocab_size)
    if cfg.stop_strings:
        raise ValueError("stop_strings are not supported with beam_width > 1 (use stop token ids)")
    with eval_mode(model), torch.inference_mode():
        return _beam_search(model, fit_prompts(prompts, model.config.context_length), cfg, between_steps)


def _beam_search(model, prompts: list[list[int]], cfg: GenerationConfig, between_steps) -> list[list[Generated]]:
    device = model_device(model)
    k, B, V = cfg.beam_width, len(prompts), model.config.vocab_size
    if cfg.max_new_tokens == 0:
        return [[Generated([], "length", 0.0)] for _ in prompts]
    stop_set = set(cfg.stop_ids)
    stop_ids = torch.tensor(sorted(stop_set), device=device) if stop_set else None
    states = [_Prompt(k) for _ in prompts]
    # beam rows are prompt-major: row b * k + j is beam j of prompt b
    generated = torch.zeros(B * k, cfg.max_new_tokens, dtype=torch.long, device=device)  # tokens per row
    scores = torch.full((B, k), START_PENALTY, device=device)
    scores[:, 0] = 0.0
    first_row = torch.arange(0, B * k, k, device=device)[:, None]  # (B, 1)
    history = HistoryProcessor(cfg, [p for p in prompts for _ in range(k)], V, device)
    history = history if history.active else None
    # enough candidates that k of them survive even if every stop id is chosen by every beam
    n_candidates = min(max(2, 1 + len(stop_set)) * k, k * V)
    batch, logits = _start_beams(model, prompts, cfg)
    shared_slots = batch.cache.length if batch.cache is not None else 0  # slots equal in a prompt's beams

    for step in range(cfg.max_new_tokens):
        last_step = step == cfg.max_new_tokens - 1
        norm = (step + 1) ** cfg.length_penalty  # generated length so far, including this step's token
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        if history is not None:
            log_probs = history(log_probs, step)
        # one top-k over every beam of a prompt: (B, k V) -> the best candidates, sorted
        totals = (log_probs.view(B, k, V) + scores[:, :, None]).view(B, k * V)
        top_scores, top_index = torch.topk(totals, n_candidates, dim=-1)
        beams = top_index // V
        tokens = top_index - beams * V
        rows = beams + first_row  # (B, n_candidates): the beam row each candidate extends
        if last_step:
            ends = torch.ones_like(tokens, dtype=torch.bool)
        else:
            ends = torch.isin(tokens, stop_ids) if stop_ids is not None else None
        if ends is not None and bool(ends[:, :k].any()):  # the only per-candidate Python: hypotheses ending
            _add_finished(states, cfg, step, norm, generated, top_scores, rows, tokens, ends, stop_set)
        if last_step:
            break
        scores, rows, tokens = _running(top_scores, rows, tokens, ends, k)  # (B, k) each
        if _update_done(states, cfg, scores[:, 0], norm):
            break

        rows, tokens = rows.reshape(-1), tokens.reshape(-1)
        common = _common_prefix(generated, step, B, k) if shared_slots else 0  # before the reorder
        generated = generated.index_select(0, rows)
        generated[:, step] = tokens
        if history is not None:
            history.reorder(rows.tolist())
            history.observe(tokens, tokens.tolist())
        # rows move only among a prompt's beams, whose key masks and positions are the same
        batch.reorder(rows.tolist(), shared_slots + common if shared_slots else 0)
        batch.feed(tokens)
        if between_steps is not None:
            between_steps()
        logits, slid = _next_logits(batch)
        if slid:
            shared_slots = 0  # a window per beam: no slot is known to be shared

    return [
        [Generated(list(t), reason, score) for score, t, reason in state.finished[: cfg.num_return_sequences]]
        for state in states
    ]


def _start_beams(model, prompts: list[list[int]], cfg: GenerationConfig) -> tuple[Batch, torch.Tensor]:
    """The decoding batch of every prompt's k beams, prompt-major (each prompt prefilled once, its
    row copied to its beams), and their first logits."""
    k = cfg.beam_width
    row_cfg = GenerationConfig(max_new_tokens=cfg.max_new_tokens)  # beam rows choose no token themselves
    batch = Batch(model, max_batch=len(prompts) * k, compile=cfg.compile, use_cache=cfg.use_cache)
    logits = batch.forward([Row(p, row_cfg, emit=_no_events) for p in prompts])
    expand = [b for b in range(len(prompts)) for _ in range(k)]
    batch.reorder(expand)
    return batch, logits[torch.tensor(expand, device=logits.device)]


def _no_events(_event) -> None:
    """Beam rows choose no token through the batch, so they receive no events."""


def _next_logits(batch: Batch) -> tuple[torch.Tensor, bool]:
    """The batch's next logits in its rows' current order, and whether a row slid past the context
    (a row that slid moves to the end of the batch: the rows are put back in order)."""
    before = list(batch.rows)
    logits = batch.forward()
    if batch.rows == before:
        return logits, False
    position = {id(r): i for i, r in enumerate(batch.rows)}
    order = [position[id(r)] for r in before]
    batch.reorder(order)
    return logits[torch.tensor(order, device=logits.device)], True


def _common_prefix(generated: torch.Tensor, step: int, B: int, k: int) -> int:
    """How many leading generated tokens every beam of every prompt has in common."""
    if step == 0:
        return 0
    history = generated[:, :step].view(B, k, step)
    agree = (history == history[:, :1]).all(1).all(0)  # (step,)
    return int(agree.cumprod(0).sum())


def _add_finished(states, cfg, step, norm, generated, top_scores, rows, tokens, ends, stop_set) -> None:
    """Candidates ranked in a prompt's first k that end (stop token, or the last step) become
    finished hypotheses, unless the prompt no longer accepts any."""
    k = states[0].k
    accepting = [not s.done and not (cfg.early_stopping and len(s.finished) == k) for s in states]
    top_scores, rows, tokens = top_scores[:, :k].tolist(), rows[:, :k].tolist(), tokens[:, :k].tolist()
    for b, rank in ends[:, :k].nonzero().tolist():  # prompt by prompt, best rank first
        if not accepting[b]:
            continue
        token, row = tokens[b][rank], rows[b][rank]
        stops = token in stop_set
        ids = generated[row, :step].tolist() + ([] if stops else [token])
        states[b].add_finished(top_scores[b][rank] / norm, ids, "stop_token" if stops else "length")


def _running(top_scores, rows, tokens, ends, k: int):
    """The best k candidates of each prompt that do not end: (scores, rows, tokens), each (B, k)."""
    if ends is None or not bool(ends.any()):
        return top_scores[:, :k], rows[:, :k], tokens[:, :k]
    if bool(((~ends).sum(1) < k).any()):
        return _running_short(top_scores, rows, tokens, ends, k)
    keep = torch.sort(ends.to(torch.uint8), dim=1, stable=True).indices[:, :k]  # non-ending first, in rank order
    return top_scores.gather(1, keep), rows.gather(1, keep), tokens.gather(1, keep)


def _running_short(top_scores, rows, tokens, ends, k: int):
    """Tiny vocabularies only: fewer than k candidates of a prompt go on, so ended beams continue
    with a score no candidate will ever choose."""
    device = top_scores.device
    out = []
    for score_b, row_b, token_b, end_b in zip(top_scores.tolist(), rows.tolist(), tokens.tolist(), ends.tolist()):
        candidates = list(zip(score_b, row_b, token_b))
        running = [c for c, e in zip(candidates, end_b) if not e][:k]
        ended = [c for c, e in zip(candidates, end_b) if e]
        while len(running) < k:
            score, row, token = ended.pop(0) if ended else running[-1]
            running.append((score + START_PENALTY, row, token))
        out.append(running)
    scores, rows, tokens = (torch.tensor([[c[i] for c in r] for r in out], device=device) for i in range(3))
    return scores.float(), rows, tokens


def _update_done(states, cfg, best_running: torch.Tensor, norm: float) -> bool:
    """Mark prompts that hold k hypotheses no running beam can beat as done; True when all are."""
    k = states[0].k
    if any(len(s.finished) == k and not s.done for s in states):
        best = (best_running / norm).tolist()
        for b, s in enumerate(states):
            if len(s.finished) == k and (cfg.early_stopping or best[b] <= s.finished[-1][0]):
                s.done = True
    return all(s.done for s in states)
