"""GGUF files for llama.cpp from Llama-shaped tinylm models, written with the ``gguf`` package.

The file uses llama.cpp's ``llama`` architecture, or ``qwen3`` for a model with QK-norm: tensor
names and metadata keys come from ``gguf.constants`` (``MODEL_ARCH.LLAMA``, ``MODEL_ARCH.QWEN3``,
whose layers add ``attn_q_norm`` and ``attn_k_norm``), weights keep their ``(out, in)`` rows as
``convert_hf_to_gguf`` writes them. llama.cpp's llama graph rotates consecutive pairs (its
"normal" rope), which is tinylm's layout, so q and k are written as they are (converting from
Hugging Face permutes their rows to get the same layout); its qwen3 graph rotates half-split
pairs (NEOX rope), so there the rows of q and k and the QK-norm gains are permuted to Hugging
Face's layout. A QK-norm without gain is written with gains of ones (when its epsilon is the
model's, see ``tinylm.interop.llama``).

Tokenizers: tinylm's byte-level BPE becomes GGUF's ``gpt2`` model (tokens spelled with GPT-2's
byte -> character table, merges in rank order, pre-tokenizer ``gpt-2``, which is the regex tinylm
splits with by default); a llama2.c tokenizer becomes the ``llama`` (sentencepiece) model with
its scores, byte pieces and dummy prefix; a tinylm word tokenizer becomes the ``bert``
(WordPiece) model, every word one token at its id. llama.cpp's WordPiece splits text at every
punctuation mark, so it encodes contractions ("didn't") differently from tinylm; fed tinylm's ids
the model is the same. Rows of the model beyond the tokenizer's vocabulary get unused
placeholder tokens, as llama.cpp needs one token per row.

Precision: ``f32``; ``f16`` (matrices in float16, norm weights stay float32 as llama.cpp
expects); ``q8_0`` (matrices quantized by ``gguf.quants`` in blocks of 32 along each row; a matrix
whose rows are not a multiple of 32 long is written in float16).

Architecture options neither llama.cpp graph has a place for are refused by name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, get_args

import numpy as np

from tinylm.config import ModelConfig
from tinylm.errors import TinyLMError
from tinylm.interop.llama import llama_state, meta_to_hf_rows, non_qwen3_options, permute_rotary
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.bpe import BPETokenizer
from tinylm.tokenizers.hf_interop import byte_to_unicode
from tinylm.tokenizers.llama2c import BYTE_FALLBACK_BASE, Llama2cTokenizer
from tinylm.tokenizers.word import WordTokenizer

GgufDtype = Literal["f32", "f16", "q8_0"]
GGUF_DTYPES = get_args(GgufDtype)
# tinylm BPE split pattern -> the llama.cpp pre-tokenizer that splits text the same way
PRE_TOKENIZERS = {"gpt2": "gpt-2"}
# (tinylm name inside a block, gguf MODEL_TENSOR member name); llama.cpp stores q, k, v and gate,
# up separately: the fused matrices are split into their parts (``state_dict_by_parts``)
LAYER_TENSORS = [
    ("norm1.weight", "ATTN_NORM"),
    ("attn.q_proj.weight", "ATTN_Q"),
    ("attn.k_proj.weight", "ATTN_K"),
    ("attn.v_proj.weight", "ATTN_V"),
    ("attn.out_proj.weight", "ATTN_OUT"),
    ("norm2.weight", "FFN_NORM"),
    ("ffn.gate.weight", "FFN_GATE"),
    ("ffn.up.weight", "FFN_UP"),
    ("ffn.down.weight", "FFN_DOWN"),
]
QWEN3_TENSORS = [("attn.q_norm", "ATTN_Q_NORM"), ("attn.k_norm", "ATTN_K_NORM")]
WORDPIECE_SPACE = "\u2581"  # llama.cpp's WordPiece tokenizer looks every word up with this before it
# keys llama.cpp reads for its WordPiece tokenizer that the gguf package has no constant for
NORMALIZER_LOWERCASE, NORMALIZER_STRIP_ACCENTS = (
    "tokenizer.ggml.normalizer.lowercase",
    "tokenizer.ggml.normalizer.strip_accents",
)


def _gguf():
    try:
        import gguf  # deferred: only the exporter needs it (a dev extra)
    except ImportError as exc:
        raise TinyLMError("writing GGUF needs the `gguf` package (pip install gguf)") from exc
    return gguf


def check_gguf_exportable(cfg: ModelConfig) -> None:
    bad = non_qwen3_options(cfg)
    if bad:
        raise TinyLMError(
            f"llama.cpp's {'qwen3' if cfg.qk_norm else 'llama'} architecture has no equivalent of "
            + ", ".join(bad)
            + "; only Llama-shaped models (rope, rmsnorm, swiglu, no biases; Qwen3's with QK-norm) export to GGUF"
        )


def model_tensors(model) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, float32 array) of every weight, in llama.cpp's order; no ``output`` when tied."""
    gguf = _gguf()
    names, T, cfg = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR, model.config
    sd = llama_state(model)
    if cfg.qk_norm:  # llama.cpp's qwen3 graph rotates half-split pairs (its NEOX rope), as Hugging Face does
        sd = permute_rotary(sd, cfg, meta_to_hf_rows)
    sd = {k: v.numpy() for k, v in sd.items()}
    out = [(names[T.TOKEN_EMBD] + ".weight", sd["tok_emb.weight"])]
    for i in range(cfg.n_layers):
        out += [
            (names[getattr(T, member)].format(bid=i) + ".weight", sd[f"blocks.{i}.{ours}"])
            for ours, member in LAYER_TENSORS + (QWEN3_TENSORS if cfg.qk_norm else [])
        ]
    out.append((names[T.OUTPUT_NORM] + ".weight", sd["norm_f.weight"]))
    if not model.config.tie_weights:
        out.append((names[T.OUTPUT] + ".weight", sd["lm_head.weight"]))
    return out


