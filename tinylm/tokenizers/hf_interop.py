"""Exchange tokenizers with Hugging Face ``tokenizers`` and ``transformers``.

Export: a tinylm ``BPETokenizer`` becomes a ``tokenizer.json`` that ``tokenizers.Tokenizer.from_file``
loads and that gives the same ids: the same split regex (a ``Split`` pre-tokenizer, "isolated"),
then ``ByteLevel`` without its own regex (bytes shown as GPT-2's printable characters), a BPE model
whose ranks are tinylm's merge order, and the four specials as special added tokens with ids 0-3.
A ``CharTokenizer`` becomes a BPE model without merges whose vocabulary is tinylm's (specials,
the 256 bytes as ``<0xNN>``, the characters) with byte fallback: a character outside the
vocabulary is its UTF-8 bytes, as in tinylm. A ``WordTokenizer`` (regex splitter, ``oov="unk"``)
becomes a ``WordLevel`` model over tinylm's ids with ``<unk>`` for the rest, behind a ``Lowercase``
normaliser when it lowercases and a ``Split`` that keeps the pattern's matches (Python's word and
space classes spelled as the Unicode categories they mean, since Oniguruma's differ on combining
marks and on the separators U+001C-U+001F), punctuation dropped when the tokenizer drops it; its
decoder re-joins words as tinylm's does. The raw ``tokenizer.json`` recognises special strings in the input (for BPE:
tinylm's ``encode(text, allowed_special="all")``).

``save_hf_tokenizer`` writes the directory ``AutoTokenizer.from_pretrained`` loads: the
``tokenizer.json`` plus ``tokenizer_config.json`` naming the start (bos), end (eos), unknown and
padding tokens, with ``split_special_tokens`` so that special strings in text are plain text,
as in tinylm's ``encode``: the same ids on any text. As with GPT-2's tokenizer, nothing is added
around the text (no start token): a caller puts ``bos_token_id`` first where tinylm would.

Refused, with the reason: ``word_bpe``, which normalises the text, so a token count or a byte
count of the text would not be the model's; a word tokenizer with spaCy's splitter or with BPE
pieces for unknown words (``oov="bpe"``), which no Hugging Face model reproduces; and
llama2.c's ``tokenizer.bin``, whose merge rule (run.c: the best-scoring pair anywhere, ties to
the leftmost, merging through BOS) has no exact Hugging Face equivalent.

Import: a HF byte-level BPE ``tokenizer.json`` becomes a tinylm ``BPETokenizer`` that splits text
into the same pieces. Ids are renumbered into tinylm's layout (specials, 256 bytes, merges);
``hf_id_map`` on the result maps tinylm ids to the file's ids. When two HF merges build the same
string (HF gives both one id), tinylm keeps one id per merge and repeats later merges for every
spelling, so segmentation is unchanged.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

from tinylm.constants import SPECIAL_TOKENS
from tinylm.errors import TinyLMError
from tinylm.tokenizers.bpe import BYTE_BASE, FIRST_MERGE_ID, SPLIT_PATTERNS, BPETokenizer, total_pattern
from tinylm.tokenizers.char import CharTokenizer
from tinylm.tokenizers.word import NO_SPACE_BEFORE, WORD_PATTERN, WordTokenizer

_MAX_ALIAS_MERGES = 100_000  # guard against a pathological file blowing up the alias expansion


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by HF ``ByteLevel``: printable
    Latin-1 bytes stand for themselves, the other 68 take code points 256, 257, ... in byte order."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    others = [b for b in range(256) if b not in keep]
    return {b: chr(b) if b in keep else chr(256 + others.index(b)) for b in range(256)}


def _visible(raw: bytes, table: dict[int, str]) -> str:
    return "".join(table[b] for b in raw)


# ------------------------------------------------------------------------------------- export
REFUSALS = {
    "word_bpe": "a word_bpe tokenizer normalises the text (case, punctuation, spacing) before splitting it, "
    "so a Hugging Face copy could not count the bytes and tokens the model scores",
    "llama2c": "llama2.c's merge rule (the best-scoring pair anywhere, ties to the leftmost, merging through "
    "BOS) has no exact Hugging Face equivalent; use the model's original Hugging Face tokenizer",
}


def _tokenizers_modules():
    try:
        import tokenizers  # optional dependency
    except ImportError as exc:
        raise TinyLMError("exporting to Hugging Face needs the `tokenizers` package (pip install tokenizers)") from exc
    return tokenizers


def _bpe_to_hf(tok: BPETokenizer, hf_lib):
    table = byte_to_unicode()
    vocab: dict[str, int] = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    for i in range(BYTE_BASE, tok.vocab_size):
        text = _visible(tok.token_bytes[i], table)
        if text in vocab:
            raise TinyLMError(
                f"token {i} ({tok.id_to_piece(i)!r}) has the same bytes as token {vocab[text]}; "
                "a Hugging Face vocabulary cannot hold two ids for one string"
            )
        vocab[text] = i
    merges = [(_visible(tok.token_bytes[a], table), _visible(tok.token_bytes[b], table)) for a, b in tok.merges]
    hf = hf_lib.Tokenizer(hf_lib.models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = hf_lib.pre_tokenizers.Sequence(
        [
            hf_lib.pre_tokenizers.Split(hf_lib.Regex(total_pattern(tok.pattern)), behavior="isolated"),
            hf_lib.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    hf.decoder = hf_lib.decoders.ByteLevel()
    return hf


def _char_to_hf(tok: CharTokenizer, hf_lib):
    vocab = {s: i for i, s in enumerate(SPECIAL_TOKENS)}
    vocab.update({f"<0x{b:02X}>": BYTE_BASE + b for b in range(256)})
    vocab.update({c: i for c, i in tok._char_to_id.items()})  # single characters: never a special or <0xNN>
    hf = hf_lib.Tokenizer(hf_lib.models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=True))
    hf.decoder = hf_lib.decoders.Sequence([hf_lib.decoders.ByteFallback(), hf_lib.decoders.Fuse()])
    return hf


# Python's \w and \s (what tinylm's word patterns mean) spelled for Oniguruma, whose \w also takes
# combining marks and whose \s leaves out the separators \x1c-\x1f
_WORD_CHAR, _NOT_WORD_OR_SPACE = r"[\p{L}\p{N}_]", r"[^\p{L}\p{N}_\s\x1c-\x1f]"
HF_WORD_PATTERNS = {WORD_PATTERN: rf"{_WORD_CHAR}+(?:'{_WORD_CHAR}+)*|{_NOT_WORD_OR_SPACE}"}
# WordTokenizer.join's rule as a regex: the start of a word that takes a space before it (a
# Hugging Face decoder adds it to every such word, then drops the text's first space)
_SPACE_BEFORE = "^(?!(?:" + "|".join(re.escape(p) for p in sorted(NO_SPACE_BEFORE)) + ")$|')"


def _word_to_hf(tok: WordTokenizer, hf_lib):
    """A ``WordLevel`` model over tinylm's ids (specials by name, words, ``<unk>`` for the rest)
    behind tinylm's normalisation (lowercase) and split (the pattern's matches, punctuation
    dropped unless kept)."""
    if tok.splitter != "regex" or tok.oov_bpe is not None:
        option = "splitter=spacy (spaCy's rules)" if tok.splitter != "regex" else "oov=bpe (pieces for unknown words)"
        raise TinyLMError(
            f"the word tokenizer cannot be exported to Hugging Face: {option} has no Hugging Face equivalent; "
            "a word tokenizer with the regex splitter and oov=unk can"
        )
    vocab = {tok.id_to_piece(i): i for i in range(tok.vocab_size)}
    if len(vocab) != tok.vocab_size:
        raise TinyLMError("the word vocabulary holds a special token's name; a Hugging Face vocabulary cannot")
    hf = hf_lib.Tokenizer(hf_lib.models.WordLevel(vocab=vocab, unk_token=tok.id_to_piece(tok.unk_id)))
    if tok.lowercase:
        hf.normalizer = hf_lib.normalizers.Lowercase()
    pre = hf_lib.pre_tokenizers
    pattern = HF_WORD_PATTERNS.get(tok.pattern, tok.pattern)
    steps = [pre.Split(hf_lib.Regex(pattern), behavior="removed", invert=True)]  # re.findall's words
    if not tok.keep_punctuation:
        steps.append(pre.Split(hf_lib.Regex(rf"\A{_NOT_WORD_OR_SPACE}+\z"), behavior="removed"))
    hf.pre_tokenizer = pre.Sequence(steps)
    dec = hf_lib.decoders
    hf.decoder = dec.Sequence([dec.Replace(hf_lib.Regex(_SPACE_BEFORE), " "), dec.Fuse(), dec.Strip(" ", 1, 0)])
    return hf


def to_hf_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` giving ``tok``'s ids (needs the ``tokenizers`` package); a
    tokenizer Hugging Face cannot represent exactly is refused with the reason."""
    kind = getattr(tok, "type_name", type(tok).__name__)
    converters = {BPETokenizer: _bpe_to_hf, CharTokenizer: _char_to_hf, WordTokenizer: _word_to_hf}
    convert = next((f for cls, f in converters.items() if isinstance(tok, cls)), None)
    if convert is None:
        reason = REFUSALS.get(kind, f"no Hugging Face tokenizer gives the ids of a {type(tok).__name__}")
        raise TinyLMError(
            f"the {kind} tokenizer cannot be exported to Hugging Face: {reason} "
            "(only BPE tokenizers, char tokenizers and word tokenizers can)"
        )
    hf_lib = _tokenizers_modules()
    hf = convert(tok, hf_lib)
    hf.add_special_tokens([hf_lib.AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
    return hf


def save_hf_tokenizer_json(tok, path: str | Path) -> Path:
    """Write ``tok`` as one Hugging Face ``tokenizer.json`` file (what ``tokenizers`` loads);
    ``save_hf_tokenizer`` writes the directory ``transformers`` loads around it. A tokenizer that
    cannot be converted is refused before anything is written."""
    hf = to_hf_tokenizer(tok)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    hf.save(str(path))
    return path


def hf_tokenizer_config(tok, model_max_length: int | None = None) -> dict:
    """``tokenizer_config.json`` for ``tok``: its special tokens by role, special strings in text
    kept as text, and no clean-up of spaces on decoding (tinylm's decode adds or drops none)."""
    names = tok.id_to_piece
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "split_special_tokens": True,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": names(tok.bos_id) if tok.bos_id is not None else None,
        "eos_token": names(tok.stop_ids[0]) if tok.stop_ids else None,
        "unk_token": names(tok.unk_id),
        "pad_token": names(tok.pad_id),
    }
    if model_max_length is not None:
        config["model_max_length"] = model_max_length
    return config


def save_hf_tokenizer(tok, out_dir: str | Path, model_max_length: int | None = None) -> list[Path]:
    """Write ``tokenizer.json``, ``tokenizer_config.json`` and ``special_tokens_map.json`` into
    ``out_dir``: a directory ``transformers.AutoTokenizer.from_pretrained`` loads with ``tok``'s ids."""
    out_dir = Path(out_dir)
    save_hf_tokenizer_json(tok, out_dir / "tokenizer.json")
    config = hf_tokenizer_config(tok, model_max_length)
    roles = {k: v for k, v in config.items() if k.endswith("_token") and v is not None}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out_dir / "special_tokens_map.json").write_text(json.dumps(roles, indent=2) + "\n", encoding="utf-8")
    return [out_dir / "tokenizer.json", out_dir / "tokenizer_config.json", out_dir / "special_tokens_map.json"]


