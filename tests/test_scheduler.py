"""The scheduler's bucketed cache (`tinylm serve --compile`): rows joining and leaving a batch whose
shapes come from a few buckets still get, token for token, what `tinylm generate` gives them alone,
eagerly and compiled; and the batched per-row draw is `select_next`'s."""

import dataclasses
import logging
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from serving_util import leave_together, wait_for

from tinylm.config import ModelConfig
from tinylm.generation.batch import DoneEvent, ErrorEvent, Row, batch_buckets
from tinylm.generation.core import cache_slots, fit_prompts
from tinylm.generation.generate import generate_many
from tinylm.generation.processors import GenerationConfig
from tinylm.models.gpt import GPT
from tinylm.serving.scheduler import DecodingStopped, Scheduler

PROMPTS = [[2, 5, 6, 7], [2, 9], list(range(2, 40)), [2, 11, 12, 13, 14, 15, 16]]
CFGS = [
    GenerationConfig(max_new_tokens=40, temperature=0),
    GenerationConfig(max_new_tokens=30, temperature=1.0, seed=5),
    GenerationConfig(
        max_new_tokens=25, temperature=0.7, top_k=10, repetition_penalty=1.3, no_repeat_ngram_size=2, seed=9
    ),
    GenerationConfig(max_new_tokens=7, temperature=1.0, top_p=0.9, seed=3, stop_ids=(3,)),
]


def small_model(positions: str = "learned") -> GPT:
    torch.manual_seed(1)
    return GPT(
        ModelConfig(
            vocab_size=48, context_length=32, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, positions=positions
        )
    ).eval()


def alone(model, prompts, cfgs) -> dict:
    return {
        (i, j): generate_many(model, [p], dataclasses.replace(c, seed_per_row=True))[0].tokens
        for i, p in enumerate(prompts)
        for j, c in enumerate(cfgs)
    }


def served(scheduler: Scheduler, prompts, cfgs) -> dict:
    """Every (prompt, knobs) pair through the scheduler, later rows joining a running batch."""
    got, done = {}, threading.Event()
    keys = [(i, j) for i in range(len(prompts)) for j in range(len(cfgs))]

    def emitter(key):
        def emit(event):
            if isinstance(event, DoneEvent):
                got[key] = event.tokens
                if len(got) == len(keys):
                    done.set()

        return emit

    for n, (i, j) in enumerate(keys):
        scheduler.add(Row(prompts[i], cfgs[j], emitter((i, j))))
        if n % 3 == 2:
            done.wait(0.01)
    assert done.wait(120)
    return got


def test_buckets():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    assert [cache_slots(n, 128, bucketed=True) for n in (1, 70, 128)] == [64, 128, 128]
    assert [cache_slots(n, 1024, bucketed=True) for n in (1, 64, 65, 200, 600, 1024)] == [64, 64, 128, 256, 1024, 1024]
    assert cache_slots(300, 512, bucketed=True) == 512


def cache_sizes_of(scheduler: Scheduler) -> list[int]:
    """The cache's slot count after each time rows join the scheduler's batch, as it runs."""
    sizes, merge = [], scheduler.batch._merge

    def watched(rows, new):
        merge(rows, new)
        sizes.append(scheduler.cache.max_len)

    scheduler.batch._merge = watched
    return sizes


def test_a_bucketed_short_context_keeps_one_cache_size():
    """Contexts up to 256 tokens are served from caches of the whole context, the one slot size the
    compiled server compiles at start, whatever the rows need."""
    model = GPT(ModelConfig(vocab_size=48, context_length=200, d_model=16, n_layers=1, n_heads=2)).eval()
    scheduler = Scheduler(model, max_batch=4, bucketed=True)
    sizes = cache_sizes_of(scheduler)
    try:
        prompts = [[2, 5, 6], [2, 9]]
        cfgs = [GenerationConfig(max_new_tokens=5, temperature=0)]
        assert served(scheduler, prompts, cfgs) == alone(model, prompts, cfgs)
    finally:
        scheduler.close()
    assert sizes and set(sizes) == {200}


@pytest.mark.parametrize("positions", ["learned", "rope"])
def test_bucketed_rows_joining_and_leaving_get_their_tokens_alone(positions):
    """Eagerly with the compiled shapes: padding rows, buckets growing and shrinking, rows written
    into the cache in place, sliding past the context, more rows than batch slots."""
    model = small_model(positions)
    with pytest.warns(UserWarning, match="longer than the context"):
        prompts = fit_prompts(PROMPTS, model.config.context_length)
    want = alone(model, prompts, CFGS)
    scheduler = Scheduler(model, max_batch=6, bucketed=True)
    try:
        assert served(scheduler, prompts, CFGS) == want
        assert scheduler.max_rows_seen == 6
    finally:
        scheduler.close()