def encode_tensor(array: np.ndarray, dtype: GgufDtype):
    """(data, GGML type) for one weight: vectors stay float32; matrices follow ``dtype``."""
    gguf = _gguf()
    Q = gguf.GGMLQuantizationType
    if array.ndim == 1 or dtype == "f32":
        return array.astype(np.float32), Q.F32
    if dtype == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[Q.Q8_0][0] == 0:
        return gguf.quants.quantize(array.astype(np.float32), Q.Q8_0), Q.Q8_0
    return array.astype(np.float16), Q.F16


def _padding_tokens(start: int, stop: int) -> list[tuple[str, int, float]]:
    return [(f"[PAD{i}]", _gguf().TokenType.UNUSED, 0.0) for i in range(start, stop)]


def bpe_vocabulary(tok: BPETokenizer, vocab_size: int) -> tuple[list[tuple[str, int, float]], list[str]]:
    """GGUF ``gpt2`` tokens (text, type, score) and merges of a tinylm byte-level BPE."""
    if tok.pattern not in PRE_TOKENIZERS:
        raise TinyLMError(
            f"the tokenizer splits text with pattern {tok.pattern!r}; llama.cpp has a matching "
            f"pre-tokenizer only for {', '.join(PRE_TOKENIZERS)}"
        )
    table, kind = byte_to_unicode(), _gguf().TokenType
    visible = ["".join(table[b] for b in raw) for raw in tok.token_bytes]
    if len(set(visible[len(tok.special_tokens) :])) < len(visible) - len(tok.special_tokens):
        raise TinyLMError(
            "two BPE merges build the same string; llama.cpp maps a string to one token, so this "
            "tokenizer cannot be written as a GGUF gpt2 vocabulary"
        )
    tokens = [(s, kind.CONTROL, 0.0) for s in tok.special_tokens]
    tokens += [(v, kind.NORMAL, 0.0) for v in visible[len(tok.special_tokens) :]]
    merges = [f"{visible[a]} {visible[b]}" for a, b in tok.merges]
    return tokens + _padding_tokens(len(tokens), vocab_size), merges


def llama2c_vocabulary(tok: Llama2cTokenizer, vocab_size: int) -> list[tuple[str, int, float]]:
    """GGUF ``llama`` tokens of a llama2.c tokenizer: ids 0-2 the unknown and control tokens, ids
    3-258 run.c's byte fallback: ``<0xNN>`` BYTE tokens, except a printable ASCII character spelled
    as itself (as export-llama2c writes a BPE's bytes), which llama.cpp must find as text; spaces
    are written "▁" as sentencepiece does."""
    kind = _gguf().TokenType
    tokens = [("<unk>", kind.UNKNOWN, 0.0), ("<s>", kind.CONTROL, 0.0), ("</s>", kind.CONTROL, 0.0)]
    for i in range(len(tokens), tok.vocab_size):
        piece, byte = tok.pieces[i], i - BYTE_FALLBACK_BASE
        if 0 <= byte < 256 and not (len(piece) == 1 and 0x20 <= piece[0] < 0x7F):
            tokens.append((f"<0x{byte:02X}>", kind.BYTE, tok.scores[i]))
            continue
        tokens.append((piece.decode("utf-8", errors="replace").replace(" ", "\u2581"), kind.NORMAL, tok.scores[i]))
    return tokens + _padding_tokens(len(tokens), vocab_size)


