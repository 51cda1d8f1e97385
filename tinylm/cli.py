"""`tinylm`: every subcommand in one place, each a typed function over a dataclass of options.

A subcommand's options are the fields of the dataclass its function takes; the parser is built
from those fields (type, default, help), so what `--help` shows is what the function receives.
Run configuration goes through tinylm.config: `--config` (a preset name or a YAML file),
`--quick` (the preset's quick section) and `section.key=value` overrides, checked key by key.

A ``TinyLMError`` (bad file, config, checkpoint, prompt) or a bad option prints one line and
exits with code 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import logging
import math
import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import torch

from tinylm import __version__
from tinylm.config import (
    GenerationConfig,
    build_config,
    check_range,
    config_value,
    field_types,
    knob_names,
    option,
    preset_names,
)
from tinylm.courses.check import check_adapter, fresh_seed, passed, summary, write_json
from tinylm.courses.classroom import ClassRun, check_class, markdown, saved_seed, write_kit, write_reports
from tinylm.courses.evaluate import evaluate_adapter, finite, format_report
from tinylm.data.corpora import load_text_file
from tinylm.data.prepare import prepare as prepare_data
from tinylm.errors import TinyLMError
from tinylm.evaluation.perplexity import evaluate_texts
from tinylm.evaluation.plots import attention_html, attention_maps, save_attention_pngs
from tinylm.evaluation.protocol import SAMPLING_TEMPERATURES, BleuProtocol, Decoding, format_bleu, run_bleu
from tinylm.evaluation.report import write_run_report
from tinylm.generation.generate import TextStream, complete, encode_prompt, prompt_head
from tinylm.interop.gguf_export import GgufDtype, export_gguf
from tinylm.interop.llama2c_export import export_llama2c
from tinylm.interop.loading import export_hf, hf_family, load_any_checkpoint
from tinylm.models.checkpoint import load_checkpoint
from tinylm.models.quantize import InferenceDtype, to_inference_dtype
from tinylm.pipeline import run_pipeline
from tinylm.studies.shakespeare import run_study
from tinylm.studies.study_config import load_study_config
from tinylm.studies.tinystories import PARTS, load_experiment_config, run_experiments
from tinylm.studies.tinystories_report import write_experiments_report
from tinylm.tokenizers.hf_interop import save_hf_tokenizer
from tinylm.tokenizers.io import load_tokenizer
from tinylm.tokenizers.stats import collect, format_table, train_spec
from tinylm.training.resume import resume_run_config

log = logging.getLogger("tinylm")


# --------------------------------------------------------------------------- options -> argparse
# what a field's metadata says to argparse beside its help and range, and the value when not given
OPTION_DEFAULTS = {"flag": None, "positional": False, "nargs": None, "metavar": None, "required": False, "group": None}


def opt(help: str, default: Any = None, **extra: Any):
    """A dataclass field that is also a command-line option (or positional argument): ``extra``
    holds OPTION_DEFAULTS' keys and the bounds (ge, gt, le, lt) of its range; a ``Literal`` type
    gives its choices, both checked as it is parsed."""
    unknown = set(extra) - set(OPTION_DEFAULTS) - {"ge", "gt", "le", "lt", "factory"}
    if unknown:  # a misspelt keyword would otherwise be stored and never read
        raise TypeError(f"opt() got unknown keyword(s) {sorted(unknown)}")
    return option(default, help, **{**OPTION_DEFAULTS, **extra})


def _converter(kind: Any, name: str, bounds: tuple | None) -> Callable[[str], Any]:
    def convert(text: str):
        try:
            value = config_value(name, text, kind)
            check_range(name, value, bounds)
        except TinyLMError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return convert


def _item_type(kind: Any) -> tuple[Any, bool]:
    """The type of one value of an option, and whether the option holds a list of them."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):
        kind = next(a for a in typing.get_args(kind) if a is not type(None))
    if typing.get_origin(kind) in (list, tuple):
        return typing.get_args(kind)[0], True
    return kind, False


def add_options(parser: argparse.ArgumentParser, options: type) -> None:
    """One argument per field of the ``options`` dataclass."""
    hints = field_types(options)
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(options):
        meta = f.metadata
        target = (
            groups.setdefault(meta["group"], parser.add_argument_group(meta["group"])) if meta.get("group") else parser
        )
        item, is_list = _item_type(hints[f.name])
        flag = meta.get("flag") or "--" + f.name.replace("_", "-")
        shown = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        inverted = item is bool and flag.startswith("--no-")
        suffix = (
            f" (default: {shown})"
            if shown not in (None, False, [], (), "") and not meta["positional"] and not inverted
            else ""
        )
        kw: dict[str, Any] = {"help": meta["help"] + suffix}
        if meta.get("metavar"):
            kw["metavar"] = meta["metavar"]
        if typing.get_origin(item) is Literal:
            kw["choices"] = list(typing.get_args(item))
        elif item in (int, float):
            kw["type"] = _converter(item, flag if not meta["positional"] else f.name, meta.get("range"))
        if meta["positional"]:
            target.add_argument(f.name, nargs=meta.get("nargs"), **kw)
            continue
        kw["dest"] = f.name
        if item is bool:
            target.add_argument(flag, action="store_false" if inverted else "store_true", **kw)
        elif is_list:
            target.add_argument(
                flag, **({"nargs": meta["nargs"]} if meta.get("nargs") else {"action": "append"}), default=None, **kw
            )
        else:
            target.add_argument(flag, default=f.default, required=meta.get("required", False), **kw)
    parser.set_defaults(_options=options)