def test_bucketed_long_context_moves_between_slot_buckets():
    """A context over 256 slots: a short row alone gets 64 slots, a row joining it that needs more
    than 256 gets the context's 320 (and slides past it); both still get their tokens alone."""
    torch.manual_seed(2)
    model = GPT(ModelConfig(vocab_size=48, context_length=320, d_model=16, n_layers=1, n_heads=2)).eval()
    short = ([2, 5, 6, 7], GenerationConfig(max_new_tokens=40, temperature=0))
    long = (list(range(2, 30)), GenerationConfig(max_new_tokens=330, temperature=0.9, top_k=5, seed=8))
    want = [alone(model, [p], [c])[0, 0] for p, c in (short, long)]
    scheduler = Scheduler(model, max_batch=4, bucketed=True)
    sizes = cache_sizes_of(scheduler)
    got, first_token, done = {}, threading.Event(), threading.Semaphore(0)

    def emitter(key):
        def emit(event):
            first_token.set()
            if isinstance(event, DoneEvent):
                got[key] = event.tokens
                done.release()

        return emit

    try:
        scheduler.add(Row(*short, emitter(0)))
        assert first_token.wait(30)
        scheduler.add(Row(*long, emitter(1)))
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    finally:
        scheduler.close()
    assert [got[0], got[1]] == want
    assert sizes[0] == 64 and 320 in sizes and set(sizes) <= {64, 128, 256, 320}


@pytest.mark.slow  # compiles the step for batch buckets 1, 2 and 4 (~10 s each on 2 cores, cold)
def test_compiled_scheduler_equals_eager_and_generate(caplog):
    model = small_model("rope")
    with pytest.warns(UserWarning, match="longer than the context"):
        prompts = fit_prompts(PROMPTS, model.config.context_length)
    cfgs = [dataclasses.replace(c, max_new_tokens=min(c.max_new_tokens, 36)) for c in CFGS]
    want = alone(model, prompts, cfgs)
    eager = Scheduler(model, max_batch=4)
    try:
        assert served(eager, prompts, cfgs) == want
    finally:
        eager.close()
    caplog.set_level(logging.INFO, logger="tinylm")
    compiled = Scheduler(model, max_batch=4, compile=True)
    try:
        assert sorted(compiled.compile_seconds) == [(1, 32), (2, 32), (4, 32)]
        assert "compiled the decoding step for 3 batch buckets (1, 2, 4 rows x 32 cache slots)" in caplog.text
        assert served(compiled, prompts, cfgs) == want
    finally:
        compiled.close()


def test_a_sliding_row_stays_counted_as_active():
    """A row past the context leaves the cache and comes back within one step; `active` (the health
    endpoint's count) must not show the gap. Polled from another thread through 20 slides."""
    model = small_model()
    scheduler = Scheduler(model, max_batch=4)
    counts, first, done = [], threading.Event(), threading.Event()

    def emit(event):
        first.set()
        if isinstance(event, DoneEvent):
            done.set()

    try:
        scheduler.add(Row([2, 5, 6], GenerationConfig(max_new_tokens=320, temperature=0), emit))
        assert first.wait(30)
        while not done.is_set():
            counts.append(scheduler.active)
            time.sleep(0.0001)  # a read every ~0.1 ms, leaving the decoding thread the interpreter
        counts = counts[:-5]  # the last reads may follow the row's DoneEvent
        assert len(counts) > 200 and set(counts) == {1}
    finally:
        scheduler.close()


def test_rows_leaving_together_between_two_steps_do_not_stop_the_decoder():
    """Clients leaving together (tabs closed, a network blip): 100 times, 16 streaming rows, a random
    subset of them cancelled between the same two steps (the model held meanwhile), then the rest.
    No row gets an error, the decoding thread lives on, and a request after them gets its tokens
    alone. Outside inference mode, the cache's in-place reorder of those rows raised and ended the
    decoding thread."""
    model = small_model()
    scheduler = Scheduler(model, max_batch=16)
    try:
        holder = SimpleNamespace(scheduler=scheduler)
        assert leave_together(scheduler, holder, trials=100, seed=0) >= 95
        assert scheduler.alive and scheduler.failure is None
        prompts, cfgs = PROMPTS[:2], CFGS[:2]
        assert served(scheduler, prompts, cfgs) == alone(model, prompts, cfgs)
    finally:
        scheduler.close()


