"""Decoding knobs: validation, and each processor against Hugging Face's implementation."""

import pytest
import torch

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.generation import GenerationConfig, generate, generate_many, select_next
from tinylm.generation.processors import HistoryProcessor, min_p_filter, shape_distribution, top_k_filter, top_p_filter
from tinylm.generation.sampling import RowKnobs, choose, seed_keys, stream_uniforms
from tinylm.models.gpt import GPT

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.one_thread


@pytest.fixture(scope="module")
def hf_lp():
    """Hugging Face's processors, the reference; importing them takes about a second (the tests are slow)."""
    return pytest.importorskip("transformers.generation.logits_process")


def tiny_model(vocab=40):
    torch.manual_seed(0)
    return GPT(ModelConfig(vocab_size=vocab, context_length=64, d_model=32, n_layers=2, n_heads=4)).eval()


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(beam_width=0), "beam_width"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(min_new_tokens=5, max_new_tokens=2), "min_new_tokens"),
        (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"),
        (dict(num_return_sequences=3, beam_width=2), "num_return_sequences"),
        (dict(beam_width=2, length_penalty=-1e308), "length_penalty"),
    ],
)
def test_invalid_values_raise_tinylmerror_naming_the_argument(kwargs, name):
    with pytest.raises(TinyLMError, match=name):
        GenerationConfig(**kwargs).validate(vocab_size=40)


def test_beam_width_larger_than_vocabulary_is_rejected():
    with pytest.raises(TinyLMError, match="beam_width"):
        generate(tiny_model(vocab=40), [1, 2], 5, temperature=0, beam_width=41)
    with pytest.raises(TinyLMError, match="top_p"):
        generate(tiny_model(), [1, 2], 5, top_p=0)


def test_top_k_keeps_exactly_k_with_ties_broken_by_lowest_id():
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 2.0, 0.5]])
    kept = top_k_filter(logits, 3)
    assert torch.isfinite(kept).sum() == 3
    assert torch.isfinite(kept[0]).nonzero().flatten().tolist() == [1, 2, 3]
    assert torch.equal(top_k_filter(logits, 6), logits)


@pytest.mark.slow
def test_filters_match_hugging_face_warpers(hf_lp):
    torch.manual_seed(1)
    logits = torch.randn(4, 500) * 3
    for k in (1, 5, 50):
        hf = hf_lp.TopKLogitsWarper(top_k=k)(None, logits.clone())
        assert torch.equal(top_k_filter(logits, k), hf)
    for p in (0.1, 0.5, 0.9, 0.99):
        hf = hf_lp.TopPLogitsWarper(top_p=p)(None, logits.clone())
        ours = top_p_filter(logits, p)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(hf))
        assert torch.equal(
            top_p_filter(top_k_filter(logits, 50), p, candidates=50),
            hf_lp.TopPLogitsWarper(top_p=p)(None, hf_lp.TopKLogitsWarper(50)(None, logits.clone())),
        )
    for mp in (0.05, 0.3):
        hf = hf_lp.MinPLogitsWarper(min_p=mp)(None, logits.clone())
        assert torch.equal(torch.isfinite(min_p_filter(logits, mp)), torch.isfinite(hf))


@pytest.mark.slow
def test_history_processors_match_hugging_face(hf_lp):
    torch.manual_seed(2)
    V = 30
    rows = [[1, 2, 3, 1, 2, 5, 1, 2], [7, 7, 8, 9, 7, 7]]
    scores = torch.randn(2, V)
    # repetition penalty: divide positive, multiply negative logits of every token seen so far
    cfg = GenerationConfig(repetition_penalty=1.7)
    ours = HistoryProcessor(cfg, rows, V, "cpu")(scores.clone(), 0)
    hf = hf_lp.RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([rows[0], rows[1] + [7, 7]]), scores.clone())
    assert torch.allclose(ours, hf)
    # no-repeat n-grams, with tokens observed one by one
    for n in (1, 2, 3):
        proc = HistoryProcessor(GenerationConfig(no_repeat_ngram_size=n), [r[:4] for r in rows], V, "cpu")
        for t in range(4, 6):
            proc.observe(torch.tensor([rows[0][t], rows[1][t]]))
        hf = hf_lp.NoRepeatNGramLogitsProcessor(n)(torch.tensor([rows[0][:6], rows[1][:6]]), scores.clone())
        assert torch.equal(proc(scores.clone(), 2), hf)
    # min_new_tokens: stop ids banned until enough tokens were generated
    proc = HistoryProcessor(GenerationConfig(min_new_tokens=3, max_new_tokens=9, stop_ids=(4, 6)), rows, V, "cpu")
    assert torch.isinf(proc(scores.clone(), 2)[:, [4, 6]]).all()
    assert torch.equal(proc(scores.clone(), 3), scores)