def options_from(ns: argparse.Namespace, options: type):
    values = {}
    for f in dataclasses.fields(options):
        value = getattr(ns, f.name)
        if value is None:  # a list option given no value: its default
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        values[f.name] = tuple(value) if isinstance(f.default, tuple) else value
    return options(**values)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: `tinylm generate: error: ... (see --help)`, exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


COMMANDS: dict[str, Callable[[Any], int]] = {}


def command(name: str):
    """Register a subcommand; its options are the dataclass its parameter is annotated with."""

    def register(fn):
        COMMANDS[name] = fn
        return fn

    return register


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tinylm", description="Build, train, evaluate and run small language models.")
    parser.add_argument("--version", action="version", version=f"tinylm {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for name, fn in COMMANDS.items():
        doc = (fn.__doc__ or "").strip()
        p = sub.add_parser(name, help=doc.splitlines()[0], description=doc)
        first = next(iter(inspect.signature(fn).parameters))
        add_options(p, typing.get_type_hints(fn)[first])
        p.set_defaults(_run=fn)
    return parser


class _Stderr(logging.StreamHandler):
    """Progress goes to stderr, so stdout holds only results (`--json` output stays parseable);
    it writes to whatever sys.stderr is at the time (tests swap it), not the one seen at start."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _setup_logging() -> None:
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # `tinylm train --out DIR model.d_model=96` puts overrides after an option; argparse stops
    # collecting a positional list at the first option, so the stragglers are picked up here
    try:
        ns, extra = parser.parse_known_args(argv)
        if extra:
            if hasattr(ns, "overrides") and all("=" in item and not item.startswith("-") for item in extra):
                ns.overrides = list(ns.overrides or []) + extra
            else:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help (0) or a bad option (2, already printed on one line)
        return int(exc.code or 0)
    _setup_logging()
    try:
        return ns._run(options_from(ns, ns._options))
    except TinyLMError as exc:
        print(f"tinylm {ns.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# ---------------------------------------------------------------------------------- run commands
@dataclass
class RunOptions:
    config: str | None = opt(f"preset ({', '.join(preset_names())}) or YAML/TOML file of RunConfig fields")
    out: str | None = opt("run directory (overrides out_dir)")
    quick: bool = opt("apply the preset's quick section: a smaller model and a short run")
    overrides: list[str] = opt(
        "e.g. model.d_model=128 train.max_steps=200", [], positional=True, nargs="*", metavar="section.key=value"
    )


def _run_config(opts: RunOptions):
    cfg = build_config(opts.config, opts.overrides, quick=opts.quick)
    if opts.out:
        cfg.out_dir = opts.out
    return cfg


@dataclass
class DemoOptions(RunOptions):
    config: str | None = opt("preset or YAML file (default: the demo preset)", "demo")


@command("demo")
def demo(opts: DemoOptions) -> int:
    """Shakespeare end to end: corpus, tokenizer, GPT, perplexity, samples, report."""
    cfg = _run_config(opts)
    summary = run_pipeline(cfg, cfg.out_dir)
    print(
        f"\ndemo finished in {summary['total_seconds']:.0f} s; everything is in {cfg.out_dir}/ "
        f"(report.md, metrics.csv, samples.txt, checkpoints/)"
    )
    print(f"play with it in a browser: tinylm serve --checkpoint {cfg.out_dir}   (then open http://127.0.0.1:8000)")
    return 0


@command("prepare")
def prepare(opts: RunOptions) -> int:
    """Corpus, cleaning, splits, tokenizer and token cache, written into the run directory."""
    cfg = _run_config(opts)
    prepare_data(cfg, cfg.out_dir)
    return 0


@dataclass
class TrainOptions(RunOptions):
    resume: str | None = opt("continue from a checkpoint (or the newest one in a run directory)", metavar="DIR")
    force: bool = opt("with --resume: accept changed keys such as train.max_steps")
    precision: Literal["fp32", "bf16", "fp16"] | None = opt(
        "the same as train.precision=... (bf16 autocast, fp16 on CUDA)"
    )
    compile: bool = opt("the same as train.compile=true: torch.compile the training step")


@command("train")
def train(opts: TrainOptions) -> int:
    """Prepare (cached), train, evaluate, sample and report."""
    shortcuts = [f"train.precision={opts.precision}"] if opts.precision else []
    shortcuts += ["train.compile=true"] if opts.compile else []
    opts = dataclasses.replace(opts, overrides=list(opts.overrides) + shortcuts)
    if opts.resume:
        cfg, ckpt, _ = resume_run_config(opts.resume, opts.config, opts.overrides, force=opts.force, quick=opts.quick)
        if opts.out:
            cfg.out_dir = opts.out
        run_pipeline(cfg, cfg.out_dir, resume=ckpt, force=opts.force)
        return 0
    if opts.force:
        raise TinyLMError("--force only applies together with --resume DIR")
    cfg = _run_config(opts)
    run_pipeline(cfg, cfg.out_dir)
    return 0


# ---------------------------------------------------------------------------------- generate
@dataclass
class ModelOptions:
    checkpoint: str = opt(
        "tinylm checkpoint or run directory, llama2.c .bin, or Hugging Face model directory", required=True
    )
    tokenizer: str | None = opt("tokenizer file (required for a llama2.c .bin: its tokenizer.bin)")


# `tinylm generate`'s defaults where they differ from GenerationConfig's
GENERATE_DEFAULTS = {"temperature": 0.8, "seed": 0}


def _decoding_field(f: dataclasses.Field) -> tuple[str, Any, Any]:
    """A GenerationConfig field as an option of `tinylm generate`: its help, range and flag."""
    bounds = {k: v for k, v in zip(("ge", "gt", "le", "lt"), f.metadata["range"]) if v is not None}
    flag = knob_names("cli")[f.name]
    cli = opt(
        f.metadata["help"],
        GENERATE_DEFAULTS.get(f.name, f.default),
        flag=flag,
        group="decoding",
        metavar="TEXT" if flag == "--stop" else None,
        **bounds,
    )
    return f.name, field_types(GenerationConfig)[f.name], cli


# Every GenerationConfig knob the command line offers (config.GENERATION_SURFACES names the exceptions)
DecodingOptions = dataclasses.make_dataclass(
    "DecodingOptions", [_decoding_field(f) for f in dataclasses.fields(GenerationConfig) if f.name in knob_names("cli")]
)


@dataclass
class GenerateOptions(ModelOptions, DecodingOptions):
    prompt: list[str] = opt("prompt text (repeatable)", [])
    prompts_file: str | None = opt("one prompt per line")
    batch_size: int = opt("prompts generated together (left-padded)", 1, ge=1)
    stream: bool = opt("print text as tokens arrive")
    json: bool = opt("one JSON object per result (text, tokens, tokens_per_s)")
    threads: int | None = opt("torch threads (default: torch's choice)", ge=1)
    dtype: InferenceDtype = opt(
        "weights for decoding: bfloat16 halves their memory, int8 quarters it (CPU; "
        "activations rounded to 8 bits per token too); both shift the numbers slightly "
        "(bits per byte: benchmarks/bench_generate.py)",
        "float32",
    )


def decoding_config(opts: DecodingOptions, stop_ids=()) -> GenerationConfig:
    """The command's decoding options, with the tokenizer's stop ids beside the ones given."""
    knobs = {f.name: getattr(opts, f.name) for f in dataclasses.fields(DecodingOptions)}
    return GenerationConfig(**{**knobs, "stop_ids": tuple(stop_ids) + tuple(opts.stop_ids)})


def _read_prompts(opts: GenerateOptions) -> list[str]:
    prompts = list(opts.prompt)
    if opts.prompts_file:
        path = Path(opts.prompts_file)
        if not path.is_file():
            raise TinyLMError(f"prompts file {path} does not exist")
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise TinyLMError(f"prompts file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
        prompts += [line for line in lines if line.strip()]
    if not prompts:
        raise TinyLMError("give at least one --prompt or a --prompts-file")
    return prompts


@command("generate")
def generate(opts: GenerateOptions) -> int:
    """Continue prompts with a tinylm, llama2.c .bin or Hugging Face checkpoint."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    model, tokenizer, _ = load_any_checkpoint(opts.checkpoint, opts.tokenizer)
    model = to_inference_dtype(model, opts.dtype)
    prompts = _read_prompts(opts)
    cfg = decoding_config(opts, tokenizer.stop_ids).validate(model.config.vocab_size)
    if opts.stream and not opts.json:
        if opts.beam_width > 1:
            raise TinyLMError("--stream works with sampling/greedy only, not with --beam-width > 1")
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(tokenizer, prompt)
            sys.stdout.write(prompt_head(tokenizer, prompt, ids))
            sys.stdout.flush()
            stream = TextStream(
                model,
                lambda new, ids=ids: tokenizer.decode_continuation(ids, new),
                ids,
                dataclasses.replace(cfg, seed=opts.seed + i, seed_per_row=True),
            )
            for piece in stream:
                sys.stdout.write(piece)
                sys.stdout.flush()
            sys.stdout.write("\n\n")
        return 0
    for c in complete(model, tokenizer, prompts, cfg, batch_size=opts.batch_size):
        for i, r in enumerate(c.results):
            if not opts.json:
                print(c.text(tokenizer, i) + "\n")
                continue
            row = {
                "prompt": c.prompt,
                "text": c.text(tokenizer, i),
                "tokens": len(r.tokens),
                "token_ids": r.tokens,
                "tokens_per_s": round(c.tokens_per_s, 1),
                "finish_reason": r.finish_reason,
            }
            print(json.dumps(row, ensure_ascii=False))
    return 0


# ---------------------------------------------------------------------------------- evaluate
@dataclass
class EvaluateOptions(ModelOptions):
    checkpoint: str | None = opt(
        "tinylm checkpoint or run directory, llama2.c .bin, or Hugging Face model directory (or --adapter)"
    )
    data: str = opt("text file (TinyStories format: each story scored alone), or .jsonl", required=True)
    adapter: str | None = opt(
        "a student's adapter file instead of --checkpoint: its model_* functions (tinylm check --init's template), "
        "run in their own process",
        metavar="ADAPTER.py",
    )
    batch_size: int = opt("documents scored together", 32, ge=1)
    max_docs: int | None = opt("score only the first N documents", ge=1)
    json: bool = opt("print one JSON object")
    bleu: bool = opt("prompt with the first tokens of each story, continue, score BLEU", group="BLEU protocol")
    samples: int = opt("stories to use", BleuProtocol.n_samples, ge=1, group="BLEU protocol")
    prompt_tokens: int = opt(
        "prompt = the story's first N tokens", BleuProtocol.prompt_tokens, ge=1, group="BLEU protocol"
    )
    max_continuation: int | None = opt(
        "cap on reference/continuation tokens (default: the rest of the story)",
        BleuProtocol.max_continuation,
        ge=1,
        group="BLEU protocol",
    )
    selection: Literal["random", "first"] = opt(
        "which stories: drawn at random with --seed, or the first N", BleuProtocol.selection, group="BLEU protocol"
    )
    temperature: list[float] = opt(
        f"sampling temperature, repeatable (default {', '.join(map(str, SAMPLING_TEMPERATURES))}); 0 is greedy",
        [],
        ge=0,
        group="BLEU protocol",
    )
    top_k: int | None = opt("sample from the k most likely tokens", ge=1, group="BLEU protocol")
    beam_width: list[int] = opt(
        "also decode with beam search of this width (repeatable)", [], ge=1, group="BLEU protocol"
    )
    smoothing: Literal["method1", "exp", "none"] = opt("for BLEU-1..4", BleuProtocol.smoothing, group="BLEU protocol")
    seed: int = opt("draws the stories; sample k decodes with seed + k", BleuProtocol.seed, group="BLEU protocol")
    csv_dir: str = opt("where bleu_samples_<setting>.csv go", ".", group="BLEU protocol")
    decode_threads: int = opt(
        "torch threads while decoding (token-by-token decoding is many small ops, which "
        "slow down with more threads on a busy CPU)",
        1,
        ge=1,
        group="BLEU protocol",
    )


METRICS = ("token_ppl", "bpb", "word_ppl", "tokens", "bytes", "words")


def _finite_or_reason(m: dict) -> tuple[dict, dict]:
    """JSON has no infinity: an overflowing perplexity becomes null, with the reason beside it."""
    values, reasons = {}, {}
    for k in METRICS:
        v = m[k]
        if isinstance(v, float) and not math.isfinite(v):
            values[k] = None
            reasons[k] = (
                f"{v} (the mean NLL per unit is too large for exp(); the model finds this text extremely unlikely)"
                if v == math.inf
                else f"{v} (nothing to average over)"
            )
        else:
            values[k] = v
    return values, reasons


@command("evaluate")
def evaluate(opts: EvaluateOptions) -> int:
    """Token perplexity, bits per byte and word perplexity on a file (and the BLEU protocol)."""
    if (opts.checkpoint is None) == (opts.adapter is None):
        raise TinyLMError("give one of --checkpoint or --adapter")
    docs = load_text_file(opts.data)[: opts.max_docs]
    if not docs:
        raise TinyLMError(f"{opts.data} holds no document to score")
    if opts.adapter:
        return _evaluate_adapter(opts, docs)
    model, tokenizer, _ = load_any_checkpoint(opts.checkpoint, opts.tokenizer)
    m = evaluate_texts(model, tokenizer, docs, batch_size=opts.batch_size)
    bleu = None
    if opts.bleu:
        torch.set_num_threads(opts.decode_threads)
        bleu = run_bleu(model, tokenizer, docs, *_bleu_protocol(opts))
    if opts.json:
        values, reasons = _finite_or_reason(m)
        print(
            json.dumps({**values, **({"not_finite": reasons} if reasons else {}), **({"bleu": bleu} if bleu else {})})
        )
        return 0
    print(f"documents        {len(docs):,}")
    print(f"token perplexity {m['token_ppl']:.4f}   (exp of mean NLL over {m['tokens']:,} tokens)")
    print(f"bits per byte    {m['bpb']:.4f}   (over {m['bytes']:,} UTF-8 bytes)")
    print(f"word perplexity  {m['word_ppl']:.4f}   (over {m['words']:,} whitespace-separated words)")
    if bleu:
        print()
        print(format_bleu(bleu))
    return 0


def _bleu_protocol(opts: EvaluateOptions) -> tuple[BleuProtocol, list[Decoding], Path]:
    """The BLEU protocol the options ask for, its decoding settings and where the CSVs go."""
    protocol = BleuProtocol(
        opts.samples, opts.prompt_tokens, opts.max_continuation, opts.seed, opts.smoothing, opts.selection
    )
    settings = [
        Decoding("greedy" if t == 0 else f"T{t:g}", temperature=t, top_k=opts.top_k)
        for t in (opts.temperature or SAMPLING_TEMPERATURES)
    ]
    settings += [Decoding(f"beam{k}", beam_width=k) for k in opts.beam_width]
    return protocol, settings, Path(opts.csv_dir)


def _evaluate_adapter(opts: EvaluateOptions, docs: list[str]) -> int:
    """A student's model on the same protocol (its code in its own process)."""
    if opts.tokenizer:
        raise TinyLMError("--adapter brings its own tokenizer (model_encode, model_decode); drop --tokenizer")
    bleu = _bleu_protocol(opts) if opts.bleu else None
    result = evaluate_adapter(opts.adapter, docs, batch_size=opts.batch_size, bleu=bleu)
    if opts.json:
        values = finite({k: v for k, v in result.items() if k != "bleu"})  # BLEU's numbers are finite
        print(json.dumps({**values, **({"bleu": result["bleu"]} if "bleu" in result else {})}))
        return 0
    print(format_report(result, len(docs)))
    if result.get("bleu"):
        print()
        print(format_bleu(result["bleu"]))
    return 0


# ---------------------------------------------------------------------------- models and reports
@dataclass
class ExportOptions(ModelOptions):
    out: str = opt("output directory (config.json + model.safetensors)", required=True)


@command("export-hf")
def export_hf_dir(opts: ExportOptions) -> int:
    """Write a GPT-2-, Llama- or Qwen3-shaped checkpoint as a Hugging Face model directory."""
    model, tokenizer, _ = load_any_checkpoint(opts.checkpoint, opts.tokenizer)
    out = export_hf(model, opts.out, tokenizer)
    print(f"wrote a Hugging Face {hf_family(model.config)} model ({model.num_parameters():,} parameters) to {out}")
    try:
        save_hf_tokenizer(tokenizer, out, model.config.context_length)
        print(f"wrote its tokenizer as {out}/tokenizer.json (+ tokenizer_config.json): AutoTokenizer loads it")
    except TinyLMError as exc:  # the model is still usable with tinylm's tokenizer file beside it
        print(f"no Hugging Face tokenizer.json: {exc}")
    return 0


@dataclass
class ExportTokenizerOptions(ModelOptions):
    out: str = opt("output directory", required=True)
    hf: bool = opt(
        "write Hugging Face files (tokenizer.json, tokenizer_config.json, special_tokens_map.json) that "
        "transformers' AutoTokenizer loads with the same ids; otherwise tinylm's own tokenizer file"
    )


@command("export-tokenizer")
def export_tokenizer(opts: ExportTokenizerOptions) -> int:
    """Write a model's tokenizer, for tools that count tokens on their side (e.g. lm-evaluation-harness)."""
    model, tokenizer, _ = load_any_checkpoint(opts.checkpoint, opts.tokenizer)
    out = Path(opts.out)
    hf = getattr(tokenizer, "hf", None)  # a Hugging Face model directory's own tokenizer
    if opts.hf and hf is not None:
        hf.save_pretrained(out)
    elif opts.hf:
        save_hf_tokenizer(tokenizer, out, model.config.context_length)  # or refused, saying why
    elif hf is not None:
        raise TinyLMError(f"{opts.checkpoint} uses a Hugging Face tokenizer, which has no tinylm file; use --hf")
    else:
        out.mkdir(parents=True, exist_ok=True)
        tokenizer.save(out / ("tokenizer.bin" if tokenizer.type_name == "llama2c" else "tokenizer.json"))
    print(
        f"wrote the {tokenizer.type_name} tokenizer ({tokenizer.vocab_size:,} ids) "
        f"{'as Hugging Face files ' if opts.hf else ''}to {out}"
    )
    return 0


@dataclass
class ExportGgufOptions(ModelOptions):
    out: str = opt("output .gguf file", required=True)
    dtype: GgufDtype = opt(
        "weight matrices in float32, float16 or llama.cpp's 8-bit Q8_0 (norm weights stay float32)", "f32"
    )


@command("export-gguf")
def export_gguf_file(opts: ExportGgufOptions) -> int:
    """Write a Llama- or Qwen3-shaped checkpoint and its tokenizer as one GGUF file for llama.cpp."""
    model, tokenizer, _ = load_any_checkpoint(opts.checkpoint, opts.tokenizer)
    out = export_gguf(model, opts.out, tokenizer, opts.dtype)
    print(f"wrote a llama.cpp GGUF model ({opts.dtype}, {model.num_parameters():,} parameters) to {out}")
    return 0


@dataclass
class ExportLlama2cOptions(ModelOptions):
    out: str = opt("output checkpoint .bin (run.c's first argument)", required=True)
    tokenizer_out: str | None = opt("output tokenizer .bin (run.c's -z; default: tok<vocab size>.bin beside --out)")
    version: int = opt("llama2.c format: 0 is the one run.c reads, 1 has export.py's 256-byte header", 0, ge=0, le=1)


@command("export-llama2c")
def export_llama2c_files(opts: ExportLlama2cOptions) -> int:
    """Write a Llama-shaped checkpoint as a llama2.c model .bin and tokenizer .bin for run.c."""
    model, tokenizer, _ = load_any_checkpoint(opts.checkpoint, opts.tokenizer)
    tok_out = opts.tokenizer_out or Path(opts.out).with_name(f"tok{model.config.vocab_size}.bin")
    out, tok_out = export_llama2c(model, tokenizer, opts.out, tok_out, opts.version)
    print(
        f"wrote a llama2.c version-{opts.version} model ({model.num_parameters():,} parameters) to {out} "
        f"and its tokenizer to {tok_out}"
    )
    return 0


@dataclass
class ReportOptions:
    run_dir: str = opt("a run directory of tinylm train, demo or experiments", positional=True)


@command("report")
def report(opts: ReportOptions) -> int:
    """(Re)write report.md and report.html for a run directory."""
    run = Path(opts.run_dir)
    if not run.is_dir():
        raise TinyLMError(f"run directory {run} does not exist")
    write = write_experiments_report if (run / "experiments.json").is_file() else write_run_report
    md, page, missing = write(run)
    print(md)
    print(page)
    if missing:
        print(f"INCOMPLETE: {len(missing)} part(s) missing (the report says so at the top):")
        for m in missing:
            print(f"  - {m}")
    return 0


@dataclass
class AttentionOptions:
    checkpoint: str = opt("checkpoint directory or run directory", required=True)
    text: str = opt("the sentence to look at (must fit in the context)", required=True)
    out: str = opt("output directory", "attention")
    html: bool = opt("also write one self-contained page to browse layers and heads")


@command("attention")
def attention(opts: AttentionOptions) -> int:
    """Attention maps of a text: a PNG grid per layer, optionally one HTML page."""
    model, tokenizer, _ = load_checkpoint(opts.checkpoint)
    maps = attention_maps(model, tokenizer, opts.text)
    out = Path(opts.out)
    for path in save_attention_pngs(maps, out):
        print(path)
    if opts.html:
        print(attention_html(maps, out / "attention.html"))
    print(f"{maps.n_layers} layers x {maps.n_heads} heads over {len(maps.tokens)} tokens: {' '.join(maps.tokens)}")
    return 0


# ------------------------------------------------------------------------------------- serve
@dataclass
class ServeOptions:
    checkpoint: list[str] = opt("any checkpoint `tinylm generate` takes; repeatable (models are chosen by name)", [])
    name: list[str] = opt(
        "the i-th --checkpoint's model name in the API (default: its run's directory name, "
        "runs/x/checkpoints/ema -> x)",
        [],
    )
    tokenizer: list[str] = opt(
        "the i-th goes with the i-th --checkpoint (a llama2.c .bin needs one; 'none' for a "
        "checkpoint that brings its own)",
        [],
    )
    host: str = opt("address to bind; anything but loopback exposes the API (use --api-key)", "127.0.0.1")
    port: int = opt("TCP port", 8000, ge=0, le=65535)
    api_key: str | None = opt("require `Authorization: Bearer KEY` on every /v1 call")
    threads: int | None = opt("torch threads (default: torch's choice)", ge=1)
    max_batch: int = opt("rows decoded together at most (requests beyond wait their turn)", 32, ge=1)
    max_tokens: int = opt("refuse max_tokens above this", 512, ge=1)
    max_choices: int = opt("refuse requests asking for more choices (prompts x n)", 16, ge=1)
    max_body_bytes: int = opt("refuse bodies larger than this (413)", 1_000_000, ge=1)
    max_score_tokens: int = opt(
        "refuse requests that would score more tokens than this (413): echo with logprobs, /v1/score, /v1/tinylm/score",
        16_384,
        ge=1,
    )
    runs: str | None = opt(
        "a directory of runs (e.g. runs): the Runs view draws their curves as they train and loads their checkpoints",
        metavar="DIR",
    )
    dtype: InferenceDtype = opt("weights of the --checkpoint models, as for `tinylm generate --dtype`", "float32")
    compile: bool = opt(
        "torch.compile the decoding step of the --checkpoint models, its shapes in a few buckets "
        "(a context up to 256 compiles them all at start-up, ~10 s each on 2 cores; docs/serving.md)"
    )
    engine: Literal["process", "thread"] = opt(
        "where the models decode: 'process', an engine process apart from the HTTP server (no GIL "
        "shared with streaming); 'thread', a thread of the server process (to compare with)",
        "process",
    )


def serve_models(models, host: str, port: int, limits, api_key: str | None, runs) -> None:
    """Serve ``models`` (a ModelSpecs) until interrupted (tinylm.serving.app.serve)."""
    from tinylm.serving.app import serve as serve_app  # deferred: it imports FastAPI (see serve)

    serve_app(models, host, port, limits, api_key, runs)


@command("serve")
def serve(opts: ServeOptions) -> int:
    """The playground page and an OpenAI-compatible API for one or more models (FastAPI + uvicorn)."""
    if opts.threads:
        torch.set_num_threads(opts.threads)
    if opts.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "WARNING: serving on %s, reachable from other machines, %s",
            opts.host,
            "API calls need the API key" if opts.api_key else "WITHOUT AUTHENTICATION (give --api-key)",
        )
    if opts.runs is not None and not Path(opts.runs).is_dir():
        raise TinyLMError(f"--runs {opts.runs}: no such directory")
    # deferred, here and in serve_models: the server's modules import FastAPI and pydantic, which
    # no other command needs (`tinylm --version` and `tinylm train` start without them)
    from tinylm.serving.completions import Limits
    from tinylm.serving.engine import ModelSpecs
    from tinylm.serving.models import model_specs
    from tinylm.serving.state import RunsRoot

    # with --runs alone, models come from the Runs view's load buttons
    specs = (
        model_specs(opts.checkpoint, opts.tokenizer, opts.max_batch, opts.name, opts.dtype, opts.compile)
        if opts.checkpoint or not opts.runs
        else {}
    )
    models = ModelSpecs(specs, opts.engine, opts.threads)
    limits = Limits(opts.max_tokens, opts.max_choices, opts.max_body_bytes, opts.max_score_tokens)
    runs = RunsRoot(Path(opts.runs), opts.max_batch) if opts.runs else None
    serve_models(models, opts.host, opts.port, limits, opts.api_key, runs)
    return 0