def test_a_failing_step_fails_its_rows_and_the_next_requests_decode():
    model = small_model()
    scheduler = Scheduler(model, max_batch=4)
    events = []
    try:
        real_step, scheduler.batch.step = scheduler.batch.step, lambda *a, **k: 1 / 0
        scheduler.add(Row([2, 5], GenerationConfig(max_new_tokens=5, temperature=0), events.append))
        wait_for(lambda: events, "the failed row's event")
        assert isinstance(events[0], ErrorEvent) and "ZeroDivisionError" in events[0].message
        scheduler.batch.step = real_step
        assert scheduler.alive and served(scheduler, PROMPTS[:1], CFGS[:1]) == alone(model, PROMPTS[:1], CFGS[:1])
    finally:
        scheduler.close()


def test_a_decoding_thread_that_stops_says_why_and_fails_every_row():
    """What the loop cannot go on from (here a BaseException out of a step): the rows in flight and
    every row added later get DecodingStopped, ``alive`` turns False and ``failure`` says why."""
    scheduler = Scheduler(small_model(), max_batch=4)
    reasons, first, later = [], [], []
    scheduler.on_failure = reasons.append

    def stop(*args, **kwargs):
        raise SystemExit("the model broke")

    scheduler.batch.step = stop
    scheduler.add(Row([2, 5], GenerationConfig(max_new_tokens=5, temperature=0), first.append))
    wait_for(lambda: first and reasons, "the stopped thread's row and reason")
    scheduler.add(Row([2, 6], GenerationConfig(max_new_tokens=5, temperature=0), later.append))
    assert isinstance(first[0], DecodingStopped) and isinstance(later[0], DecodingStopped)
    assert not scheduler.alive and "SystemExit: the model broke" in scheduler.failure
    assert "Traceback" in reasons[0] and "the model broke" in later[0].message
    scheduler.close()


def test_a_beam_search_takes_turns_with_the_decoding_steps_at_each_of_its_steps():
    """Beam steps run the blocks without their hooks: the beam gives the decoding thread a turn
    before each step (``Scheduler.give_turn``), so a streaming row keeps getting tokens while a
    long beam runs, and the beam's result is the same as alone."""
    model = small_model()
    scheduler = Scheduler(model, max_batch=4)
    cfg = GenerationConfig(max_new_tokens=60, min_new_tokens=60, beam_width=6, temperature=0)
    alone = generate_many(model, [[2, 7, 9]], cfg)
    tokens, during = [], []
    try:
        row = Row([2, 5], GenerationConfig(max_new_tokens=10**6, min_new_tokens=10**6, temperature=0), tokens.append)
        scheduler.add(row)
        wait_for(lambda: tokens, "the streaming row's first token")
        task = scheduler.call(generate_many, model, [[2, 7, 9]], cfg, None, scheduler.give_turn)
        while not task.done():
            during.append(len(tokens))
            time.sleep(0.001)
        assert [g.tokens for g in task.result()] == [g.tokens for g in alone]
        assert during[-1] - during[0] >= 59  # a step at least before each beam step after the first
        scheduler.cancel(row)
    finally:
        scheduler.close()


def test_a_long_task_takes_turns_with_the_decoding_steps():
    """A task (scoring, a beam search) pauses at each block for the next step: while it runs,
    a streaming row keeps getting tokens, and the task's result is what it is alone."""
    model = small_model()
    scheduler = Scheduler(model, max_batch=4)
    ids = torch.randint(0, 48, (8, 32), generator=torch.Generator().manual_seed(0))

    def score(n):  # n full forwards, blocks hooked
        return [model(ids)[0] for _ in range(n)]

    with torch.inference_mode():
        want = model(ids)[0]
    tokens, during = [], []
    try:
        row = Row([2, 5], GenerationConfig(max_new_tokens=10**6, min_new_tokens=10**6, temperature=0), tokens.append)
        scheduler.add(row)
        wait_for(lambda: tokens, "the streaming row's first token")
        task = scheduler.call(score, 40)
        while not task.done():
            during.append(len(tokens))
            time.sleep(0.001)
        got = task.result()
        assert all(torch.equal(g, want) for g in got)
        assert during[-1] - during[0] >= 40  # a step at least per task forward: each has two blocks
        scheduler.cancel(row)
    finally:
        scheduler.close()
