"""Tokenise a corpus once into ``.bin`` token files and memory-map them.

A corpus is tokenised once per (files, tokenizer) and read by every run and stage process without
loading it. The cache's layout:
docs/architecture.md#datamemmappy.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from unbubble.data.corpus import corpus_fingerprint, corpus_kind, open_corpus
from unbubble.data.tokenizer import Tokenizer, get_tokenizer
from unbubble.errors import ConfigError, check_int

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: uint32 files, content and tokenizer-file keys, text field
UINT16_VOCAB_LIMIT = 2**16  # ids 0..65535 fit in uint16
_ENCODE_CHUNK = 256  # documents per encode_batch call


@dataclass(frozen=True, eq=False)
class TokenData:
    """A prepared, memory-mapped token corpus.

    Attributes:
        train: Training tokens, shape ``(n_train,)``, dtype ``uint16`` or ``uint32``
            (:func:`token_dtype`), read-only ``np.memmap`` of ``train.bin``.
        val: Validation tokens, shape ``(n_val,)``, same dtype, read-only
            ``np.memmap`` of ``val.bin``; never empty.
        vocab_size: Number of token ids (all ids are ``< vocab_size``).
        eos_id: End-of-document id, appended after every document.
        tokenizer: Tokenizer name (``"gpt2"``, ``"byte"`` or ``"hf:/folder"``).
        meta: Contents of ``meta.json`` plus ``"dir"`` (the cache folder, str)
            and ``"from_cache"`` (bool: True when nothing was tokenised).
    """

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    eos_id: int
    tokenizer: str
    meta: dict = field(default_factory=dict)


def _check_uint16_vocab(vocab_size: int, what: str) -> None:
    if vocab_size > UINT16_VOCAB_LIMIT:
        raise ConfigError(
            f"{what} has vocab_size={vocab_size}, too large for uint16 token files: "
            f"must be <= {UINT16_VOCAB_LIMIT} (set --tokenizer)"
        )


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest little-endian unsigned dtype holding ids ``0 .. vocab_size - 1``: ``uint16`` up to a
    vocabulary of 65,536, ``uint32`` above."""
    return np.dtype("<u2") if vocab_size <= UINT16_VOCAB_LIMIT else np.dtype("<u4")


def _cache_key(fingerprint: str, tokenizer: str, val_fraction: float, text_field: str = "text") -> str:
    blob = json.dumps([FORMAT_VERSION, fingerprint, tokenizer, float(val_fraction), text_field])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _temp_prefix(name: str) -> str:
    """``.NAME.HOST-PID.``: a temporary file's name says which process writes it, so a later run can
    remove what a killed one left (:func:`_remove_dead_writers_temps`)."""
    return f".{name}.{socket.gethostname()}-{os.getpid()}."


def _remove_dead_writers_temps(out: Path) -> list[str]:
    """Removes the temporary files in ``out`` whose writer (a process of this host, by its PID) no longer
    exists: a run killed while tokenizing (SIGKILL, out of memory) leaves its partial token files, as
    large as the tokens written so far. Another host's files and a live process's are kept (a concurrent
    run of the same corpus). Returns the names removed."""
    mine = re.compile(re.escape(f".{socket.gethostname()}-") + r"(\d+)\.[^.]*\.tmp$")  # mkstemp's part has no dot
    removed = []
    for tmp in out.glob(".*.tmp"):
        match = mine.search(tmp.name)
        if match is None or int(match[1]) == os.getpid():
            continue
        try:
            os.kill(int(match[1]), 0)
            continue  # alive: still writing
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            tmp.unlink()
            removed.append(tmp.name)
        except OSError:
            pass
    if removed:
        logger.info("removed %d partial file(s) of an interrupted tokenizing in %s: %s", len(removed), out,
                    ", ".join(sorted(removed)))
    return removed