# ----------------------------------------------------------------------------------- studies
@dataclass
class ExperimentsOptions(RunOptions):
    config: str | None = opt("experiments preset or YAML file (e.g. tinystories-assignment)")
    only: str | None = opt(
        f"comma-separated parts to (re)run, from {','.join(PARTS)}; the baseline is always run or cached"
    )


@command("experiments")
def experiments(opts: ExperimentsOptions) -> int:
    """The TinyStories assignment: train, BLEU, decoding, KV cache, accumulation, checkpointing, attention."""
    cfg, exp = load_experiment_config(opts.config, opts.overrides, quick=opts.quick)
    if opts.out:
        cfg.out_dir = opts.out
    only = [p.strip() for p in opts.only.split(",") if p.strip()] if opts.only else None
    words = ([f"--config {opts.config}"] if opts.config else []) + (["--quick"] if opts.quick else [])
    words += ([f"--out {opts.out}"] if opts.out else []) + list(opts.overrides)
    words += [f"--only {opts.only}"] if opts.only else []  # the report names the parts this invocation ran
    manifest = run_experiments(
        cfg, exp, cfg.out_dir, quick=opts.quick, only=only, command="tinylm experiments " + " ".join(words)
    )
    for name, status in manifest["parts"].items():
        print(f"  {name:<14} {status}")
    return 0