@pytest.mark.slow
def test_temperature_then_topk_topp_matches_hf_order(hf_lp):
    torch.manual_seed(3)
    logits = torch.randn(2, 200)
    cfg = GenerationConfig(temperature=0.7, top_k=20, top_p=0.8)
    x = hf_lp.TemperatureLogitsWarper(0.7)(None, logits.clone())
    x = hf_lp.TopKLogitsWarper(20)(None, x)
    x = hf_lp.TopPLogitsWarper(0.8)(None, x)
    assert torch.allclose(shape_distribution(logits, cfg), x)


def test_greedy_is_argmax_and_sampling_is_seeded():
    torch.manual_seed(4)
    logits = torch.randn(3, 50)
    assert torch.equal(select_next(logits, GenerationConfig(temperature=0)), logits.argmax(-1))
    assert torch.equal(select_next(logits, GenerationConfig(top_k=1)), logits.argmax(-1))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    a = [select_next(logits, GenerationConfig(), g1) for _ in range(5)]
    b = [select_next(logits, GenerationConfig(), g2) for _ in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # the empirical distribution of 4000 draws follows softmax(logits / T) with top-p applied
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -5.0]])
    g = torch.Generator().manual_seed(0)
    draws = select_next(row.expand(4000, -1), GenerationConfig(temperature=0.5, top_p=0.95), g)
    probs = torch.softmax(top_p_filter(row / 0.5, 0.95), -1)[0]
    freq = torch.bincount(draws, minlength=5).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03) and freq[3:].sum() == 0


def test_generate_seed_reproducible_and_stop_controls():
    model = tiny_model()
    a = generate(model, [1, 2, 3], 20, temperature=1.0, top_k=10, seed=5)
    assert a == generate(model, [1, 2, 3], 20, temperature=1.0, top_k=10, seed=5)
    assert a != generate(model, [1, 2, 3], 20, temperature=1.0, top_k=10, seed=6)
    greedy = generate(model, [1, 2, 3], 20, temperature=0)
    stop = greedy[5]
    cut = generate(model, [1, 2, 3], 20, temperature=0, eos_id=stop)
    assert cut == greedy[: greedy.index(stop)]
    longer = generate(model, [1, 2, 3], 20, temperature=0, eos_id=stop, min_new_tokens=greedy.index(stop) + 1)
    assert len(longer) > len(cut)
    # stop strings: decode maps ids to letters
    decode = lambda ids: "".join(chr(97 + i % 26) for i in ids)  # noqa: E731
    target = decode(greedy[3:5])
    r = generate_many(
        model, [[1, 2, 3]], GenerationConfig(max_new_tokens=20, temperature=0, stop_strings=(target,)), decode=decode
    )[0]
    assert r.finish_reason == "stop_string" and target in decode(r.tokens) and len(r.tokens) <= 5
    with pytest.raises(ValueError, match="decode"):
        generate_many(model, [[1]], GenerationConfig(stop_strings=("x",)))


def test_per_row_knobs_shape_each_row_as_its_own_config_would():
    """RowKnobs with a different temperature, top-k, top-p and min-p per row (tensors) give each
    row what the same knobs give it alone (one number each)."""
    torch.manual_seed(5)
    cfgs = [
        GenerationConfig(temperature=0.7, top_k=5),
        GenerationConfig(temperature=1.3, top_p=0.8),
        GenerationConfig(temperature=1.0, top_k=40, top_p=0.9, min_p=0.05),
        GenerationConfig(temperature=0.9),
        GenerationConfig(temperature=0.5, min_p=0.2),
    ]
    logits = torch.randn(len(cfgs), 300) * 2
    logits[0, 10:20] = logits[0].max()  # ties at the k-th value: the lowest ids are kept
    mixed = shape_distribution(logits, RowKnobs.of(cfgs))
    assert isinstance(RowKnobs.of(cfgs).top_k, torch.Tensor)
    for r, cfg in enumerate(cfgs):
        alone = shape_distribution(logits[r : r + 1], cfg)
        assert torch.equal(torch.isfinite(mixed[r]), torch.isfinite(alone[0]))
        assert torch.allclose(mixed[r][torch.isfinite(mixed[r])], alone[0][torch.isfinite(alone[0])])
    assert torch.isfinite(mixed[0]).sum() == 5 and torch.isfinite(mixed[0, 10:15]).all()
    # rows that agree keep one number (the cheaper path)
    same = RowKnobs.of([GenerationConfig(temperature=0.8, top_k=50)] * 3)
    assert same.temperature == 0.8 and same.top_k == 50 and same.top_p is None