# ------------------------------------------------------------------------------------- import
def _pretokenizer_pattern(pre: dict | None, where: str) -> str:
    """The split regex of a HF pre-tokenizer config, as a tinylm pattern (name or regex)."""
    if pre is None:
        raise TinyLMError(f"{where}: no pre_tokenizer; only byte-level BPE tokenizers can be imported")
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    pattern, byte_level = None, False
    for step in steps:
        kind = step.get("type")
        if kind == "ByteLevel":
            byte_level = True
            if step.get("add_prefix_space"):
                raise TinyLMError(f"{where}: ByteLevel add_prefix_space=true is not supported by tinylm BPE")
            if step.get("use_regex", True):
                if pattern is not None:
                    raise TinyLMError(f"{where}: both a Split regex and ByteLevel's own regex; not supported")
                pattern = "gpt2"
        elif kind == "Split":
            regex_text = (step.get("pattern") or {}).get("Regex")
            if regex_text is None or step.get("behavior", "").lower() != "isolated" or step.get("invert"):
                raise TinyLMError(
                    f"{where}: only Split pre-tokenizers with a Regex and behavior Isolated are supported"
                )
            if pattern is not None:
                raise TinyLMError(f"{where}: more than one split regex; not supported")
            named = [name for name, p in SPLIT_PATTERNS.items() if p == regex_text]
            suffix = "|[\\s\\S]"
            if regex_text.startswith("(?:") and regex_text.endswith(")" + suffix):
                regex_text = regex_text[3 : -len(suffix) - 1]  # a pattern tinylm itself made total
            pattern = named[0] if named else regex_text
        else:
            raise TinyLMError(f"{where}: pre-tokenizer {kind!r} is not supported (ByteLevel and Split are)")
    if not byte_level:
        raise TinyLMError(f"{where}: not a byte-level BPE (no ByteLevel pre-tokenizer)")
    return pattern or "gpt2"


