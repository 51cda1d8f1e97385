"""The decoding step's attention in C (models/cpu_attention.py): the same numbers as the batched
products and as SDPA for every layout the step hands it (grouped heads, head sizes that are and
are not multiples of eight, rows whose masks hide whole blocks of slots), the same decoding step
and tokens as without it (joining prompts too), and the batched products whenever it does not
apply or cannot be built."""

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tinylm.config import ModelConfig
from tinylm.generation import GenerationConfig, generate_many
from tinylm.generation.batch import Batch, Row
from tinylm.generation.core import prefill
from tinylm.generation.decode import decode_step
from tinylm.models import cpu_attention
from tinylm.models.gpt import GPT

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")


def step_case(rows, heads, groups, D, S, seed=0):
    """q (rows heads, groups, D), keys and values as the cache's first S of 2 S slots, and an
    additive mask per row hiding a random leading run of slots (never the last one)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows * heads, groups, D, generator=g)
    cache = torch.randn(2, rows * heads, 2 * S, D, generator=g)
    keys, values = cache[0, :, :S], cache[1, :, :S]
    first = torch.randint(0, S, (rows,), generator=g)
    first[0] = S - 1  # one row sees its last slot alone
    hidden = torch.arange(S)[None, :] < first[:, None]
    bias = torch.zeros(rows, S).masked_fill_(hidden, float("-inf"))
    return q, keys, values, bias.repeat_interleave(heads, 0)[:, None, :].contiguous()


def reference(q, keys, values, bias, scale):
    scores = (q.double() @ keys.double().transpose(1, 2)) * scale + bias.double()
    return (torch.softmax(scores, -1) @ values.double()).float()


@needs_cc
@pytest.mark.parametrize("groups, D", [(1, 32), (2, 32), (1, 64), (1, 16), (3, 24), (1, 128), (1, 5)])
@pytest.mark.parametrize("S", [1, 8, 37, 96])
def test_the_loops_equal_the_batched_products_and_sdpa(groups, D, S):
    q, keys, values, bias = step_case(rows=5, heads=2, groups=groups, D=D, S=S)
    out = cpu_attention.attend(q, keys, values, bias, D**-0.5)
    assert out is not None and out.shape == q.shape
    torch.testing.assert_close(out, reference(q, keys, values, bias, D**-0.5), atol=2e-6, rtol=0)
    sdpa = F.scaled_dot_product_attention(q[:, None], keys[:, None], values[:, None], attn_mask=bias[:, None])
    torch.testing.assert_close(out, sdpa[:, 0], atol=2e-6, rtol=0)


@needs_cc
@pytest.mark.parametrize("S", [40, 43])
def test_what_hidden_slots_hold_changes_nothing(S):
    """A hidden slot's key and value may hold anything (a row's leading padding): NaN changes
    nothing, in the blocks of eight slots and in the last slots after them (S 43: one row's last
    slots but one are hidden)."""
    q, keys, values, bias = step_case(rows=4, heads=3, groups=1, D=32, S=S, seed=1)
    clean = cpu_attention.attend(q, keys, values, bias, 0.2)
    keys[bias[:, 0] == float("-inf")] = float("nan")
    values[bias[:, 0] == float("-inf")] = float("nan")
    assert torch.equal(cpu_attention.attend(q, keys, values, bias, 0.2), clean)


@needs_cc
def test_scores_far_below_the_top_one_weigh_next_to_nothing():
    """Scores more than 87 below a row's top one (where e^x leaves the normal floats) weigh next to
    nothing, as in float64; rows whose scores all lie close stay exact."""
    q, keys, values, bias = step_case(rows=6, heads=2, groups=1, D=32, S=45, seed=2)
    q[:6] *= 60  # the first three rows: scores hundreds apart
    out = cpu_attention.attend(q, keys, values, bias, 32**-0.5)
    torch.testing.assert_close(out, reference(q, keys, values, bias, 32**-0.5), atol=2e-6, rtol=0)


def test_the_batched_products_run_where_the_loops_do_not_apply(monkeypatch):
    q, keys, values, bias = step_case(rows=2, heads=2, groups=1, D=32, S=16)
    assert cpu_attention.attend(q.bfloat16(), keys.bfloat16(), values.bfloat16(), bias.bfloat16(), 0.2) is None
    assert cpu_attention.attend(q[:1], keys, values, bias, 0.2) is None  # rows that do not match: never read
    assert cpu_attention.attend(q, keys, values[:, :8], bias, 0.2) is None
    assert cpu_attention.attend(q.requires_grad_(), keys, values, bias, 0.2) is None
    monkeypatch.setenv(cpu_attention.SWITCH, "0")
    assert cpu_attention.attend(q.detach(), keys, values, bias, 0.2) is None


def test_a_compiler_that_fails_leaves_the_batched_products_and_says_why(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("CC", shutil.which("false"))
    monkeypatch.setenv("TINYLM_CACHE", str(tmp_path))
    cpu_attention.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="tinylm.models.cpu_attention"):
            q, keys, values, bias = step_case(rows=2, heads=2, groups=1, D=32, S=16)
            assert cpu_attention.attend(q, keys, values, bias, 0.2) is None
        assert "did not build" in caplog.text
    finally:
        cpu_attention.library.cache_clear()


@needs_cc
def test_a_decoding_step_and_its_tokens_are_the_same_without_the_loops(monkeypatch):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64, context_length=48, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, positions="rope"
    )
    model = GPT(cfg).eval()
    prompts = [[2, 7, 11, 5, 9, 4, 8], [3, 4], [5, 6, 7]]
    greedy = GenerationConfig(max_new_tokens=30, temperature=0)
    results, ran = {}, []
    attend = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda *a: ran.append(attend(*a) is not None) or attend(*a))
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_attention.SWITCH, switch)
        with torch.inference_mode():
            cache, last, positions = prefill(model, prompts, 16)
            model.prepare_for_decoding()
            step = decode_step(model, cache, last.argmax(-1), positions)
        results[switch] = step, [r.tokens for r in generate_many(model, prompts, greedy)]
    assert ran.count(True) == ran.count(False) > 0  # the loops ran in every step with the switch on
    torch.testing.assert_close(results["1"][0], results["0"][0], atol=2e-5, rtol=0)
    assert results["1"][1] == results["0"][1]


@needs_cc
def test_a_cache_folder_that_cannot_be_written_builds_in_a_private_temporary_folder(monkeypatch, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("TINYLM_CACHE", str(blocked))
    monkeypatch.setattr(cpu_attention.tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    cpu_attention.library.cache_clear()
    try:
        assert cpu_attention.library() is not None
        built = [p.parent for p in (tmp_path / "tmp").rglob("cpu_attention-*.so")]
        assert len(built) == 1 and built[0].name.startswith("tinylm-kernels-")  # mkdtemp's: a name no one guesses
        assert built[0].stat().st_mode & 0o777 == 0o700
    finally:
        cpu_attention.library.cache_clear()


@needs_cc
def test_the_step_s_own_keys_and_values_are_written_into_their_slot_in_the_same_pass():
    q, keys, values, bias = step_case(rows=3, heads=2, groups=2, D=32, S=20, seed=3)
    g = torch.Generator().manual_seed(4)
    new_keys, new_values = torch.randn(6, 32, generator=g), torch.randn(6, 32, generator=g)
    before_k, before_v = keys.clone(), values.clone()
    out = cpu_attention.attend(q, keys, values, bias, 0.2, (new_keys, new_values, torch.tensor([19])))
    assert torch.equal(keys[:, 19], new_keys) and torch.equal(values[:, 19], new_values)
    assert torch.equal(keys[:, :19], before_k[:, :19]) and torch.equal(values[:, :19], before_v[:, :19])
    torch.testing.assert_close(out, reference(q, keys, values, bias, 0.2), atol=2e-6, rtol=0)


@needs_cc
def test_new_keys_the_loops_cannot_write_leave_the_cache_as_it_was():
    """A slot past the slots read, or new keys of another shape or dtype: None, and nothing written
    (the caller then writes and computes with torch)."""
    q, keys, values, bias = step_case(rows=2, heads=2, groups=1, D=32, S=16)
    before = keys.clone()
    new = torch.ones(4, 32), torch.ones(4, 32)
    assert cpu_attention.attend(q, keys, values, bias, 0.2, (*new, torch.tensor([16]))) is None
    assert cpu_attention.attend(q, keys, values, bias, 0.2, (*new, torch.tensor([-1]))) is None
    assert cpu_attention.attend(q, keys, values, bias, 0.2, (new[0][:3], new[1][:3], torch.tensor([3]))) is None
    assert cpu_attention.attend(q, keys, values, bias, 0.2, (new[0].double(), new[1], torch.tensor([3]))) is None
    assert torch.equal(keys, before)


@needs_cc
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_prompts_joining_a_step_attend_in_the_loops_as_in_sdpa(monkeypatch, kv_heads):
    """Two prompts of different lengths join a running row: in the loops each token writes its key
    and value into its row's slot and attends over its own prompt up to itself, as SDPA's
    left-padded grid does (the logits and every cache slot agree, and the loops did run)."""
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, context_length=48, d_model=64, n_layers=2, n_heads=4, n_kv_heads=kv_heads)
    model = GPT(cfg).eval()
    greedy = GenerationConfig(max_new_tokens=20, temperature=0)
    attend, ran, out = cpu_attention.attend, [], {}

    def spy(*args, rows=None, **kwargs):
        result = attend(*args, rows=rows, **kwargs)
        if rows is not None:
            ran.append(result is not None)
        return result

    monkeypatch.setattr(cpu_attention, "attend", spy)
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_attention.SWITCH, switch)
        batch = Batch(model, max_batch=4)
        batch.step([Row([2, 7, 11, 5, 9, 4, 8, 3], greedy, lambda e: None)])
        for _ in range(3):
            batch.step()
        joining = [Row([3, 4, 5], greedy, lambda e: None), Row([5, 6, 7, 8, 9, 10], greedy, lambda e: None)]
        out[switch] = batch.forward(joining), [t.clone() for t in (*batch.cache.k, *batch.cache.v)]
    assert ran == [True, True, False, False]  # both layers in the loops, then both without
    torch.testing.assert_close(out["1"][0], out["0"][0], atol=2e-5, rtol=0)
    for with_loops, without in zip(out["1"][1], out["0"][1]):
        torch.testing.assert_close(with_loops, without, atol=2e-5, rtol=0)


@needs_cc
def test_prompt_rows_outside_the_cache_are_refused_and_write_nothing():
    """The loops index raw memory with the tokens' rows and slots: one out of range and the call
    returns None having written nothing (the caller's torch path runs)."""
    q, keys, values, _ = step_case(rows=3, heads=2, groups=1, D=32, S=12)
    bias = torch.zeros(2, 1, 12)
    new, before = (torch.ones(4, 32), torch.ones(4, 32)), keys.clone()
    good_rows, good_slots = torch.tensor([1, 1]), torch.tensor([4, 5])
    assert cpu_attention.attend(q[:4], keys, values, bias, 0.2, (*new, good_slots), rows=good_rows) is not None
    keys.copy_(before)
    assert cpu_attention.attend(q[:4], keys, values, bias, 0.2, (*new, good_slots), rows=torch.tensor([1, 3])) is None
    assert cpu_attention.attend(q[:4], keys, values, bias, 0.2, (*new, good_slots), rows=torch.tensor([-1, 0])) is None
    assert cpu_attention.attend(q[:4], keys, values, bias, 0.2, (*new, torch.tensor([4, 12])), rows=good_rows) is None
    assert cpu_attention.attend(q[:4], keys, values, bias, 0.2, (*new, torch.tensor([4])), rows=good_rows) is None
    assert torch.equal(keys, before)


@needs_cc
def test_asking_for_the_next_row_ahead_changes_no_number():
    """The loops ask for the next row's slots while working on a row (a hint to the caches):
    switched off for a comparison (``set_asking``), every output and written slot is the same."""
    q, keys, values, bias = step_case(rows=5, heads=2, groups=2, D=32, S=43, seed=5)
    g = torch.Generator().manual_seed(6)
    new = torch.randn(10, 32, generator=g), torch.randn(10, 32, generator=g), torch.tensor([42])
    lib, results = cpu_attention.library(), []
    try:
        for on in (1, 0):
            lib.set_asking(on)
            k, v = keys.clone(), values.clone()
            results.append((cpu_attention.attend(q, k, v, bias, 0.2, new), k, v))
    finally:
        lib.set_asking(1)
    for with_asks, without in zip(*results):
        assert torch.equal(with_asks, without)


PLANTED = """
#include <stdio.h>
__attribute__((constructor)) static void planted(void) {
    FILE *f = fopen("%s", "w");
    if (f) { fputs("loaded", f); fclose(f); }
}
"""


@needs_cc
def test_a_library_planted_in_a_shared_folder_is_never_loaded(tmp_path):
    """Another user of a course machine plants the library's file where a careless loader would
    look (the shared temporary folder, under the name anyone can compute, and a cache others may
    write): it is never loaded, and the loops built in a private folder of the process answer."""
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "planted.c"
    source.write_text(PLANTED % marker)
    name = cpu_attention.library_name(shutil.which("cc"))
    shared = Path(tempfile.gettempdir()) / "tinylm-kernels"
    shared.mkdir(exist_ok=True)
    open_cache = tmp_path / "open-cache"
    (open_cache / "kernels").mkdir(parents=True)
    (open_cache / "kernels").chmod(0o777)
    for folder in (shared, open_cache / "kernels"):
        subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / name), str(source)], check=True)
    (tmp_path / "a-file").write_text("not a folder")
    check = (
        "from tinylm.models import cpu_attention as c; lib = c.library(); "
        "print(lib is not None and '/tinylm-kernels-' in lib._name and lib._name.endswith(c.library_name('cc')))"
    )
    try:
        for cache in (tmp_path / "a-file", open_cache):  # a cache that cannot be created; one others may write
            env = {**os.environ, "TINYLM_CACHE": str(cache), "CC": "cc"}
            done = subprocess.run([sys.executable, "-c", check], env=env, capture_output=True, text=True, timeout=300)
            assert done.stdout.strip() == "True", done.stdout + done.stderr
            assert not marker.exists()
    finally:
        (shared / name).unlink(missing_ok=True)