@dataclass
class StudyOptions:
    corpus: Literal["shakespeare"] = opt("the corpus of the study", positional=True)
    config: str = opt(
        "study preset (shakespeare-study, shakespeare-report) or YAML file of StudyConfig fields", "shakespeare-study"
    )
    quick: bool = opt("the preset's quick section (every stage on a few plays, under 90 s)")
    out: str | None = opt("run directory (default: the preset's out_dir)")
    gpt_minutes: float | None = opt("training budget of each GPT (gpt.minutes)", ge=0)
    gpt: bool = opt("the GPT stage; --no-gpt skips it (gpt.enabled=false)", True, flag="--no-gpt")
    bpe_merges: list[int] | None = opt("e.g. 1000 2000 3000", nargs="+", ge=1)
    threads: int | None = opt("torch threads", ge=1)
    overrides: list[str] = opt(
        "StudyConfig fields, e.g. ngram.orders=[1,2] tokenizers.word_vocab=4000",
        [],
        positional=True,
        nargs="*",
        metavar="key=value",
    )


@command("study")
def study(opts: StudyOptions) -> int:
    """The four-stage Shakespeare study: tokenizers, n-grams, neural bigram, GPT."""
    shortcuts = {
        "out_dir": opts.out,
        "gpt.minutes": opts.gpt_minutes,
        "threads": opts.threads,
        "tokenizers.bpe_merges": json.dumps(opts.bpe_merges) if opts.bpe_merges else None,
        "gpt.enabled": None if opts.gpt else "false",
    }
    words = [f"{key}={value}" for key, value in shortcuts.items() if value is not None]
    cfg = load_study_config(opts.config, list(opts.overrides) + words, quick=opts.quick)
    run_study(cfg)
    return 0


