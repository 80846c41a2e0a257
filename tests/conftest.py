"""Checks and helpers shared by every test."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUNS = ROOT / "runs"


@pytest.fixture(autouse=True)
def _no_run_folders_in_the_checkout(request, monkeypatch):
    """A test writes its run folders under tmp_path (``--run-dir``, ``--out``), never into the
    checkout's runs/ (the default of ``unbubble train`` and ``unbubble simulate``), where they would
    be left behind. What the test itself creates is checked (every ``os.mkdir`` of this process under
    runs/, which ``Path.mkdir``, ``os.makedirs`` and ``tempfile`` go through), not the folder's
    contents: a user training in the same checkout meanwhile adds folders there that are not the
    test's (issue 42 item 6: that failed whichever test was running)."""
    made: list[str] = []
    real_mkdir = os.mkdir

    def mkdir(path, *args, **kwargs):
        real_mkdir(path, *args, **kwargs)
        try:
            resolved = Path(os.fspath(path)).resolve()
        except (OSError, TypeError, ValueError):
            return
        if resolved.is_relative_to(RUNS) and resolved != RUNS:
            made.append(str(resolved.relative_to(RUNS)))

    monkeypatch.setattr(os, "mkdir", mkdir)
    yield
    assert not made, f"{request.node.nodeid} wrote {made} into {RUNS}: give it --run-dir / --out under tmp_path"


@dataclass(frozen=True)
class DocBlock:
    """A fenced code block of a document: its language, text, first line and ``## `` section."""

    doc: str
    lang: str
    code: str
    line: int
    section: str


def read_doc_blocks(doc: str) -> list[DocBlock]:
    """The fenced blocks of ``doc`` (a path under the repository root), in order."""
    blocks, section, lang, start, body = [], "", None, 0, []
    for number, text in enumerate((ROOT / doc).read_text().splitlines(), 1):
        if lang is None and text.startswith("## "):
            section = text
        elif lang is None and text.startswith("```"):
            lang, start, body = text[3:].strip(), number, []
        elif lang is not None and text.startswith("```"):
            blocks.append(DocBlock(doc, lang, "\n".join(body) + "\n", start, section))
            lang = None
        elif lang is not None:
            body.append(text)
    return blocks


def shell_commands(code: str) -> list[str]:
    """The commands of a shell block, one per line or ``&&`` part, comments and blank lines dropped."""
    out = []
    for line in code.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out += [part.strip() for part in line.split("&&")]
    return out


@pytest.fixture
def doc_blocks():
    """:func:`read_doc_blocks`, for the tests that run the docs' code as written."""
    return read_doc_blocks
