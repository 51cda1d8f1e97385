"""Models from elsewhere: Hugging Face GPT-2 / Llama directories and llama2.c checkpoints.

``load_any_checkpoint(path, tokenizer_path=None) -> (model, tokenizer, info)`` is what the CLI's
``generate`` and ``evaluate`` use. ``info`` says how to talk to the model:

    format       "tinylm" | "llama2c" | "hf"
    bos_id       the id put in front of every prompt / scored document (tinylm: <sos>=2,
                 llama2.c: BOS=1, HF: the tokenizer's BOS or None)
    stop_ids     ids that end generation (tinylm: <eos>=3; llama2.c: BOS=1 and EOS=2, since
                 llama2.c's models end a story by starting the next one with BOS, which is where
                 run.c stops)
    decode_with_prompt  True when the output text is decode(prompt ids + new ids) (llama2.c:
                 how run.c prints); False when it is the prompt string + decode(new ids)

``score_texts`` is the evaluation adapter: tinylm's perplexity protocol (each document scored on
its own from its start token) with the start token taken from ``info`` instead of <sos>.
"""

from __future__ import annotations

import json
from pathlib import Path

from tinylm.errors import TinyLMError

TINYLM_TOKENIZER_IN_HF_DIR = "tinylm_tokenizer.json"  # written by export_hf next to the HF files


class HFTokenizerAdapter:
    """A ``transformers`` tokenizer behind tinylm's encode / decode / vocab_size interface."""

    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        self.bos_id = hf_tokenizer.bos_token_id
        self.eos_id = hf_tokenizer.eos_token_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


def _load_tokenizer_file(path: str | Path):
    from tinylm.tokenizers.base import load_tokenizer
    from tinylm.tokenizers.llama2c import Llama2cTokenizer, is_llama2c_file

    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"tokenizer file {path} does not exist")
    if is_llama2c_file(path):
        return Llama2cTokenizer.from_file(path)
    return load_tokenizer(path)


def _protocol(tokenizer, fmt: str, **extra) -> dict:
    from tinylm.tokenizers.base import EOS_ID, SOS_ID
    from tinylm.tokenizers.llama2c import Llama2cTokenizer

    if isinstance(tokenizer, Llama2cTokenizer):
        return {"format": fmt, "bos_id": 1, "stop_ids": [1, 2], "decode_with_prompt": True, **extra}
    if isinstance(tokenizer, HFTokenizerAdapter):
        stop = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        return {"format": fmt, "bos_id": tokenizer.bos_id, "stop_ids": stop, "decode_with_prompt": False, **extra}
    return {"format": fmt, "bos_id": SOS_ID, "stop_ids": [EOS_ID], "decode_with_prompt": False, **extra}