@dataclass
class TokenizerStatsOptions:
    tokenizer: list[str] = opt(
        "tokenizer file (tinylm JSON, llama2.c tokenizer.bin, HF tokenizer.json) or run directory; repeatable",
        [],
        metavar="T",
    )
    train: list[str] = opt(
        "train a tokenizer on the first --data split, e.g. bpe:1260 (1,000 merges); repeatable",
        [],
        metavar="TYPE:VOCAB",
    )
    data: list[str] = opt(
        "a split's text file (.txt, .jsonl, TinyStories format); repeatable, e.g. --data train=opts.txt",
        [],
        metavar="[NAME=]FILE",
    )
    json: bool = opt("print the rows as JSON instead of a table")


@command("tokenizer-stats")
def tokenizer_stats(opts: TokenizerStatsOptions) -> int:
    """Vocabulary, tokens per word, bytes per token, <unk> rate and round trip, per tokenizer and split."""
    if not opts.tokenizer and not opts.train:
        raise TinyLMError("give at least one --tokenizer FILE or --train TYPE:VOCAB")
    if not opts.data:
        raise TinyLMError("give at least one --data [NAME=]FILE")
    splits: dict[str, list[str]] = {}
    for spec in opts.data:
        name, sep, path = spec.partition("=")
        name, path = (name, path) if sep else (Path(spec).stem, spec)
        docs = [d for d in load_text_file(path) if d]
        if not docs:
            raise TinyLMError(f"data file {path} holds no text")
        splits[name] = docs
    tokenizers = {spec: load_tokenizer(spec) for spec in opts.tokenizer}
    first = next(iter(splits.values()))
    tokenizers.update({spec: train_spec(spec, first) for spec in opts.train})
    rows = collect(tokenizers, splits)
    print(json.dumps(rows, indent=1) if opts.json else format_table(rows))
    return 0


