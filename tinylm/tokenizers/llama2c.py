"""Reader for llama2.c ``tokenizer.bin`` files, encoding exactly as llama2.c's ``run.c`` does.

File format: int32 ``max_token_length``, then for every piece: float32 score, int32 byte length,
the piece's bytes. Ids 0, 1, 2 are ``<unk>``, BOS and EOS; pieces ``<0xNN>`` are byte fallbacks
(id NN + 3). Pieces keep the space character where sentencepiece writes "▁".

Encoding (run.c ``encode``), reproduced rule for rule:

1. optional BOS (id 1);
2. when the text is not empty, the id of the piece ``" "`` (sentencepiece's dummy prefix);
3. the text's UTF-8 bytes cut into chunks the way run.c's byte loop does (one code point for
   valid UTF-8; a run of continuation bytes is cut every 4 bytes); each chunk becomes its piece's id
   if the vocabulary has it, else one byte-fallback id (byte + 3) per byte;
4. repeatedly merge the adjacent pair whose concatenated piece exists with the highest score
   (strictly above -1e10); among equal scores the leftmost pair wins. BOS takes part in this
   loop like any other token, as in run.c;
5. optional EOS (id 2).

run.c rescans the whole sequence for every merge (quadratic); here ``merges.merge_pairs`` gives
the same merge order in O(n log n), with the negated score as priority (ties go to the leftmost
pair, as in run.c). The tests compare both on random input.

Deviations, all on input run.c cannot receive or cannot resolve: a NUL character (run.c reads
a C string and would stop there) is encoded as the byte piece ``<0x00>``; when two pieces have
the same text, the lowest id is used (run.c's bsearch may return either); a vocabulary without
the ``" "`` piece uses byte fallback for the dummy prefix (run.c would emit id -1).
"""

from __future__ import annotations

import re
import struct
from pathlib import Path
from typing import Iterable

from tinylm.errors import TinyLMError
from tinylm.tokenizers.base import Tokenizer
from tinylm.tokenizers.merges import merge_pairs

UNK, BOS, EOS = 0, 1, 2
BYTE_FALLBACK_BASE = 3  # id of <0x00>
_MIN_SCORE = -1e10  # run.c starts its best score here and compares with ">"
# run.c's byte loop: a chunk is any byte followed by continuation bytes, at most 4 bytes long
_CHUNK = re.compile(rb"[^\x80-\xbf][\x80-\xbf]{0,3}|[\x80-\xbf]{1,4}", re.DOTALL)
_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{1,2})")  # what run.c's sscanf("<0x%02hhX>") accepts


class _PairMerges(dict):
    """(left id, right id) -> (-score, id) of the piece the two spell, or None when there is no
    such piece with a score above run.c's floor. The score is negated because ``merge_pairs``
    merges the lowest priority first. Filled on first use, so a repeated pair costs one dict
    lookup and no Python call."""

    def __init__(self, lookup: dict[bytes, int], cstr: list[bytes], scores: list[float]):
        super().__init__()
        self.lookup, self.cstr, self.scores = lookup, cstr, scores

    def __missing__(self, pair: tuple[int, int]) -> tuple[float, int] | None:
        i = self.lookup.get(self.cstr[pair[0]] + self.cstr[pair[1]])
        hit = (-self.scores[i], i) if i is not None and self.scores[i] > _MIN_SCORE else None
        self[pair] = hit
        return hit


