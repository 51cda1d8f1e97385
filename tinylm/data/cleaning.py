"""Document cleaning. Each step is a flag; the report counts what went in and what was dropped."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

from tinylm.config import CleanOptions

_URL = re.compile(r"(?:https?://|www\.)\S+", re.I)
_EMAIL = re.compile(r"\b[\w.+-]+@[\w-]+\.[\w.-]+\b")
_HTML = re.compile(r"<(?:/?[a-zA-Z][^<>]*|!--.*?--)>", re.S)
_SPACES = re.compile(r"[ \t\u00a0\u2000-\u200b\u3000]+")
_BLANK_LINES = re.compile(r"\n{3,}")
# a word or a phrase of up to 4 words said again right after itself ("very very very", "la la la")
_REPEATS = re.compile(r"\b(\w+(?:[ \t]+\w+){0,3}?)(?:[ \t]*[,!]?[ \t]+\1\b)+", re.I)
# "normal letters and essential punctuation": ASCII letters, digits, whitespace and . , ! ? ' " - : ; ( )
_NOT_ESSENTIAL = re.compile(r"[^A-Za-z0-9\s.,!?'\"\-:;()]+")
_DOTS = re.compile(r"[ \t]*(?:(?:\.[ \t]*){2,}|(?:\u2026[ \t]*)+)")
_PUNCT = str.maketrans(
    {
        **dict.fromkeys("\u2018\u2019\u201a\u201b", "'"),
        **dict.fromkeys("\u201c\u201d\u201e\u201f\u00ab\u00bb", '"'),
        **dict.fromkeys("\u2013\u2014\u2015\u2212", "-"),
        "\u2026": "...",
    }
)


@dataclass
class CleanReport:
    documents_in: int = 0
    documents_out: int = 0
    changed: dict[str, int] = field(default_factory=dict)  # step -> documents it changed
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> documents dropped

    def summary(self) -> str:
        changed = ", ".join(f"{k} {v}" for k, v in self.changed.items() if v) or "none"
        dropped = ", ".join(f"{k} {v}" for k, v in self.dropped.items() if v) or "none"
        return f"documents in {self.documents_in}, out {self.documents_out}; changed: {changed}; dropped: {dropped}"


def _fix_unicode(text: str) -> str:
    import ftfy  # deferred: imported only when fix_unicode is on

    return ftfy.fix_text(text, normalization="NFC")


def _normalize_whitespace(text: str) -> str:
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    lines = [_SPACES.sub(" ", line).strip() for line in text.split("\n")]
    return _BLANK_LINES.sub("\n\n", "\n".join(lines)).strip()


# every step, named by its CleanOptions flag, in the order the steps run
_STEPS = {
    "fix_unicode": _fix_unicode,
    "remove_html": lambda t: _HTML.sub(" ", t),
    "remove_urls": lambda t: _URL.sub(" ", t),
    "remove_emails": lambda t: _EMAIL.sub(" ", t),
    "standardize_punctuation": lambda t: t.translate(_PUNCT),
    "remove_repeats": lambda t: _REPEATS.sub(r"\1", t),
    "collapse_dots": lambda t: _DOTS.sub(". ", t),
    "letters_and_punctuation_only": lambda t: _NOT_ESSENTIAL.sub(" ", t),
    "lowercase": str.lower,
    "normalize_whitespace": _normalize_whitespace,
}


def clean_text(text: str, opts: CleanOptions, report: CleanReport | None = None) -> str:
    for name, step in _STEPS.items():
        if getattr(opts, name):
            new = step(text)
            if report is not None and new != text:
                report.changed[name] = report.changed.get(name, 0) + 1
            text = new
    return text


def clean_documents(docs: list[str], opts: CleanOptions) -> tuple[list[str], CleanReport]:
    report = CleanReport(documents_in=len(docs), dropped={"empty": 0, "too_short": 0, "too_long": 0, "duplicate": 0})
    seen: set[bytes] = set()
    out = []
    for doc in docs:
        doc = clean_text(doc, opts, report)
        if not doc.strip():
            report.dropped["empty"] += 1
            continue
        if len(doc) < opts.min_chars:
            report.dropped["too_short"] += 1
            continue
        if opts.max_chars is not None and len(doc) > opts.max_chars:
            report.dropped["too_long"] += 1
            continue
        if opts.deduplicate:
            key = hashlib.blake2b(doc.encode("utf-8"), digest_size=16).digest()
            if key in seen:
                report.dropped["duplicate"] += 1
                continue
            seen.add(key)
        out.append(doc)
    report.documents_out = len(out)
    return out, report