def word_vocabulary(tok: WordTokenizer, vocab_size: int) -> list[tuple[str, int, float]]:
    """GGUF ``bert`` (WordPiece) tokens of a tinylm word tokenizer, at tinylm's ids: every word
    spelled "▁word", so llama.cpp finds a vocabulary word whole and makes any other word the
    unknown token; the specials by name; the pieces of ``oov="bpe"`` as themselves."""
    kind, words = _gguf().TokenType, set(tok.word_ids)
    controls = {tok.pad_id, tok.sos_id, tok.eos_id}
    tokens = []
    for i in range(tok.vocab_size):
        piece = tok.id_to_piece(i)
        if i == tok.unk_id:
            tokens.append((piece, kind.UNKNOWN, 0.0))
        elif i in controls:
            tokens.append((piece, kind.CONTROL, 0.0))
        else:
            tokens.append((WORDPIECE_SPACE + piece if i in words else piece, kind.NORMAL, 0.0))
    return tokens + _padding_tokens(len(tokens), vocab_size)


def add_tokenizer(writer, tokenizer: Tokenizer | None, vocab_size: int) -> None:
    if isinstance(tokenizer, BPETokenizer):
        tokens, merges = bpe_vocabulary(tokenizer, vocab_size)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(PRE_TOKENIZERS[tokenizer.pattern])
        writer.add_token_merges(merges)
        writer.add_pad_token_id(tokenizer.pad_id)
    elif isinstance(tokenizer, Llama2cTokenizer):
        tokens = llama2c_vocabulary(tokenizer, vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_add_space_prefix(True)
    elif isinstance(tokenizer, WordTokenizer):
        tokens = word_vocabulary(tokenizer, vocab_size)
        writer.add_tokenizer_model("bert")
        writer.add_bool(NORMALIZER_LOWERCASE, tokenizer.lowercase)
        writer.add_bool(NORMALIZER_STRIP_ACCENTS, False)
        writer.add_add_sep_token(False)
        writer.add_sep_token_id(tokenizer.eos_id)  # llama.cpp ends every WordPiece text it tokenizes with it
        writer.add_pad_token_id(tokenizer.pad_id)
    else:
        kind = getattr(tokenizer, "type_name", None)
        raise TinyLMError(
            f"a {kind or 'missing'} tokenizer has no GGUF equivalent; GGUF export takes a tinylm "
            "byte-level BPE (type bpe), a tinylm word tokenizer or a llama2.c tokenizer.bin"
        )
    if len(tokens) > vocab_size:
        raise TinyLMError(f"the tokenizer has {len(tokens)} tokens but the model only {vocab_size} rows")
    writer.add_token_list([t[0] for t in tokens])
    writer.add_token_types([t[1] for t in tokens])
    writer.add_token_scores([t[2] for t in tokens])
    writer.add_unk_token_id(tokenizer.unk_id)
    writer.add_bos_token_id(tokenizer.bos_id)
    writer.add_eos_token_id(tokenizer.eos_id)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)


def add_hyperparameters(writer, cfg: ModelConfig, dtype: GgufDtype) -> None:
    gguf = _gguf()
    head_dim = cfg.d_attn // cfg.n_heads
    writer.add_name("tinylm")
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.d_model)
    writer.add_block_count(cfg.n_layers)
    writer.add_feed_forward_length(cfg.d_ff)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    file_type = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0"}[dtype]
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def export_gguf(model, path: str | Path, tokenizer: Tokenizer | None, dtype: GgufDtype = "f32") -> Path:
    """Write a Llama-shaped tinylm GPT and its tokenizer as one GGUF file llama.cpp loads."""
    if dtype not in GGUF_DTYPES:
        raise TinyLMError(f"GGUF dtype {dtype!r} is not one of {', '.join(GGUF_DTYPES)}")
    cfg = model.config.resolved()
    check_gguf_exportable(cfg)
    gguf = _gguf()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = gguf.MODEL_ARCH.QWEN3 if cfg.qk_norm else gguf.MODEL_ARCH.LLAMA
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    try:
        add_hyperparameters(writer, cfg, dtype)
        add_tokenizer(writer, tokenizer, cfg.vocab_size)
        for name, array in model_tensors(model):
            data, kind = encode_tensor(array, dtype)
            writer.add_tensor(name, data, raw_dtype=kind)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path
