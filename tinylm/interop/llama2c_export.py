"""A tinylm model as the two files llama2.c's ``run.c`` takes: a checkpoint ``.bin`` and a ``tok*.bin``.

A model whose tokenizer is already a llama2.c one (an imported llama2.c model) is written as it
is. A model trained with tinylm's byte-level BPE is brought to llama2.c's id layout, which run.c
assumes (BOS is id 1, the byte ``b`` falls back to id ``3 + b``): tinylm's ids are
``<pad> <unk> <sos> <eos>``, the 256 bytes, then one per merge, so every id moves down by one and
``<pad>`` goes last. The embedding and classifier rows move with their ids, which leaves the
model's function unchanged; ``<sos>`` becomes llama2.c's BOS and ``<eos>`` its EOS.

The BPE becomes a scored vocabulary: the piece made by merge ``k`` scores ``-k`` (run.c merges
the highest-scoring pair first, as BPE applies its lowest-ranked merge first), the specials score
below run.c's floor so no merge ever forms them, bytes are written as themselves (so that two
byte pieces concatenate into the merge's piece). What run.c does differently from tinylm's BPE:
it prepends sentencepiece's dummy-prefix space to a prompt, does not pre-split text with a regex
(a merge may then cross a word boundary when the joined string is a piece) and merges any pair
that spells a piece; ``tinylm.tokenizers.llama2c.Llama2cTokenizer`` reproduces it, so a caller
can check a prompt's ids before relying on them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tinylm.errors import TinyLMError
from tinylm.interop.llama2c import BOS_ID, EOS_ID, save_llama2c
from tinylm.models.gpt import GPT
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.bpe import BYTE_BASE, BPETokenizer
from tinylm.tokenizers.llama2c import BYTE_FALLBACK_BASE, Llama2cTokenizer

NEVER_MERGED = -1e10  # run.c only merges into a piece scoring above this


def bpe_to_llama2c(tok: BPETokenizer, vocab_size: int) -> tuple[Llama2cTokenizer, list[int]]:
    """The llama2.c vocabulary of a tinylm BPE for a model with ``vocab_size`` rows, and the row
    order: llama2.c id ``j`` is tinylm id ``order[j]``."""
    if BYTE_BASE - 1 != BYTE_FALLBACK_BASE or (tok.sos_id, tok.eos_id) != (BOS_ID + 1, EOS_ID + 1):
        raise TinyLMError("this BPE's special ids do not map onto llama2.c's layout")
    if vocab_size < tok.vocab_size:
        raise TinyLMError(f"the tokenizer has {tok.vocab_size} tokens but the model only {vocab_size} rows")
    order = list(range(1, vocab_size)) + [tok.pad_id]
    pieces, scores = [], []
    for old in order:
        if old < BYTE_BASE:
            pieces.append(tok.special_tokens[old].encode())
            scores.append(NEVER_MERGED)
        elif old < tok.vocab_size:
            raw = tok.token_bytes[old]
            # run.c's C strings cannot hold NUL: that byte keeps sentencepiece's <0x00> spelling
            pieces.append(b"<0x00>" if raw == b"\0" else raw)
            scores.append(0.0 if len(raw) == 1 else -float(old - BYTE_BASE - 256))
        else:  # model rows no token uses
            pieces.append(f"<unused{old}>".encode())
            scores.append(NEVER_MERGED)
    return Llama2cTokenizer(pieces, scores), order


def reorder_vocabulary(model: GPT, order: list[int]) -> GPT:
    """A copy of ``model`` whose token ``j`` is the original's ``order[j]``."""
    out = GPT(model.config)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    index = torch.tensor(order)
    state["tok_emb.weight"] = state["tok_emb.weight"][index]
    state["lm_head.weight"] = state["tok_emb.weight"] if model.config.tie_weights else state["lm_head.weight"][index]
    out.load_state_dict(state, strict=True)
    return out.eval()


def llama2c_files(model: GPT, tokenizer: Tokenizer | None) -> tuple[GPT, Llama2cTokenizer]:
    """The model and tokenizer in llama2.c's id layout."""
    if isinstance(tokenizer, Llama2cTokenizer):
        return model, tokenizer
    if isinstance(tokenizer, BPETokenizer):
        tok, order = bpe_to_llama2c(tokenizer, model.config.vocab_size)
        return reorder_vocabulary(model, order), tok
    kind = getattr(tokenizer, "type_name", None)
    raise TinyLMError(
        f"a {kind or 'missing'} tokenizer has no llama2.c equivalent; export-llama2c takes a model "
        "with a tinylm byte-level BPE (type bpe) or a llama2.c tokenizer.bin"
    )


def export_llama2c(
    model: GPT, tokenizer: Tokenizer | None, out: str | Path, tokenizer_out: str | Path, version: int = 0
) -> tuple[Path, Path]:
    """Write ``out`` (a llama2.c checkpoint; version 0 is what run.c reads) and ``tokenizer_out``
    (its ``tok*.bin``)."""
    model, tok = llama2c_files(model, tokenizer)
    out, tokenizer_out = Path(out), Path(tokenizer_out)
    for p in (out, tokenizer_out):
        p.parent.mkdir(parents=True, exist_ok=True)
    save_llama2c(model, out, version=version)
    tok.save(tokenizer_out)
    return out, tokenizer_out
