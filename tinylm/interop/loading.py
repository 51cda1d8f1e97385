"""Loading a model from any checkpoint tinylm reads, and writing one as a Hugging Face directory
(GPT-2, Llama, or Qwen3 for a Llama-shaped model with QK-norm; all three are read back).

``load_any_checkpoint(path, tokenizer_path=None) -> (model, tokenizer, source)`` is what
``tinylm generate``, ``evaluate``, ``export-hf`` and the benchmarks use. The tokenizer says how
to talk to the model (``bos_id``, ``stop_ids``, ``decode_with_prompt``): tinylm's own prepend
<sos>=2 and stop at <eos>=3; llama2.c's prepend BOS=1 and stop at BOS=1 or EOS=2 (its models
end a story by starting the next one with BOS, which is where run.c stops) and print
decode(prompt ids + new ids) as run.c does; a Hugging Face tokenizer uses its own BOS and EOS.
``source`` is ``{"format": "tinylm" | "llama2c" | "hf", ...}``, with a tinylm checkpoint's
``checkpoint.json`` under ``"meta"``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tinylm.errors import TinyLMError
from tinylm.interop.gpt2 import from_hf_gpt2, is_gpt2_shape, to_hf_gpt2
from tinylm.interop.llama import from_hf_llama, is_llama_shape, to_hf_llama
from tinylm.interop.llama2c import load_llama2c, looks_like_llama2c
from tinylm.models.checkpoint import load_checkpoint
from tinylm.models.short_context import load_short_context, looks_like_short_context
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.io import TOKENIZER_TYPES, load_tokenizer

TINYLM_TOKENIZER_IN_HF_DIR = "tinylm_tokenizer.json"  # written by export_hf next to the HF files


class HFTokenizerAdapter(Tokenizer):
    """A ``transformers`` tokenizer behind tinylm's tokenizer interface (encode, decode, start and
    stop ids); it cannot be trained or saved as a tinylm file."""

    type_name = "hf"

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.bos_id = hf_tokenizer.bos_token_id
        self.eos_id = hf_tokenizer.eos_token_id
        self.stop_ids = (self.eos_id,) if self.eos_id is not None else ()

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


HF_CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def load_hf_dir(path: str | Path):
    """A tinylm GPT from a Hugging Face GPT-2, Llama or Qwen3 model directory."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
        raise TinyLMError(f"{path}/config.json is missing or unreadable ({exc})") from exc
    kind = config.get("model_type") if isinstance(config, dict) else None
    if kind not in HF_CLASSES:
        raise TinyLMError(f"{path} holds a {kind!r} model; tinylm imports {', '.join(HF_CLASSES)}")
    import transformers  # deferred: transformers takes seconds to import

    hf_class = getattr(transformers, HF_CLASSES[kind])
    convert = from_hf_gpt2 if kind == "gpt2" else from_hf_llama
    try:  # transformers raises many kinds of errors on a damaged directory; keep the first line
        hf, info = hf_class.from_pretrained(path, output_loading_info=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:300]
        raise TinyLMError(
            f"{path} is not a loadable Hugging Face {kind} model ({type(exc).__name__}: {reason})"
        ) from exc
    damaged = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if damaged:  # transformers would fill missing weights with random ones
        raise TinyLMError(f"{path}: the weights do not match config.json ({damaged})"[:500])
    return convert(hf)


def _check_finite(model, where) -> None:
    """NaN/inf weights (a diverged run, a damaged file) would make sampling fail mid-way."""
    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise TinyLMError(
                f"{where} holds non-finite weights (nan/inf) in {name}; the run diverged or the file is corrupt"
            )


def _check_fits(tokenizer: Tokenizer, where, model) -> None:
    """A tokenizer must not produce ids the model has no embedding for."""
    if tokenizer.vocab_size > model.config.vocab_size:
        raise TinyLMError(
            f"tokenizer {where} has {tokenizer.vocab_size} pieces but the model's vocabulary "
            f"has {model.config.vocab_size}; give the tokenizer the model was trained with"
        )


def _hf_dir_tokenizer(path: Path):
    if (path / TINYLM_TOKENIZER_IN_HF_DIR).is_file():
        return load_tokenizer(path / TINYLM_TOKENIZER_IN_HF_DIR)
    try:
        from transformers import AutoTokenizer  # deferred: transformers takes seconds to import

        return HFTokenizerAdapter(AutoTokenizer.from_pretrained(path))
    except Exception as exc:
        raise TinyLMError(
            f"{path} has no tokenizer tinylm can load ({type(exc).__name__}); give one with --tokenizer"
        ) from exc