@dataclass
class CheckOptions:
    adapter: str | None = opt(
        "the student's adapter file: a filled copy of tinylm/courses/adapter_template.py",
        positional=True,
        nargs="?",
    )
    parts: str | None = opt("comma-separated parts to check (default: every part)", metavar="A,B")
    json: str | None = opt("also write the verdicts to this JSON file", metavar="PATH")
    timeout: float = opt("seconds each part may run before it counts as timed out", 30.0, gt=0)
    memory_gb: float = opt("memory the adapter's process may take beyond what torch maps, in GiB", 4.0, gt=0)
    class_dir: str | None = opt(
        "check every student of DIR (DIR/NAME/adapter.py or DIR/NAME.py) and write one table: DIR/check.md, "
        "check.html, check.json, check.csv, and each student's verdicts in DIR/check-results/",
        flag="--class",
        metavar="DIR",
    )
    jobs: int = opt("with --class: students checked at once (default: the number of CPUs)", 0, ge=0)
    budget: float | None = opt("with --class: seconds each student may take, all parts together", gt=0)
    resume: bool = opt(
        "with --class: keep the verdicts DIR/check-results already holds (same parts; their seed unless --seed)", False
    )
    seed: int | None = opt("the inputs' seed, to repeat a run (default: a fresh one, printed)", ge=0)
    data: str | None = opt(
        "with --class: also score each student's model (its model_* functions) on this text file", metavar="FILE"
    )
    init: str | None = opt("write the adapter template and a README for students into DIR", metavar="DIR")