def load_hf_dir(path: str | Path):
    """A tinylm GPT from a Hugging Face GPT-2 or Llama model directory."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TinyLMError(f"{path}/config.json is missing or unreadable ({exc})") from exc
    kind = config.get("model_type")
    if kind == "gpt2":
        from transformers import GPT2LMHeadModel

        from tinylm.interop.gpt2 import from_hf_gpt2

        return from_hf_gpt2(GPT2LMHeadModel.from_pretrained(path))
    if kind == "llama":
        from transformers import LlamaForCausalLM

        from tinylm.interop.llama import from_hf_llama

        return from_hf_llama(LlamaForCausalLM.from_pretrained(path))
    raise TinyLMError(f"{path} holds a {kind!r} model; tinylm imports gpt2 and llama")


def load_any_checkpoint(path: str | Path, tokenizer_path: str | Path | None = None, device="cpu"):
    """(model in eval mode, tokenizer, info) for a tinylm checkpoint or run directory, a llama2.c
    ``.bin`` checkpoint (needs ``tokenizer_path``: its ``tokenizer.bin``), or an HF model directory
    (tokenizer from the directory, else ``tokenizer_path``)."""
    from tinylm.interop.llama2c import load_llama2c, looks_like_llama2c

    path = Path(path)
    if not path.exists():
        raise TinyLMError(f"checkpoint {path} does not exist")
    if path.is_file():
        if not looks_like_llama2c(path):
            raise TinyLMError(f"{path} is a file but not a llama2.c .bin checkpoint; give a tinylm checkpoint "
                              "directory, a llama2.c .bin or a Hugging Face model directory")
        if tokenizer_path is None:
            raise TinyLMError(f"{path} is a llama2.c checkpoint: give its tokenizer with --tokenizer (e.g. tokenizer.bin)")
        model = load_llama2c(path)
        tokenizer = _load_tokenizer_file(tokenizer_path)
        if tokenizer.vocab_size != model.config.vocab_size:
            raise TinyLMError(f"tokenizer {tokenizer_path} has {tokenizer.vocab_size} pieces but the model "
                              f"expects {model.config.vocab_size}")
        return model.to(device), tokenizer, _protocol(tokenizer, "llama2c")
    if (path / "config.json").is_file() and not (path / "checkpoint.json").is_file():
        model = load_hf_dir(path)
        if tokenizer_path is not None:
            tokenizer = _load_tokenizer_file(tokenizer_path)
        elif (path / TINYLM_TOKENIZER_IN_HF_DIR).is_file():
            tokenizer = _load_tokenizer_file(path / TINYLM_TOKENIZER_IN_HF_DIR)
        else:
            try:
                from transformers import AutoTokenizer

                tokenizer = HFTokenizerAdapter(AutoTokenizer.from_pretrained(path))
            except Exception as exc:
                raise TinyLMError(f"{path} has no tokenizer tinylm can load ({type(exc).__name__}); "
                                  "give one with --tokenizer") from exc
        return model.to(device), tokenizer, _protocol(tokenizer, "hf")
    from tinylm.training.checkpoint import load_checkpoint

    model, tokenizer, meta = load_checkpoint(path, device=device)
    if tokenizer_path is not None:
        tokenizer = _load_tokenizer_file(tokenizer_path)
    return model, tokenizer, _protocol(tokenizer, "tinylm", meta=meta)


def export_hf(model, out_dir: str | Path, tokenizer=None) -> Path:
    """Write a tinylm GPT of GPT-2 or Llama shape as a Hugging Face model directory
    (``from_pretrained`` loads it with the same logits); a tinylm tokenizer is saved beside it."""
    from tinylm.interop.gpt2 import is_gpt2_shape, to_hf_gpt2
    from tinylm.interop.llama import is_llama_shape, to_hf_llama

    if is_gpt2_shape(model.config):
        hf = to_hf_gpt2(model)
    elif is_llama_shape(model.config):
        hf = to_hf_llama(model)
    else:
        raise TinyLMError("this model is neither GPT-2-shaped nor Llama-shaped; no Hugging Face class matches it")
    out_dir = Path(out_dir)
    hf.save_pretrained(out_dir)
    # a tinylm JSON tokenizer travels with the model; llama2.c's binary one is not copied
    if tokenizer is not None and getattr(tokenizer, "type_name", "") in ("bpe", "char", "word"):
        tokenizer.save(out_dir / TINYLM_TOKENIZER_IN_HF_DIR)
    return out_dir


def score_texts(model, tokenizer, texts: list[str], info: dict, batch_size: int = 32) -> dict:
    """tinylm's perplexity metrics with the model's own start token (BOS=1 for llama2.c)."""
    from tinylm.evaluation.perplexity import metrics, score_token_documents

    start = [info["bos_id"]] if info.get("bos_id") is not None else []
    docs = [start + list(tokenizer.encode(t)) for t in texts]
    nll, tokens = score_token_documents(model, docs, batch_size=batch_size)
    return metrics(nll, tokens, sum(len(t.encode("utf-8")) for t in texts), sum(len(t.split()) for t in texts))


__all__ = ["HFTokenizerAdapter", "export_hf", "load_any_checkpoint", "load_hf_dir", "score_texts"]
