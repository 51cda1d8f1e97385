"""The decoding core's scoring on the side (generation/batch.py): a row that asks for its prompt's
log probabilities gets them from its own prefill, as a whole-sequence forward scores them, without
changing its tokens; a row that ends on a stop token reports that token's log probability."""

import pytest
import torch

from tinylm.config import ModelConfig
from tinylm.generation.batch import Batch, DoneEvent, PromptEvent, Row, TokenEvent
from tinylm.generation.processors import GenerationConfig
from tinylm.models.gpt import GPT

PROMPTS = [[2, 5, 6, 7, 9, 30], [2, 9], list(range(2, 28)), [2, 11]]
ON_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def model() -> GPT:
    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=48, context_length=32, d_model=32, n_layers=2, n_heads=4, positions="rope")
    return GPT(cfg).eval()


def reference(model, ids: list[int], top: int) -> tuple[list[float], list[list[int]]]:
    """log p(ids[t] | ids[:t]) for t >= 1 and the top ids there, from one forward of the row alone."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids]))[0][0].float(), dim=-1)
    picked = [float(logp[t - 1, ids[t]]) for t in range(1, len(ids))]
    return picked, logp[:-1].topk(top, dim=-1).indices.tolist()


def run(model, prompts, asks, use_cache=True, cfg=None, join_late=()):
    """Step a batch until every row is done; rows in ``join_late`` join after two steps."""
    cfg = cfg or GenerationConfig(max_new_tokens=5, temperature=0)
    events = {i: [] for i in range(len(prompts))}
    rows = [Row(p, cfg, events[i].append, None, 2, 3 if asks[i] else None) for i, p in enumerate(prompts)]
    batch = Batch(model, max_batch=8, use_cache=use_cache)
    first = [r for i, r in enumerate(rows) if i not in join_late]
    late = [r for i, r in enumerate(rows) if i in join_late]
    for joining in (first, [], late):
        if batch.rows or joining:
            batch.step(joining)
    while batch.rows:
        batch.step()
    return events


@pytest.mark.parametrize("use_cache", [True, False])
def test_rows_that_ask_score_their_prompts_in_their_prefill(model, use_cache):
    asks = [True, True, False, True]
    events = run(model, PROMPTS, asks, use_cache, join_late={3})
    plain = run(model, PROMPTS, [False] * 4, use_cache, join_late={3})
    for i, prompt in enumerate(PROMPTS):
        scored = [e for e in events[i] if isinstance(e, PromptEvent)]
        assert len(scored) == int(asks[i])
        if asks[i]:
            assert isinstance(events[i][0], PromptEvent)  # before the row's first token
            picked, top = reference(model, prompt, 3)
            assert scored[0].scored.logprobs.tolist() == pytest.approx(picked, abs=1e-5)
            assert scored[0].scored.top_ids.tolist() == top
        tokens = [e.token for e in events[i] if isinstance(e, TokenEvent)]
        assert tokens == [e.token for e in plain[i] if isinstance(e, TokenEvent)]  # the same tokens as without


def test_a_stop_token_reports_its_log_probability(model):
    prompt = [2, 5, 6, 7]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt]))[0][0, -1].float(), dim=-1)
    likeliest = int(logp.argmax())  # greedy decoding picks it first
    cfg = GenerationConfig(max_new_tokens=5, temperature=0, stop_ids=(likeliest,))
    done = [e for e in run(model, [prompt], [False], cfg=cfg)[0] if isinstance(e, DoneEvent)][0]
    assert done.finish_reason == "stop_token" and done.stop_token == likeliest
    assert done.stop.token == likeliest and done.stop.logprob == pytest.approx(float(logp[likeliest]), abs=1e-5)
    assert [t for t, _ in done.stop.top] == logp.topk(2).indices.tolist()


@ON_CUDA
def test_cuda_prompt_scores_and_tokens_are_the_cpus(model):
    asks = [True, False, True, True]
    on_cpu = run(model, PROMPTS, asks, join_late={3})
    on_gpu = run(model.cuda(), PROMPTS, asks, join_late={3})
    model.cpu()
    for i in range(len(PROMPTS)):
        assert [type(e) for e in on_gpu[i]] == [type(e) for e in on_cpu[i]]
        for gpu, cpu in zip(on_gpu[i], on_cpu[i]):
            if isinstance(cpu, PromptEvent):
                assert gpu.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)
            elif isinstance(cpu, TokenEvent):
                assert gpu.token == cpu.token and gpu.logprob == pytest.approx(cpu.logprob, abs=1e-4)


@pytest.mark.parametrize("long_prompt, compacts", [(10, False), (24, True)])
def test_rows_leaving_drop_unused_slots_once_enough_are_unused(model, long_prompt, compacts):
    """Compacting copies the whole cache: the oldest row leaving frees its few leading slots, and
    they are dropped only once COMPACT_SLOTS (16) are unused; the rows' tokens stay their own."""
    from tinylm.generation.batch import COMPACT_SLOTS
    from tinylm.generation.generate import generate_many

    assert COMPACT_SLOTS == 16
    prompts = [list(range(2, 2 + long_prompt)), [2, 5, 6], [2, 7]]
    cfgs = [GenerationConfig(max_new_tokens=n, temperature=0) for n in (2, 8, 8)]
    tokens = {i: [] for i in range(3)}
    rows = [
        Row(p, c, lambda e, i=i: tokens[i].append(e.token) if isinstance(e, TokenEvent) else None)
        for i, (p, c) in enumerate(zip(prompts, cfgs))
    ]
    batch = Batch(model, max_batch=4)
    batch.step(rows)
    batch.step()  # the long row has its 2 tokens and leaves
    assert len(batch.rows) == 2
    unused = batch.cache.length - max(r.cached for r in batch.rows)
    assert (unused == 0) == compacts and (compacts or 0 < unused < 16)
    while batch.rows:
        batch.step()
    for i in range(3):
        assert tokens[i] == generate_many(model, [prompts[i]], cfgs[i])[0].tokens


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=ON_CUDA)])
@pytest.mark.parametrize("prompt_fits", [True, False])
def test_rows_joining_a_running_batch_ride_along_its_step(model, prompt_fits, device, monkeypatch):
    """Rows joining rows that decode are read in the step itself (their prompts are more rows of
    the step's products), not in a prefill of their own, when their prompts fit before the
    step's slot; a longer prompt is prefilled apart. Either way every row gets its tokens alone."""
    import tinylm.generation.batch as batch_module
    from tinylm.generation.generate import generate_many

    prefills = []
    real_prefill = batch_module.prefill
    monkeypatch.setattr(batch_module, "prefill", lambda *a, **k: prefills.append(len(a[1])) or real_prefill(*a, **k))
    late = [[2, 5, 6, 7], [2, 9, 30]] if prompt_fits else [list(range(2, 20))]
    prompts = [[2, 11, 12, 13, 14, 15]] + late
    cfgs = [GenerationConfig(max_new_tokens=12, temperature=0)] + [
        GenerationConfig(max_new_tokens=8, temperature=1.0, top_k=20, seed=s, seed_per_row=True)
        for s in range(len(late))
    ]
    tokens = {i: [] for i in range(len(prompts))}
    rows = [
        Row(p, c, lambda e, i=i: tokens[i].append(e.token) if isinstance(e, TokenEvent) else None)
        for i, (p, c) in enumerate(zip(prompts, cfgs))
    ]
    batch = Batch(model.to(device), max_batch=4)
    try:
        batch.step(rows[:1])
        batch.step()
        batch.step(rows[1:])
        while batch.rows:
            batch.step()
    finally:
        model.cpu()
    assert prefills == ([1] if prompt_fits else [1, 1])
    for i, (p, c) in enumerate(zip(prompts, cfgs)):
        assert tokens[i] == generate_many(model, [p], c)[0].tokens  # on the CPU