def test_a_row_draws_the_same_token_alone_and_in_any_batch():
    """A seeded row's n-th draw depends on its seed and n only: the batch around it, its place in
    the batch and the other rows' knobs (greedy rows among them) change nothing."""
    torch.manual_seed(6)
    cfgs = [GenerationConfig(temperature=1.0, top_k=k) for k in (None, 7, 50)] + [GenerationConfig(temperature=0)]
    seeds = [3, -5, 2**63 + 11, 9]
    for step in range(30):
        logits = torch.randn(len(cfgs), 200) * 3
        draws = [step] * len(cfgs)
        together = choose(logits, RowKnobs.of(cfgs, seeds), draws=draws)
        for r in range(len(cfgs)):
            alone = choose(logits[r : r + 1], RowKnobs.of([cfgs[r]], [seeds[r]]), draws=draws[:1])
            assert int(alone) == int(together[r])
        flipped = choose(logits.flip(0), RowKnobs.of(cfgs[::-1], seeds[::-1]), draws=draws)
        assert flipped.flip(0).tolist() == together.tolist()
        assert int(together[3]) == int(logits[3].argmax())


def test_stream_draws_follow_the_distribution_and_never_pick_a_banned_token():
    """20,000 draws (2,000 seeds x 10 draws each) from softmax(logits / T) after top-k: every
    frequency within 0.012 of its probability, the banned tokens never drawn."""
    row = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -5.0, 3.0, -0.5]])
    cfg = GenerationConfig(temperature=0.8, top_k=6)
    probs = torch.softmax(top_k_filter(row / 0.8, 6), -1)[0]
    counts = torch.zeros(8)
    seeds = list(range(2000))
    knobs = RowKnobs.of([cfg] * len(seeds), seeds)
    for n in range(10):
        drawn = choose(row.expand(len(seeds), -1), knobs, draws=[n] * len(seeds))
        counts += torch.bincount(drawn, minlength=8).float()
    freq = counts / counts.sum()
    assert (freq - probs).abs().max() < 0.012
    assert freq[5] == 0 and freq[4] == 0  # outside the top 6
    # the uniforms themselves: in [0, 1), and distinct across the draws of one seed
    u = stream_uniforms(seed_keys([42] * 1000), list(range(1000)))
    assert 0 <= float(u.min()) and float(u.max()) < 1 and u.unique().numel() == 1000
    assert abs(float(u.mean()) - 0.5) < 0.03


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rows_choose_the_tokens_they_choose_on_the_cpu():
    """Per-row knobs held as CUDA tensors and the seeded stream (drawn on the host, inverted on the
    GPU) choose the CPU's tokens; so does a seeded batch generated on the GPU, token for token."""
    torch.manual_seed(7)
    cfgs = [GenerationConfig(temperature=0.7, top_k=5), GenerationConfig(temperature=1.2, top_p=0.8)]
    cfgs += [GenerationConfig(temperature=1.0, min_p=0.05), GenerationConfig(temperature=0)]
    seeds = [1, 2, 3, 4]
    for step in range(20):
        logits = torch.randn(len(cfgs), 300) * 2
        on_cpu = choose(logits, RowKnobs.of(cfgs, seeds), draws=[step] * 4)
        on_gpu = choose(logits.cuda(), RowKnobs.of(cfgs, seeds, device="cuda"), draws=[step] * 4)
        assert on_gpu.device.type == "cuda" and on_gpu.tolist() == on_cpu.tolist()
    model = tiny_model()
    prompts = [[2, 5, 6, 7, 8], [2, 3], [2, 20, 21]]
    cfg = GenerationConfig(max_new_tokens=20, temperature=0.9, top_k=20, seed=11, seed_per_row=True)
    cpu_rows = generate_many(model, prompts, cfg)
    gpu_rows = generate_many(model.cuda(), prompts, cfg)
    assert [r.tokens for r in gpu_rows] == [r.tokens for r in cpu_rows]
