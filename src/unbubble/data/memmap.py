"""Tokenise a corpus once into uint16 ``.bin`` files and memory-map them.

Layout of a prepared corpus, in ``<cache_dir>/<key>/``:

* ``train.bin``, ``val.bin``: raw little-endian ``uint16`` token ids, no
  header (the nanoGPT format), each document followed by the EOS id.
* ``meta.json``: token counts, tokenizer, vocab size, EOS id, corpus
  fingerprint, split description and sha256 of both bins.

``key`` is a 16-hex-digit sha256 of (format version, corpus fingerprint,
tokenizer name, val_fraction), so editing a corpus file, or changing the
tokenizer or split, gives a fresh folder. Every file is written to a temporary
name, fsynced and moved into place with :func:`os.replace`; ``meta.json`` is
written last and marks the folder complete, so a crash never leaves a
half-written file that is later trusted. Processes that prepare the same key
concurrently write identical bytes, so the race is harmless.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from unbubble.data.corpus import corpus_fingerprint, load_documents
from unbubble.data.tokenizer import get_tokenizer
from unbubble.errors import ConfigError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
UINT16_VOCAB_LIMIT = 2**16  # ids 0..65535 fit in uint16
_ENCODE_CHUNK = 256  # documents per encode_batch call


@dataclass(frozen=True, eq=False)
class TokenData:
    """A prepared, memory-mapped token corpus.

    Attributes:
        train: Training tokens, shape ``(n_train,)``, dtype ``uint16``,
            read-only ``np.memmap`` of ``train.bin``.
        val: Validation tokens, shape ``(n_val,)``, dtype ``uint16``,
            read-only ``np.memmap`` of ``val.bin``; never empty.
        vocab_size: Number of token ids (all ids are ``< vocab_size``).
        eos_id: End-of-document id, appended after every document.
        tokenizer: Tokenizer name (``"gpt2"`` or ``"byte"``).
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


