"""Beam search over a batch of prompts, on the KV cache (rows reordered by beam each step).

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
from tinylm.generation.core import Generated, cache_slots, fit_prompts, full_forward, prefill
from tinylm.generation.decode import decode_step, prepare_for_inference
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


def beam_search(model, prompts, cfg: GenerationConfig) -> list[list[Generated]]:
    cfg.validate(model.config.vocab_size)
    if cfg.stop_strings:
        raise ValueError("stop_strings are not supported with beam_width > 1 (use stop token ids)")
    with eval_mode(model), torch.inference_mode():
        return _beam_search(model, fit_prompts(prompts, model.config.context_length), cfg)


def _beam_search(model, prompts: list[list[int]], cfg: GenerationConfig) -> list[list[Generated]]:
    context_length = model.config.context_length
    device = next(model.parameters()).device
    k, B, V = cfg.beam_width, len(prompts), model.config.vocab_size
    if cfg.max_new_tokens == 0:
        return [[Generated([], "length", 0.0)] for _ in prompts]
    stop_set = set(cfg.stop_ids)
    states = [_Prompt(k) for _ in prompts]
    # beam rows are prompt-major: row b * k + j is beam j of prompt b
    generated = torch.zeros(B * k, cfg.max_new_tokens, dtype=torch.long)  # tokens per row (CPU)
    scores = torch.full((B, k), START_PENALTY, device=device)
    scores[:, 0] = 0.0
    history = HistoryProcessor(cfg, [p for p in prompts for _ in range(k)], V, device)
    history = history if history.active else None
    # enough candidates that k of them survive even if every stop id is chosen by every beam
    n_candidates = min(max(2, 1 + len(stop_set)) * k, k * V)

    max_len = cache_slots(context_length, max(len(p) for p in prompts) + cfg.max_new_tokens, cfg.compile)
    expand = torch.arange(B, device=device).repeat_interleave(k)
    cache = positions = None
    if cfg.use_cache:  # one prefill per prompt, then each prompt row copied to its k beams
        prepared = prepare_for_inference(model)
        cache, logits, positions = prefill(model, prompts, max_len)
        cache.reorder(expand)
        positions = positions[expand] if positions is not None else None
    else:
        logits = full_forward(model, prompts)
    logits = logits[expand]

    for step in range(cfg.max_new_tokens):
        last_step = step == cfg.max_new_tokens - 1
        norm = (step + 1) ** cfg.length_penalty  # generated length so far, including this step's token
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        if history is not None:
            log_probs = history(log_probs, step)
        totals = (log_probs.view(B, k, V) + scores[:, :, None]).view(B, k * V)
        top_scores, top_index = torch.topk(totals, n_candidates, dim=-1)  # sorted, best first
        top_scores, top_index = top_scores.tolist(), top_index.tolist()

        next_rows, next_tokens, next_scores = [], [], []
        for b, state in enumerate(states):
            accepting = not state.done and not (cfg.early_stopping and len(state.finished) == k)
            running, ended = [], []  # (score, row, token)
            for rank in range(n_candidates):
                score, (beam, token) = top_scores[b][rank], divmod(top_index[b][rank], V)
                row = b * k + beam
                stops = token in stop_set
                if stops or last_step:
                    ended.append((score, row, token))
                    if rank < k and accepting:
                        tokens = generated[row, :step].tolist() + ([] if stops else [token])
                        state.add_finished(score / norm, tokens, "stop_token" if stops else "length")
                elif len(running) < k:
                    running.append((score, row, token))
            if last_step:
                continue
            while len(running) < k:  # tiny vocabularies only: continue ended beams, never chosen again
                score, row, token = ended.pop(0) if ended else running[-1]
                running.append((score + START_PENALTY, row, token))
            # can the best running beam still beat the worst kept hypothesis?
            if len(state.finished) == k and (cfg.early_stopping or running[0][0] / norm <= state.finished[-1][0]):
                state.done = True
            for score, row, token in running:
                next_scores.append(score)
                next_rows.append(row)
                next_tokens.append(token)
        if last_step or all(s.done for s in states):
            break

        scores = torch.tensor(next_scores, device=device).view(B, k)
        rows_cpu = torch.tensor(next_rows)
        generated = generated.index_select(0, rows_cpu)
        generated[:, step] = torch.tensor(next_tokens)
        rows = rows_cpu.to(device)
        tokens = torch.tensor(next_tokens, device=device)
        if history is not None:
            history.reorder(next_rows)
            history.observe(tokens, next_tokens)
        if cfg.use_cache and cache.length < cache.max_len:
            cache.reorder(rows)
            if positions is not None:
                positions = positions[rows]
            logits = decode_step(prepared, cache, tokens, positions, cfg.compile)
            if positions is not None:
                positions += 1
        else:  # no cache, or a full one: the last half-context per beam is re-prefilled
            seqs = [prompts[r // k] + generated[r, : step + 1].tolist() for r in range(B * k)]
            if cfg.use_cache:
                cache, logits, positions = prefill(model, [s[-(context_length // 2) :] for s in seqs], context_length)
            else:
                logits = full_forward(model, [s[-context_length:] for s in seqs])

    return [[Generated(list(t), reason, score) for score, t, reason in state.finished[: cfg.num_return_sequences]]
            for state in states]