def _atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Writes ``data`` to ``path`` via a temp file in the same folder + fsync + os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path.name), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _try_load(out: Path, tok: Tokenizer) -> TokenData | None:
    """Memory-maps a complete cache folder, or returns None if it is absent/stale/corrupt. The
    tokenizer is matched by its fingerprint, not its name: the same tokenizer files in two model
    folders share one cache."""
    meta_path = out / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        dtype = token_dtype(tok.vocab_size)
        ok = (
            meta.get("format") == FORMAT_VERSION
            and meta.get("tokenizer_fingerprint") == tok.fingerprint
            and meta.get("vocab_size") == tok.vocab_size
            and meta.get("dtype") == dtype.name
            and (out / "train.bin").stat().st_size == dtype.itemsize * meta["train_tokens"]
            and (out / "val.bin").stat().st_size == dtype.itemsize * meta["val_tokens"]
            and meta["train_tokens"] > 0
            and meta["val_tokens"] > 0
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("token cache %s is unreadable (%s); rebuilding", out, exc)
        return None
    if not ok:
        logger.warning("token cache %s does not match its meta.json; rebuilding", out)
        return None
    train = np.memmap(out / "train.bin", dtype=dtype, mode="r")
    val = np.memmap(out / "val.bin", dtype=dtype, mode="r")
    return TokenData(
        train=train,
        val=val,
        vocab_size=int(meta["vocab_size"]),
        eos_id=int(meta["eos_id"]),
        tokenizer=tok.name,
        meta={**meta, "tokenizer": tok.name, "dir": str(out), "from_cache": True},
    )


def _val_documents(n_docs: int, val_fraction: float) -> list[int] | None:
    """The documents held out for validation, or None for a split by tokens.

    With at least ``1 / val_fraction`` documents, whole documents go to val: ``n_val = round(n_docs *
    val_fraction)`` of them, evenly spaced through the corpus (indices ``(2j + 1) * n_docs // (2 n_val)``).
    With fewer, the concatenated stream is cut at token ``n - max(1, round(n * val_fraction))``."""
    if n_docs * val_fraction >= 1 and n_docs >= 2:
        n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
        return sorted({(2 * j + 1) * n_docs // (2 * n_val) for j in range(n_val)})
    return None


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _progress(total: int, corpus: str):
    """A tqdm bar over documents on a terminal (stderr), silent otherwise."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="doc", desc=f"tokenizing {Path(str(corpus)).name}", disable=None, leave=False)


def _tokenize_into(docs, tok: Tokenizer, out: Path, dtype: np.dtype, val_fraction: float, corpus: str
                   ) -> tuple[Path, Path, dict]:
    """Streams every document's ids (then EOS) into two temporary files in ``out``; returns their paths and
    the split info (:func:`_val_documents`: whole documents when there are enough, else the stream's tail).

    Raises:
        ConfigError: a bad row (:meth:`~unbubble.data.corpus.Documents.batches`), an id outside the
            tokenizer's vocabulary, or a corpus whose documents are all empty. The temporary files
            are removed.
    """
    n_docs = len(docs)
    val_idx = _val_documents(n_docs, val_fraction)
    val_set = set(val_idx or ())
    eos = np.array([tok.eos_id], dtype=dtype)
    tmps = []
    try:
        for name in ("train", "val"):
            fd, tmp = tempfile.mkstemp(dir=out, prefix=_temp_prefix(f"{name}.bin"), suffix=".tmp")
            tmps.append((os.fdopen(fd, "wb"), Path(tmp)))
        (ftrain, ptrain), (fval, pval) = tmps
        n_tokens, kept, limit = 0, 0, np.iinfo(dtype).max
        with _progress(n_docs, corpus) as bar:
            for start, texts in docs.batches(_ENCODE_CHUNK):
                for i, ids in enumerate(tok.encode_batch(texts)):
                    if not texts[i].strip():  # an empty row adds nothing, not even an EOS
                        continue
                    arr = np.asarray(ids, dtype=np.int64)
                    if arr.size and (arr.max() >= tok.vocab_size or arr.max() > limit or arr.min() < 0):
                        raise ConfigError(f"tokenizer={tok.name!r} produced id {int(arr.max())} for document "
                                          f"{start + i} of corpus={corpus!r}, outside its vocab_size="
                                          f"{tok.vocab_size}: the tokenizer folder is inconsistent")
                    (fval if start + i in val_set else ftrain).write(np.concatenate([arr.astype(dtype), eos]).tobytes())
                    n_tokens += arr.size + 1
                    kept += 1
                bar.update(len(texts))
        for f, _ in tmps:
            f.flush()
            os.fsync(f.fileno())
            f.close()
        if kept == 0:
            raise ConfigError(f"corpus={corpus!r} is an empty corpus: all {n_docs} documents are empty or whitespace")
        if val_idx is not None and (ptrain.stat().st_size == 0 or pval.stat().st_size == 0):
            val_idx = None  # empty documents emptied a side: fall back to the tail of the stream
            with open(ptrain, "ab") as f:
                f.write(pval.read_bytes())
            pval.write_bytes(b"")
        if val_idx is None:
            stream = np.memmap(ptrain, dtype=dtype, mode="r")
            n_val = max(1, round(stream.size * val_fraction))
            cut = stream.size - n_val
            with open(pval, "wb") as f:
                f.write(np.asarray(stream[cut:]).tobytes())
                f.flush()
                os.fsync(f.fileno())
            del stream
            with open(ptrain, "r+b") as f:
                f.truncate(cut * dtype.itemsize)
                os.fsync(f.fileno())
            info = {"split": "tokens", "val_start_token": int(cut)}
        else:
            info = {"split": "documents", "val_documents": val_idx}
        info["n_tokens"] = int(n_tokens)
        info["n_documents"] = n_docs
        info["empty_documents"] = n_docs - kept
        return ptrain, pval, info
    except BaseException:
        for f, tmp in tmps:
            f.close()
            tmp.unlink(missing_ok=True)
        raise


def prepare_tokens(
    corpus: str, tokenizer: str | Tokenizer, cache_dir: str | Path, val_fraction: float = 0.05,
    text_field: str = "text",
) -> TokenData:
    """Tokenises a corpus once (cached on disk) and memory-maps train/val tokens.

    Each document is encoded and followed by the tokenizer's EOS id; the split
    is deterministic (see :func:`_val_documents`): whole documents, evenly spaced,
    when there are at least ``1 / val_fraction`` of them, else the last
    ``val_fraction`` of the token stream. A later call with the same corpus
    content, tokenizer and ``val_fraction`` loads the cache without tokenising.
    ``meta.json`` records the tokenizing time (``tokenize_s``, wall clock) and ``tokens_per_s``.

    Args:
        corpus: ``"kjv"``, ``"shakespeare"``, a text file or folder, a table (``.jsonl``, ``.json``,
            ``.parquet``, ``.arrow``, a folder of them or a ``save_to_disk`` folder; see
            :func:`unbubble.data.corpus.open_corpus`), or a folder with ``train.bin`` and ``val.bin``.
        tokenizer: ``"gpt2"``, ``"byte"``, ``"hf:FOLDER"`` or a :class:`Tokenizer`.
        cache_dir: Folder for prepared corpora; created if missing. Files go
            to ``cache_dir/<key>/{train.bin,val.bin,meta.json}``.
        val_fraction: Target share of tokens held out for validation, in (0, 1).
        text_field: the column of a table corpus holding the text.

    Returns:
        :class:`TokenData` with memmaps ``train`` ``(n_train,)`` and ``val`` ``(n_val,)``, both
        non-empty, of dtype :func:`token_dtype` of the vocabulary.

    Raises:
        ConfigError: Bad corpus (missing, empty, unreadable, no such text field, non-text rows), unknown
            tokenizer, ``val_fraction`` outside (0, 1), or an unwritable cache_dir. Nothing half-written
            is left in the cache.
    """
    try:
        val_fraction = float(val_fraction)
    except (TypeError, ValueError):
        raise ConfigError(
            f"val_fraction={val_fraction!r} is invalid: must be a number in (0, 1) (set --val-fraction)"
        ) from None
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction!r} is invalid: must be in (0, 1) (set --val-fraction)")
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else get_tokenizer(tokenizer)
    kind = corpus_kind(corpus)
    if kind != "table" and text_field != "text":  # a column name means nothing to text files or token ids
        logger.warning("text_field=%r has no effect: corpus %r is %s, not a table (--text-field names a table's "
                       "column)", text_field, corpus, "pre-tokenized ids" if kind == "bin" else "plain text")
        text_field = "text"  # and the cache key stays the text corpus's one
    if kind == "bin":
        return load_token_folder(Path(corpus).expanduser(), tok)
    fingerprint = corpus_fingerprint(corpus)
    key = _cache_key(fingerprint, tok.fingerprint, val_fraction, text_field)
    out = Path(cache_dir).expanduser() / key
    dtype = token_dtype(tok.vocab_size)

    cached = _try_load(out, tok)
    if cached is not None:
        logger.info(
            "tokens for corpus %r (%s) loaded from %s: %d train, %d val",
            corpus, tok.name, out, cached.train.size, cached.val.size,
        )
        return cached

    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cache_dir='{cache_dir}' cannot be created ({exc.strerror}): give a writable folder (set --cache-dir)"
        ) from exc

    _remove_dead_writers_temps(out)
    docs = open_corpus(corpus, text_field, cache_dir)
    t0 = time.perf_counter()
    try:
        ptrain, pval, split_info = _tokenize_into(docs, tok, out, dtype, val_fraction, corpus)
    except OSError as exc:
        raise ConfigError(
            f"cache_dir='{cache_dir}' is not writable ({exc.strerror}): give a writable folder (set --cache-dir)"
        ) from exc
    seconds = time.perf_counter() - t0
    n_train, n_val = ptrain.stat().st_size // dtype.itemsize, pval.stat().st_size // dtype.itemsize
    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "corpus": str(corpus),
        "corpus_fingerprint": fingerprint,
        "text_field": text_field,
        "tokenizer": tok.name,
        "tokenizer_fingerprint": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": dtype.name,
        "val_fraction": val_fraction,
        "n_documents": split_info.pop("n_documents"),
        "empty_documents": split_info.pop("empty_documents"),
        "train_tokens": int(n_train),
        "val_tokens": int(n_val),
        **{k: v for k, v in split_info.items() if k != "n_tokens"},
        "tokenize_s": round(seconds, 3),
        "tokens_per_s": round(split_info["n_tokens"] / max(seconds, 1e-9)),
        "train_sha256": _file_sha256(ptrain),
        "val_sha256": _file_sha256(pval),
    }
    try:
        os.replace(ptrain, out / "train.bin")
        os.replace(pval, out / "val.bin")
        _atomic_write_bytes(out / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    except OSError as exc:
        for tmp in (ptrain, pval):
            tmp.unlink(missing_ok=True)
        raise ConfigError(
            f"cache_dir='{cache_dir}' is not writable ({exc.strerror}): give a writable folder (set --cache-dir)"
        ) from exc
    logger.info(
        "tokenised corpus %r with %s: %d documents -> %d train + %d val tokens (%s, split by %s) in %.1f s "
        "(%.0f tokens/s), cached in %s",
        corpus, tok.name, meta["n_documents"], n_train, n_val, dtype.name, meta["split"], seconds,
        meta["tokens_per_s"], out,
    )
    data = _try_load(out, tok)
    if data is None:  # pragma: no cover - only if another process corrupted it in between
        raise ConfigError(f"cache_dir='{cache_dir}': {out} changed while being written: retry (set --cache-dir)")
    return TokenData(data.train, data.val, data.vocab_size, data.eos_id, data.tokenizer,
                     {**data.meta, "from_cache": False})


def load_token_folder(folder: str | Path, tokenizer: str | Tokenizer) -> TokenData:
    """A pre-tokenised corpus: ``folder/train.bin`` and ``folder/val.bin`` (nanoGPT format: uint16), ids
    of ``tokenizer``'s vocabulary; used as is (no cache).

    Raises:
        ConfigError: a file is missing, empty, of odd size or holds an id ≥ the vocabulary, or the
            tokenizer's vocabulary does not fit uint16.
    """
    tok = tokenizer if isinstance(tokenizer, Tokenizer) else get_tokenizer(tokenizer)
    folder = Path(folder).expanduser()
    _check_uint16_vocab(tok.vocab_size, f"tokenizer={tok.name!r} (pre-tokenised .bin files of corpus='{folder}' "
                                        "are uint16)")
    train = load_bin(folder / "train.bin", tok.vocab_size, tok.name)
    val = load_bin(folder / "val.bin", tok.vocab_size, tok.name)
    meta = {"format": FORMAT_VERSION, "tokenizer": tok.name, "vocab_size": tok.vocab_size, "dtype": "uint16",
            "train_tokens": int(train.size), "val_tokens": int(val.size), "dir": str(folder), "from_cache": True,
            "pretokenized": True}
    return TokenData(train, val, tok.vocab_size, tok.eos_id, tok.name, meta)


#: Vocabulary sizes of the tokenizers a pre-tokenised file can hold ids of (``--tokenizer``).
_TOKENIZER_VOCABS = {"byte": 257, "gpt2": 50257}


def _bad_id_message(path, arr: np.memmap, vocab_size: int, tokenizer: str | None) -> str:
    """What is wrong with a file holding ids ≥ ``vocab_size`` and the fix: the first such id and its
    position, and the tokenizer whose vocabulary the ids fit (a GPT-2 file read as bytes)."""
    pos = int(np.argmax(arr >= vocab_size))
    first, top = int(arr[pos]), int(arr.max())
    found = f"bin file '{path}' holds token id {first} at position {pos}" + (
        f" (largest {top})" if top != first else "")
    if tokenizer is None:  # called with a bare vocab_size
        return f"{found}, not below vocab_size={vocab_size}: give a vocab_size above {top}, or re-tokenize the file"
    fits = [name for name, size in _TOKENIZER_VOCABS.items() if name != tokenizer and top < size]
    if fits:
        return (f"{found}, not below the {tokenizer} tokenizer's vocab_size={vocab_size}: its ids fit {fits[0]}'s "
                f"{_TOKENIZER_VOCABS[fits[0]]}, so it is likely a {fits[0]} file (set --tokenizer {fits[0]})")
    sizes = ", ".join(f"{name} {size}" for name, size in _TOKENIZER_VOCABS.items())
    return (f"{found}, not below the {tokenizer} tokenizer's vocab_size={vocab_size}: no --tokenizer has that many "
            f"ids ({sizes}): re-tokenize it with one of them")


def load_bin(path: str | Path, vocab_size: int, tokenizer: str | None = None) -> np.memmap:
    """Memory-maps a user's pre-tokenised uint16 ``.bin`` file and validates it.

    Args:
        path: Raw little-endian uint16 token ids, no header (nanoGPT format).
        vocab_size: Vocabulary size of the model; every id must be below it.
            At most 65536.
        tokenizer: the ``--tokenizer`` whose ids the file should hold (names the fix when the
            ids fit another one's vocabulary); ``None``: a bare ``vocab_size``.

    Returns:
        Read-only ``np.memmap``, shape ``(n_tokens,)``, dtype ``uint16``.

    Raises:
        ConfigError: If the file is missing, empty, of odd size, holds an id
            ``>= vocab_size``, or ``vocab_size`` is not in [1, 65536].
    """
    valid = f"give a non-empty file of uint16 token ids < vocab_size={vocab_size}"
    check_int("vocab_size", vocab_size, 1, "set --vocab-size", integers=(int, np.integer))
    _check_uint16_vocab(int(vocab_size), f"bin file '{path}'")
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"bin file '{path}' does not exist or is not a file: {valid}")
    try:
        size = p.stat().st_size
    except OSError as exc:
        raise ConfigError(f"bin file '{path}' cannot be read ({exc.strerror}): {valid}") from exc
    if size == 0:
        raise ConfigError(f"bin file '{path}' is empty: {valid}")
    if size % 2:
        raise ConfigError(f"bin file '{path}' has odd size {size} bytes, not a whole number of uint16 ids: {valid}")
    try:
        arr = np.memmap(p, dtype="<u2", mode="r")
    except OSError as exc:
        raise ConfigError(f"bin file '{path}' cannot be read ({exc.strerror}): {valid}") from exc
    top = int(arr.max())
    if top >= vocab_size:
        raise ConfigError(_bad_id_message(path, arr, vocab_size, tokenizer))
    logger.info("loaded %d tokens from %s (max id %d < vocab_size=%d)", arr.size, p, top, vocab_size)
    return arr