def _cache_key(fingerprint: str, tokenizer: str, val_fraction: float) -> str:
    blob = json.dumps([FORMAT_VERSION, fingerprint, tokenizer, float(val_fraction)])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _atomic_write_bytes(path: Path, data: bytes | memoryview) -> None:
    """Writes ``data`` to ``path`` via a temp file in the same folder + fsync + os.replace."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
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


def _split(doc_tokens: list[np.ndarray], val_fraction: float) -> tuple[np.ndarray, np.ndarray, dict]:
    """Splits tokenised documents into train and val streams.

    With at least ``1 / val_fraction`` documents, whole documents go to val:
    ``n_val = round(n_docs * val_fraction)`` of them, evenly spaced through
    the corpus (indices ``(2j + 1) * n_docs // (2 n_val)``). With fewer
    documents, the concatenated stream is cut at token
    ``n - max(1, round(n * val_fraction))``.

    Args:
        doc_tokens: One uint16 array per document, each ending in EOS.
        val_fraction: Target share of val, in (0, 1).

    Returns:
        ``(train, val, info)``: two non-empty uint16 arrays and a dict
        describing the split (stored in ``meta.json``).
    """
    n_docs = len(doc_tokens)
    if n_docs * val_fraction >= 1 and n_docs >= 2:
        n_val = min(n_docs - 1, max(1, round(n_docs * val_fraction)))
        val_idx = sorted({(2 * j + 1) * n_docs // (2 * n_val) for j in range(n_val)})
        val_set = set(val_idx)
        train = np.concatenate([t for i, t in enumerate(doc_tokens) if i not in val_set])
        val = np.concatenate([doc_tokens[i] for i in val_idx])
        return train, val, {"split": "documents", "val_documents": val_idx}
    stream = np.concatenate(doc_tokens)
    n_val = max(1, round(len(stream) * val_fraction))
    cut = len(stream) - n_val
    return stream[:cut], stream[cut:], {"split": "tokens", "val_start_token": int(cut)}


def _try_load(out: Path, tokenizer: str, vocab_size: int) -> TokenData | None:
    """Memory-maps a complete cache folder, or returns None if it is absent/stale/corrupt."""
    meta_path = out / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        ok = (
            meta.get("format") == FORMAT_VERSION
            and meta.get("tokenizer") == tokenizer
            and meta.get("vocab_size") == vocab_size
            and (out / "train.bin").stat().st_size == 2 * meta["train_tokens"]
            and (out / "val.bin").stat().st_size == 2 * meta["val_tokens"]
            and meta["train_tokens"] > 0
            and meta["val_tokens"] > 0
        )
    except (OSError, ValueError, KeyError, TypeError) as exc:
        logger.warning("token cache %s is unreadable (%s); rebuilding", out, exc)
        return None
    if not ok:
        logger.warning("token cache %s does not match its meta.json; rebuilding", out)
        return None
    train = np.memmap(out / "train.bin", dtype=np.uint16, mode="r")
    val = np.memmap(out / "val.bin", dtype=np.uint16, mode="r")
    return TokenData(
        train=train,
        val=val,
        vocab_size=int(meta["vocab_size"]),
        eos_id=int(meta["eos_id"]),
        tokenizer=tokenizer,
        meta={**meta, "dir": str(out), "from_cache": True},
    )


def prepare_tokens(
    corpus: str, tokenizer: str, cache_dir: str | Path, val_fraction: float = 0.05
) -> TokenData:
    """Tokenises a corpus once (cached on disk) and memory-maps train/val tokens.

    Each document is encoded and followed by the tokenizer's EOS id; the split
    is deterministic (see :func:`_split`): whole documents, evenly spaced,
    when there are at least ``1 / val_fraction`` of them, else the last
    ``val_fraction`` of the token stream. A later call with the same corpus
    content, tokenizer and ``val_fraction`` loads the cache without tokenising.

    Args:
        corpus: ``"kjv"``, ``"shakespeare"``, a text file or a folder of
            ``.txt`` files (see :func:`unbubble.data.corpus.load_documents`).
        tokenizer: ``"gpt2"`` or ``"byte"``.
        cache_dir: Folder for prepared corpora; created if missing. Files go
            to ``cache_dir/<key>/{train.bin,val.bin,meta.json}``.
        val_fraction: Target share of tokens held out for validation, in (0, 1).

    Returns:
        :class:`TokenData` with uint16 memmaps ``train`` ``(n_train,)`` and
        ``val`` ``(n_val,)``, both non-empty.

    Raises:
        ConfigError: Bad corpus, unknown tokenizer, vocab too large for
            uint16, ``val_fraction`` outside (0, 1), or an unwritable cache_dir.
    """
    try:
        val_fraction = float(val_fraction)
    except (TypeError, ValueError):
        raise ConfigError(
            f"val_fraction={val_fraction!r} is invalid: must be a number in (0, 1) (set --val-fraction)"
        ) from None
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction={val_fraction!r} is invalid: must be in (0, 1) (set --val-fraction)")
    tok = get_tokenizer(tokenizer)
    _check_uint16_vocab(tok.vocab_size, f"tokenizer={tokenizer!r}")
    folder = Path(corpus).expanduser()
    if folder.is_dir() and ((folder / "train.bin").exists() or (folder / "val.bin").exists()):
        return load_token_folder(folder, tokenizer)
    fingerprint = corpus_fingerprint(corpus)
    key = _cache_key(fingerprint, tok.name, val_fraction)
    out = Path(cache_dir).expanduser() / key

    cached = _try_load(out, tok.name, tok.vocab_size)
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

    docs = load_documents(corpus)
    doc_tokens: list[np.ndarray] = []
    eos = np.array([tok.eos_id], dtype=np.uint16)
    for start in range(0, len(docs), _ENCODE_CHUNK):
        for ids in tok.encode_batch(docs[start:start + _ENCODE_CHUNK]):
            doc_tokens.append(np.concatenate([np.asarray(ids, dtype=np.uint16), eos]))
    train, val, split_info = _split(doc_tokens, val_fraction)
    del doc_tokens

    meta = {
        "format": FORMAT_VERSION,
        "key": key,
        "corpus": str(corpus),
        "corpus_fingerprint": fingerprint,
        "tokenizer": tok.name,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": "uint16",
        "val_fraction": val_fraction,
        "n_documents": len(docs),
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        **split_info,
        "train_sha256": hashlib.sha256(train.tobytes()).hexdigest(),
        "val_sha256": hashlib.sha256(val.tobytes()).hexdigest(),
    }
    try:
        _atomic_write_bytes(out / "train.bin", train.astype("<u2", copy=False).tobytes())
        _atomic_write_bytes(out / "val.bin", val.astype("<u2", copy=False).tobytes())
        _atomic_write_bytes(out / "meta.json", (json.dumps(meta, indent=1) + "\n").encode())
    except OSError as exc:
        raise ConfigError(
            f"cache_dir='{cache_dir}' is not writable ({exc.strerror}): give a writable folder (set --cache-dir)"
        ) from exc
    logger.info(
        "tokenised corpus %r with %s: %d documents -> %d train + %d val tokens (split by %s), cached in %s",
        corpus, tok.name, len(docs), train.size, val.size, split_info["split"], out,
    )
    data = _try_load(out, tok.name, tok.vocab_size)
    if data is None:  # pragma: no cover - only if another process corrupted it in between
        raise ConfigError(f"cache_dir='{cache_dir}': {out} changed while being written: retry (set --cache-dir)")
    return TokenData(data.train, data.val, data.vocab_size, data.eos_id, data.tokenizer,
                     {**data.meta, "from_cache": False})


def load_token_folder(folder: str | Path, tokenizer: str) -> TokenData:
    """A pre-tokenised corpus: ``folder/train.bin`` and ``folder/val.bin`` (nanoGPT format), ids
    of ``tokenizer``'s vocabulary; used as is (no cache).

    Raises:
        ConfigError: a file is missing, empty, of odd size or holds an id ≥ the vocabulary.
    """
    tok = get_tokenizer(tokenizer)
    folder = Path(folder).expanduser()
    train = load_bin(folder / "train.bin", tok.vocab_size, tok.name)
    val = load_bin(folder / "val.bin", tok.vocab_size, tok.name)
    meta = {"format": FORMAT_VERSION, "tokenizer": tok.name, "vocab_size": tok.vocab_size,
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
    if not isinstance(vocab_size, (int, np.integer)) or vocab_size < 1:
        raise ConfigError(f"vocab_size={vocab_size!r} is invalid: must be an integer >= 1 (set --vocab-size)")
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