def import_hf(path: str | Path) -> BPETokenizer:
    """A tinylm ``BPETokenizer`` from a HF byte-level BPE ``tokenizer.json`` (same segmentation)."""
    path = Path(path)
    if not path.is_file():
        raise TinyLMError(f"Hugging Face tokenizer file {path} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise TinyLMError(f"{path} is not a Hugging Face tokenizer.json ({exc})") from exc
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or "vocab" not in model:
        raise TinyLMError(f"{path} is not a Hugging Face tokenizer.json (no model.vocab)")
    if model.get("type", "BPE") != "BPE":
        raise TinyLMError(f"{path}: model type {model.get('type')!r}; only BPE can be imported")
    if data.get("normalizer"):
        raise TinyLMError(f"{path}: has a normalizer ({data['normalizer'].get('type')}); tinylm BPE has none")
    pattern = _pretokenizer_pattern(data.get("pre_tokenizer"), str(path))

    from_char = {c: b for b, c in byte_to_unicode().items()}
    hf_vocab: dict[str, int] = model["vocab"]
    # every spelling (tinylm ids) of each HF token string; bytes first
    spellings: dict[str, list[int]] = {c: [BYTE_BASE + b] for c, b in from_char.items()}
    merges: list[tuple[int, int]] = []
    for n, m in enumerate(model.get("merges", [])):
        left, right = m.split(" ", 1) if isinstance(m, str) else m
        if left not in spellings or right not in spellings:
            raise TinyLMError(f"{path}: merge {n} ({left!r}, {right!r}) uses a token no earlier merge builds")
        ids = spellings.setdefault(left + right, [])
        for a in spellings[left]:
            for b in spellings[right]:
                ids.append(FIRST_MERGE_ID + len(merges))
                merges.append((a, b))
        if len(merges) > _MAX_ALIAS_MERGES + len(model["merges"]):
            raise TinyLMError(f"{path}: too many duplicate spellings to import")
    tok = BPETokenizer(merges, pattern)

    unreachable = [s for s in hf_vocab if s not in spellings and s not in SPECIAL_TOKENS]
    added = {t.get("content") for t in data.get("added_tokens", [])}
    lost = [s for s in unreachable if s not in added]
    if lost:
        warnings.warn(
            f"{path}: {len(lost)} vocabulary entries are neither bytes nor merge results and were "
            f"dropped (e.g. {lost[:3]})",
            stacklevel=2,
        )
    extra_specials = sorted(added - set(SPECIAL_TOKENS))
    if extra_specials:
        warnings.warn(
            f"{path}: added tokens {extra_specials[:5]} have no tinylm id; they are encoded as text", stacklevel=2
        )
    # tinylm id -> HF id (None where HF has no such entry)
    table = byte_to_unicode()
    tok.hf_id_map = [hf_vocab.get(s, None) for s in SPECIAL_TOKENS] + [
        hf_vocab.get(_visible(tok.token_bytes[i], table)) for i in range(BYTE_BASE, tok.vocab_size)
    ]
    return tok