@command("check")
def check(opts: CheckOptions) -> int:
    """Check a student's own model, training and generation parts against tinylm's, naming the mistake."""
    chosen = [
        name for name, value in (("ADAPTER", opts.adapter), ("--class", opts.class_dir), ("--init", opts.init)) if value
    ]
    if len(chosen) != 1:
        raise TinyLMError(
            "give one of ADAPTER, --class DIR or --init DIR" + (f" (got {', '.join(chosen)})" if chosen else "")
        )
    if opts.data and not opts.class_dir:
        raise TinyLMError("--data goes with --class (one student's model: tinylm evaluate --adapter)")
    parts = [name.strip() for name in opts.parts.split(",") if name.strip()] if opts.parts else None
    memory = int(opts.memory_gb * 2**30)
    if opts.init:
        for path in write_kit(opts.init):
            print(f"wrote {path}")
        return 0
    seed = opts.seed
    if seed is None and opts.resume and opts.class_dir:
        seed = saved_seed(opts.class_dir)  # the stopped run's inputs
    seed = fresh_seed() if seed is None else seed
    print(f"seed {seed} (--seed {seed} repeats these inputs)", file=sys.stderr)
    if opts.class_dir:
        texts = load_text_file(opts.data) if opts.data else None
        run = ClassRun(parts, opts.timeout, memory, texts, opts.jobs, opts.budget, opts.resume, seed)
        students = check_class(opts.class_dir, run)
        paths = write_reports(opts.class_dir, students, bool(texts))
        print(markdown(students, bool(texts)))
        print(f"wrote {', '.join(str(p) for p in paths)}")
        return 0 if all(passed(s.results) for s in students) else 1
    results = []
    for result in check_adapter(opts.adapter, parts, opts.timeout, memory, output=sys.stderr.buffer, seed=seed):
        print(result.line(), flush=True)  # one line per part as it is judged: a slow part shows where it is
        results.append(result)
    print(summary(results))
    if opts.json:
        write_json(opts.json, opts.adapter, results, seed)
    return 0 if passed(results) else 1


if __name__ == "__main__":
    sys.exit(main())