def _short_context_model(path: Path, tokenizer_path: str | Path | None):
    """An n-gram (.npz) or neural bigram (.pt) file with its tokenizer: ``tokenizer_path``, else the
    ``tokenizer.json`` beside it (where ``tinylm study shakespeare`` keeps both)."""
    tokenizer_path = tokenizer_path or path.parent / "tokenizer.json"
    if not Path(tokenizer_path).is_file():
        raise TinyLMError(
            f"{path} is an n-gram or bigram model and {tokenizer_path} does not exist; give its "
            "tokenizer with --tokenizer"
        )
    model = load_short_context(path)
    tokenizer = load_tokenizer(tokenizer_path)
    if tokenizer.vocab_size != model.config.vocab_size:
        raise TinyLMError(
            f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} pieces but the model {path} "
            f"({model.config.described}) has {model.config.vocab_size}; give the tokenizer it was "
            "trained with"
        )
    return model.eval(), tokenizer, {"format": model.config.kind}


def load_any_checkpoint(path: str | Path, tokenizer_path: str | Path | None = None, device="cpu"):
    """(model in eval mode, tokenizer, source) for a tinylm checkpoint or run directory, a llama2.c
    ``.bin`` checkpoint (needs ``tokenizer_path``: its ``tokenizer.bin``), an HF model directory
    (tokenizer from the directory, else ``tokenizer_path``), or an n-gram ``.npz`` / neural bigram
    ``.pt`` file (tokenizer ``tokenizer_path`` or the ``tokenizer.json`` beside it)."""
    path = Path(path)
    if not path.exists():
        raise TinyLMError(f"checkpoint {path} does not exist")
    if path.is_file() and looks_like_short_context(path):
        return _short_context_model(path, tokenizer_path)
    if path.is_file():
        if not looks_like_llama2c(path):
            raise TinyLMError(
                f"{path} is a file but not a llama2.c .bin checkpoint; give a tinylm checkpoint "
                "directory, a llama2.c .bin or a Hugging Face model directory"
            )
        if tokenizer_path is None:
            raise TinyLMError(
                f"{path} is a llama2.c checkpoint: give its tokenizer with --tokenizer (e.g. tokenizer.bin)"
            )
        model = load_llama2c(path)
        _check_finite(model, path)
        tokenizer = load_tokenizer(tokenizer_path)
        if tokenizer.vocab_size != model.config.vocab_size:
            raise TinyLMError(
                f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} pieces but the model "
                f"expects {model.config.vocab_size}"
            )
        return model.to(device), tokenizer, {"format": "llama2c"}
    if (path / "config.json").is_file() and not (path / "checkpoint.json").is_file():
        model = load_hf_dir(path)
        _check_finite(model, path)
        tokenizer = load_tokenizer(tokenizer_path) if tokenizer_path is not None else _hf_dir_tokenizer(path)
        _check_fits(tokenizer, tokenizer_path or path, model)
        return model.to(device), tokenizer, {"format": "hf"}
    model, tokenizer, meta = load_checkpoint(path, device=device)
    if tokenizer_path is not None:
        tokenizer = load_tokenizer(tokenizer_path)
        _check_fits(tokenizer, tokenizer_path, model)
    return model, tokenizer, {"format": "tinylm", "meta": meta}


def hf_family(cfg) -> str:
    """The Hugging Face model family a tinylm GPT of this shape is written as."""
    if is_gpt2_shape(cfg):
        return "GPT-2"
    if is_llama_shape(cfg):
        return "Qwen3" if cfg.qk_norm else "Llama"
    raise TinyLMError(
        "this model is neither GPT-2-shaped nor Llama-shaped (Llama, or Qwen3 with QK-norm); no Hugging Face "
        "class matches it"
    )


def export_hf(model, out_dir: str | Path, tokenizer=None) -> Path:
    """Write a tinylm GPT of GPT-2, Llama or Qwen3 shape as a Hugging Face model directory
    (``from_pretrained`` loads it with the same logits); a tinylm tokenizer is saved beside it,
    and its start and end ids go into the config."""
    if hf_family(model.config) == "GPT-2":
        hf = to_hf_gpt2(model)
    elif tokenizer is not None and tokenizer.bos_id is not None and tokenizer.eos_id is not None:
        hf = to_hf_llama(model, tokenizer.bos_id, tokenizer.eos_id)
    else:
        hf = to_hf_llama(model)
    out_dir = Path(out_dir)
    hf.save_pretrained(out_dir)
    # a tinylm JSON tokenizer travels with the model; llama2.c's binary one is not copied
    if tokenizer is not None and getattr(tokenizer, "type_name", "") in TOKENIZER_TYPES:
        tokenizer.save(out_dir / TINYLM_TOKENIZER_IN_HF_DIR)
    return out_dir