class Llama2cTokenizer(Tokenizer):
    """A llama2.c / sentencepiece-style vocabulary with scores. Not trainable here: load a file.

    ``encode(text, bos=False, eos=False)`` returns ids as run.c would; ``decode(ids)`` joins the
    pieces, drops BOS/EOS, turns byte pieces into bytes and removes the dummy-prefix space, so
    ``decode(encode(t)) == t`` for every string without NUL-free-ness caveats (see module notes).
    """

    type_name = "llama2c"
    lossless = True  # via byte fallback, when the vocabulary holds all 256 byte pieces
    unk_id, sos_id, eos_id = UNK, BOS, EOS
    bos_id = BOS
    # llama2.c's models end a story by starting the next one with BOS, which is where run.c stops
    stop_ids = (BOS, EOS)
    decode_with_prompt = True  # run.c prints decode(prompt ids + new ids)
    pad_id = UNK  # llama2.c has no padding token; encode never emits <unk>, so it is safe as padding
    special_tokens = ("<unk>", "<s>", "</s>")

    def __init__(self, pieces: list[bytes], scores: list[float], max_token_length: int | None = None):
        if len(pieces) != len(scores):
            raise TinyLMError(f"llama2.c tokenizer: {len(pieces)} pieces but {len(scores)} scores")
        if len(pieces) < 3:
            raise TinyLMError(f"llama2.c tokenizer needs at least the 3 special pieces (got {len(pieces)})")
        self.pieces = [bytes(p) for p in pieces]
        self.scores = [float(s) for s in scores]
        self.max_token_length = max_token_length if max_token_length is not None else max(len(p) for p in pieces)
        # run.c treats pieces as C strings: anything after a NUL byte is invisible to it
        self._cstr = [p.split(b"\0", 1)[0] for p in self.pieces]
        self._lookup: dict[bytes, int] = {}
        for i, p in enumerate(self._cstr):
            self._lookup.setdefault(p, i)
        self._byte_ids = [self._lookup.get(f"<0x{b:02X}>".encode(), BYTE_FALLBACK_BASE + b) for b in range(256)]
        self._byte_of_id = {i: int(m.group(1), 16) for i, p in enumerate(self._cstr) if (m := _BYTE_PIECE.match(p))}
        self._pair_merges = _PairMerges(self._lookup, self._cstr, self.scores)
        self._chunk_cache: dict[bytes, tuple[int, ...]] = {}

    # ------------------------------------------------------------------------------- file io
    @classmethod
    def from_file(cls, path: str | Path, vocab_size: int | None = None) -> "Llama2cTokenizer":
        """Read a ``tokenizer.bin``; ``vocab_size`` reads only that many pieces (run.c takes it from
        the model header), otherwise the whole file."""
        path = Path(path)
        if not path.is_file():
            raise TinyLMError(f"llama2.c tokenizer file {path} does not exist")
        return cls.from_bytes(path.read_bytes(), vocab_size, name=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, vocab_size: int | None = None, name: str = "<bytes>") -> "Llama2cTokenizer":
        if len(data) < 4:
            raise TinyLMError(f"{name} is not a llama2.c tokenizer.bin (only {len(data)} bytes)")
        if data[:1] == b"{":
            raise TinyLMError(f"{name} looks like a JSON file, not a llama2.c tokenizer.bin")
        (max_len,) = struct.unpack_from("<i", data, 0)
        if not 0 < max_len < 1 << 16:
            raise TinyLMError(f"{name} is not a llama2.c tokenizer.bin (max_token_length {max_len} at byte 0)")
        pieces, scores, offset = [], [], 4
        while offset < len(data) and (vocab_size is None or len(pieces) < vocab_size):
            if offset + 8 > len(data):
                raise TinyLMError(f"{name}: truncated piece header at byte {offset} (piece {len(pieces)})")
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            if length < 0 or length > max_len or offset + length > len(data):
                raise TinyLMError(
                    f"{name}: piece {len(pieces)} at byte {offset - 8} has length {length} "
                    f"(max_token_length {max_len}, {len(data) - offset} bytes left); not a llama2.c tokenizer.bin?"
                )
            pieces.append(data[offset : offset + length])
            scores.append(score)
            offset += length
        if vocab_size is not None and len(pieces) < vocab_size:
            raise TinyLMError(f"{name} holds {len(pieces)} pieces, fewer than the vocab_size {vocab_size} asked for")
        if len(pieces) < BYTE_FALLBACK_BASE + 256:  # encode falls back to ids 3..258 for any byte
            raise TinyLMError(
                f"{name} holds {len(pieces)} pieces; a llama2.c tokenizer.bin has at least "
                f"{BYTE_FALLBACK_BASE + 256} (<unk>, <s>, </s> and the 256 byte pieces)"
            )
        return cls(pieces, scores, max_len)

    def to_bytes(self) -> bytes:
        pieces = (struct.pack("<fi", score, len(piece)) + piece for piece, score in zip(self.pieces, self.scores))
        return struct.pack("<i", self.max_token_length) + b"".join(pieces)

    def save(self, path: str | Path) -> None:
        """Write the llama2.c binary format (not tinylm JSON), readable by run.c."""
        Path(path).write_bytes(self.to_bytes())

    # ------------------------------------------------------------------------------- encode
    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def piece_to_id(self, piece: str | bytes) -> int | None:
        key = piece.encode("utf-8") if isinstance(piece, str) else piece
        return self._lookup.get(key)

    def _chunk_ids(self, chunk: bytes) -> tuple[int, ...]:
        ids = self._chunk_cache.get(chunk)
        if ids is None:
            i = self._lookup.get(chunk)
            ids = (i,) if i is not None else tuple(BYTE_FALLBACK_BASE + b for b in chunk)
            self._chunk_cache[chunk] = ids
        return ids

    def initial_ids(self, text: str | bytes, bos: bool = False) -> list[int]:
        """The ids before any merge: BOS, dummy prefix, one id per chunk (or per byte)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = [BOS] if bos else []
        if data:
            space = self._lookup.get(b" ")
            ids.append(space if space is not None else self._byte_ids[0x20])
        for chunk in _CHUNK.findall(data):
            ids.extend(self._chunk_ids(chunk))
        return ids

    def encode(self, text: str | bytes, bos: bool = False, eos: bool = False) -> list[int]:
        ids = merge_pairs(self.initial_ids(text, bos), self._pair_merges.__getitem__)
        if eos:
            ids.append(EOS)
        return ids

    # ------------------------------------------------------------------------------- decode
    def decode_piece(self, prev_id: int, token_id: int) -> bytes:
        """The bytes run.c's ``decode(prev, token)`` prints: a leading space is dropped after BOS
        and a byte piece ``<0xNN>`` becomes that byte."""
        piece = self._cstr[token_id]
        if prev_id == BOS and piece[:1] == b" ":
            piece = piece[1:]
        byte = self._byte_of_id.get(token_id)
        return bytes([byte]) if byte is not None else piece

    def decode(self, ids: Iterable[int], strip_dummy_prefix: bool = True) -> str:
        """Text of ``ids``; BOS and EOS are dropped. With ``strip_dummy_prefix`` the space that
        encode put in front of the text is removed (as sentencepiece does); pass False when
        decoding a continuation that does not start the text."""
        out = bytearray()
        prev, first = -1, True
        for i in map(int, ids):
            if i == BOS or i == EOS:
                prev = i
                continue
            if not 0 <= i < len(self.pieces):
                raise TinyLMError(f"token id {i} is outside the llama2.c vocabulary of {len(self.pieces)}")
            piece = self.decode_piece(prev, i)
            if first and strip_dummy_prefix and prev != BOS and piece[:1] == b" ":
                piece = piece[1:]  # after BOS decode_piece already stripped it
            out += piece
            prev, first = i, False
        return out.decode("utf-8", errors="replace")

    def id_to_piece(self, i: int) -> str:
        return self.pieces[i].decode("utf-8", errors="replace")

    def _state(self) -> dict:
        raise TinyLMError("a llama2.c tokenizer is saved in its own binary format; use .save(path)")

    def __repr__(self) -> str:
        return f"Llama2cTokenizer(vocab_size={self.vocab_size}, max_token_length={self.max_token_length})"


def is_llama2c_file(path: str | Path) -> bool:
    """Cheap sniff: not JSON, and the first piece header parses."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(12)
    except OSError:
        return False
    if len(head) < 12 or head[:1] in (b"{", b"[", b" ", b"\n"):
        return False
    max_len, _, length = struct.unpack("<ifi", head)
    return 0 < max_len < 1 << 16 and 0 <= length <= max_len
