"""Beam search: k=1 is greedy, scores are what they claim, batches and the cache change nothing."""

import pytest
import torch
from conftest import slow_except

from tinylm.config import ModelConfig
from tinylm.generation import GenerationConfig, generate, generate_many
from tinylm.generation.beam import beam_search
from tinylm.models.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


def tiny_model(positions="learned", vocab=23):
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=vocab, context_length=64, d_model=32, n_layers=2, n_heads=4, positions=positions)
    return GPT(cfg).eval()


def sequence_logprob(model, prompt, tokens, stop=None):
    seq = prompt + tokens + ([stop] if stop is not None else [])
    with torch.inference_mode():
        logp = torch.log_softmax(model(torch.tensor([seq]))[0][0].double(), -1)
    return sum(float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(seq[len(prompt) :]))


@pytest.mark.parametrize("positions", slow_except("rope", ["learned", "rope"]))
def test_width_one_equals_greedy(positions):
    model = tiny_model(positions)
    for prompt in ([1, 2, 3], [5, 9, 9, 4, 1]):
        greedy = generate(model, prompt, 25, temperature=0, eos_id=7)
        assert generate(model, prompt, 25, temperature=0, eos_id=7, beam_width=1) == greedy
        beam1 = beam_search(model, [prompt], GenerationConfig(max_new_tokens=25, beam_width=2 - 1, stop_ids=(7,)))
        assert beam1[0][0].tokens == greedy


@pytest.mark.parametrize("alpha", [0.0, 1.0, 2.0])
def test_scores_are_length_normalised_log_probabilities_best_first(alpha):
    model = tiny_model()
    prompt, stop = [1, 2, 3], 5
    cfg = GenerationConfig(
        max_new_tokens=12, beam_width=6, num_return_sequences=6, stop_ids=(stop,), length_penalty=alpha
    )
    hyps = beam_search(model, [prompt], cfg)[0]
    assert len(hyps) == 6
    scores = [h.score for h in hyps]
    assert scores == sorted(scores, reverse=True)
    for h in hyps:
        ended = h.finish_reason == "stop_token"
        length = len(h.tokens) + ended  # the stop token counts in the length
        expected = sequence_logprob(model, prompt, h.tokens, stop if ended else None) / length**alpha
        assert h.score == pytest.approx(expected, abs=1e-4)


def test_beam_beats_or_ties_greedy_on_total_log_probability():
    model = tiny_model()
    prompt = [4, 4, 2]
    greedy = generate(model, prompt, 10, temperature=0)
    best = beam_search(model, [prompt], GenerationConfig(max_new_tokens=10, beam_width=5, length_penalty=0))[0][0]
    assert sequence_logprob(model, prompt, best.tokens) >= sequence_logprob(model, prompt, greedy) - 1e-6


def test_early_stopping_and_stop_token_excluded():
    model = tiny_model()
    stop = generate(model, [1, 2], 5, temperature=0)[2]  # a token the model likes to produce
    cfg = GenerationConfig(
        max_new_tokens=30, beam_width=4, stop_ids=(stop,), early_stopping=True, num_return_sequences=4
    )
    hyps = beam_search(model, [[1, 2]], cfg)[0]
    assert all(stop not in h.tokens for h in hyps)
    assert any(h.finish_reason == "stop_token" for h in hyps)


@pytest.mark.parametrize("positions", slow_except("rope", ["learned", "rope"]))
def test_batch_rows_and_cache_do_not_change_results(positions):
    model = tiny_model(positions)
    prompts = [[1, 2, 3, 4, 5, 6], [7, 8], [9, 10, 11]]
    cfg = GenerationConfig(max_new_tokens=15, beam_width=4, stop_ids=(6,), num_return_sequences=2)
    batched = beam_search(model, prompts, cfg)
    nocache = beam_search(model, prompts, GenerationConfig(**{**cfg.__dict__, "use_cache": False}))
    for i, p in enumerate(prompts):
        alone = beam_search(model, [p], cfg)[0]
        assert [h.tokens for h in batched[i]] == [h.tokens for h in alone] == [h.tokens for h in nocache[i]]
    flat = generate_many(model, prompts, cfg)
    assert [h.tokens for h in flat] == [h.tokens for hyps in batched for h in hyps]


def test_beam_runs_past_the_context_length():
    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=23, context_length=16, d_model=32, n_layers=2, n_heads=4)).eval()
    hyps = beam_search(model, [[1, 2, 3]], GenerationConfig(max_new_tokens=30, beam_width=3))[0]
    assert len(hyps[0].tokens) == 30


def test_cache_reorder_from_the_shared_slots_equals_a_full_reorder():
    from tinylm.generation.beam import _common_prefix

    model = tiny_model()
    torch.manual_seed(1)
    full, part = model.new_kv_cache(6, 12), model.new_kv_cache(6, 12)
    for a, b in zip((*full.k, *full.v), (*part.k, *part.v)):
        a.copy_(torch.randn_like(a))
        a[:, :, :7] = a[:1, :, :7]  # slots 0-6 the same in every row, as a prompt and a shared history are
        b.copy_(a)
    full.length = part.length = 10
    rows = torch.tensor([2, 2, 0, 5, 4, 1])
    full.reorder(rows)
    part.reorder(rows, start=7)
    for a, b in zip((*full.k, *full.v), (*part.k, *part.v)):
        assert torch.equal(a, b)
    generated = torch.tensor([[3, 4, 5, 0], [3, 4, 6, 0], [3, 4, 5, 0], [3, 9, 5, 0]])  # 2 prompts x 2 beams
    assert _common_prefix(generated, 3, 2, 2) == 1 and _common_prefix(generated, 0, 2, 2) == 0
