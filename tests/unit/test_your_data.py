"""The model's tokenizer, a user's corpus, continued pretraining (issue 41, items 3–5).

Fixtures are built offline in the test: a word-level tokenizer trained with the ``tokenizers`` library
and saved as a ``PreTrainedTokenizerFast``, tiny Llama folders with random weights
(``examples/tiny_checkpoint.py``). References are Hugging Face's own: ``AutoTokenizer`` for the ids,
``model(**batch).logits`` with torch's cross-entropy for the losses, ``generate`` for the logits.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from unbubble.cli import cli
from unbubble.errors import ConfigError

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tiny_checkpoint", ROOT / "examples" / "tiny_checkpoint.py")
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

FAST = ["--engine", "emulator", "--no-tensorboard", "--eval-batches", "2", "--seq-len", "16",
        "--micro-batch-size", "2", "--stages", "2", "--schedule", "1f1b-flush", "--m", "4"]


@pytest.fixture(scope="module")
def docs():
    return tiny.documents(120)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, docs):
    """A Llama folder with fp32 weights and its own tokenizer (300 ids: byte's 257 fit too)."""
    folder = tmp_path_factory.mktemp("model")
    tok = tiny.make_tokenizer(folder, docs, vocab=300)
    tiny.make_model(folder, len(tok))
    return folder


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, docs):
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    path.write_text("".join(json.dumps({"id": i, "text": d}) + "\n" for i, d in enumerate(docs)))
    return path


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    """Documents of 1–3 words (5–12 bytes): every 16-token window packs two or more."""
    path = tmp_path_factory.mktemp("short") / "short.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(tiny.WORDS[i % 40:i % 40 + 1 + i % 3])}) + "\n"
                            for i in range(600)))
    return path


def _train(*args: str) -> str:
    res = CliRunner().invoke(cli, ["-q", "train", *FAST, *args])
    assert res.exit_code == 0, res.output
    return res.output


def _error(*args: str) -> str:
    res = CliRunner().invoke(cli, ["-q", "train", *FAST, *args])
    assert res.exit_code == 2, res.output
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0].removeprefix("error: ")


def _reference_stream(tok, texts, val_idx):
    """The token streams an independent reader writes: each document's ids (AutoTokenizer, no special
    tokens) then EOS, the held-out documents apart."""
    enc = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts]
    train = [i for k, e in enumerate(enc) if k not in set(val_idx) for i in e]
    val = [i for k in val_idx for i in enc[k]]
    return np.array(train), np.array(val)


def _no_half_written(cache: Path) -> None:
    leftovers = [p for p in cache.rglob("*") if p.name.endswith(".tmp")]
    assert not leftovers, leftovers
    for folder in cache.iterdir():
        if folder.is_dir() and folder.name != "datasets":
            assert not (folder / "train.bin").exists() or (folder / "meta.json").exists(), folder


# -- item 3: the model's tokenizer ---------------------------------------------------------------------------------


def test_auto_trains_on_the_model_folders_tokenizer_and_the_run_records_it(tmp_path, checkpoint, jsonl, docs):
    from unbubble.config import TrainConfig
    from unbubble.data.tokenizer import resolve_tokenizer

    assert TrainConfig().tokenizer == "auto"
    assert resolve_tokenizer("auto", "tiny") == "byte"  # presets: today's default, the README's run unchanged
    assert resolve_tokenizer("auto", f"hf:{checkpoint}") == f"hf:{checkpoint.resolve()}"
    run = tmp_path / "run"
    _train("--model", f"hf:{checkpoint}", "--corpus", str(jsonl), "--steps", "2", "--run-dir", str(run),
           "--cache-dir", str(tmp_path / "cache"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokenizer"]["name"] == f"hf:{checkpoint.resolve()}"
    assert summary["tokenizer"]["vocab_size"] == 300 and summary["tokenizer"]["eos_id"] == 2
    assert f"tokenizer: hf:{checkpoint.resolve()}\n" in (run / "config.yaml").read_text()
    (meta_path,) = (tmp_path / "cache").glob("*/meta.json")
    meta = json.loads(meta_path.read_text())
    tok = transformers.AutoTokenizer.from_pretrained(checkpoint)
    train, val = _reference_stream(tok, docs, meta["val_documents"])
    np.testing.assert_array_equal(np.fromfile(meta_path.parent / "train.bin", dtype=np.uint16), train)
    np.testing.assert_array_equal(np.fromfile(meta_path.parent / "val.bin", dtype=np.uint16), val)


def test_the_default_runs_tokens_are_unchanged(tmp_path):
    """The README's run (tiny, kjv, byte): the same token files as before --tokenizer auto (sha256 of main
    at a1c180d), so it ends at the same loss."""
    from unbubble.data import prepare_tokens
    from unbubble.data.tokenizer import resolve_tokenizer

    data = prepare_tokens("kjv", resolve_tokenizer("auto", "tiny"), tmp_path)
    assert (data.train.size, data.val.size, data.train.dtype) == (4004681, 132771, np.uint16)
    assert data.meta["train_sha256"] == "fb0d30ee38d0f5ec054e6cba17b98400b0532b95f3c99b2d38f2a8a3e8804c1a"
    assert data.meta["val_sha256"] == "adcf4b520de5412ad226f6adc743ea7f02865cec478c4173d17e190e4621c284"


def test_a_pretrained_folder_refuses_another_tokenizer_unless_told(tmp_path, checkpoint, jsonl, docs):
    cache = ["--cache-dir", str(tmp_path / "cache"), "--corpus", str(jsonl), "--steps", "1"]
    assert _error("--model", f"hf:{checkpoint}", "--tokenizer", "byte", *cache, "--run-dir", str(tmp_path / "a")) == (
        f"tokenizer='byte' is not the tokenizer of model='hf:{checkpoint}', whose folder holds pretrained weights and "
        "its own tokenizer: its embeddings would read other ids. Drop --tokenizer (auto uses the folder's own), or add "
        "--allow-tokenizer-mismatch if you mean it")
    assert not (tmp_path / "a").exists() and not (tmp_path / "cache").exists()
    _train("--model", f"hf:{checkpoint}", "--tokenizer", "byte", "--allow-tokenizer-mismatch", *cache,
           "--run-dir", str(tmp_path / "b"))
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["tokenizer"]["name"] == "byte"
    # the same tokenizer files in another folder are the same tokenizer
    other = tmp_path / "same-tokenizer"
    tiny.make_tokenizer(other, docs, vocab=300)
    _train("--model", f"hf:{checkpoint}", "--tokenizer", f"hf:{other}", *cache, "--run-dir", str(tmp_path / "c"))
    # weights and no tokenizer: auto does not guess
    bare = tmp_path / "bare"
    tiny.make_model(bare, 300)
    assert _error("--model", f"hf:{bare}", *cache, "--run-dir", str(tmp_path / "d")).startswith(
        f"model='hf:{bare}' holds pretrained weights but no tokenizer (tokenizer.json, tokenizer_config.json, "
        "tokenizer.model, …): save its tokenizer into the folder")


@pytest.mark.parametrize("layers, what", [
    (6, "18 parameter(s) missing from its weights (model.layers.4.input_layernorm.weight, "
        "model.layers.4.mlp.down_proj.weight, model.layers.4.mlp.gate_proj.weight, …)"),
    (3, "9 parameter(s) in its weights but not in the model (model.layers.3.input_layernorm.weight, "
        "model.layers.3.mlp.down_proj.weight, model.layers.3.mlp.gate_proj.weight, …)")])
def test_weights_that_do_not_match_the_folders_config_are_refused(tmp_path, checkpoint, layers, what):
    """The checkpoint's 4 layers under a config of 6 (layers 4 and 5 would start random: 9 parameters
    a Llama layer) or of 3 (layer 3's weights dropped): both trained silently before."""
    from unbubble.models.external import load_external

    folder = tmp_path / "edited"
    shutil.copytree(checkpoint, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}))
    with pytest.raises(ConfigError) as err:
        load_external(f"hf:{folder}", 0)
    assert str(err.value) == (
        f"model='hf:{folder}' is invalid: the weights in {folder} do not match its config.json: {what} (give a "
        "folder whose config.json and weights belong together, as save_pretrained writes them; a folder with "
        "config.json alone starts from random weights)")
    # the untouched folder loads with every parameter its file holds, bit for bit (safetensors' own reader)
    from safetensors.torch import load_file

    saved = load_file(checkpoint / "model.safetensors")
    loaded = load_external(f"hf:{checkpoint}", 0).state_dict()
    assert sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_before_tokenizing(tmp_path, jsonl, docs):
    folder = tmp_path / "small-vocab"
    tiny.make_tokenizer(folder, docs, vocab=300)
    config = transformers.LlamaConfig(vocab_size=200, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    assert _error("--model", f"hf:{folder}", "--corpus", str(jsonl), "--cache-dir", str(tmp_path / "cache"),
                  "--run-dir", str(tmp_path / "run")) == (
        f"tokenizer 'hf:{folder.resolve()}' has 300 ids (0–299) but model='hf:{folder}' has 200 embedding rows: ids ≥ "
        "200 would index past its vocabulary (the folder's tokenizer and config.json disagree: set vocab_size ≥ 300 "
        "in its config.json (model.resize_token_embeddings for weights), or give another --tokenizer)")
    other = tmp_path / "big-tokenizer"  # another folder's tokenizer: the model's own is the remedy
    tiny.make_tokenizer(other, docs, vocab=300)
    assert _error("--model", f"hf:{folder}", "--tokenizer", f"hf:{other}", "--allow-tokenizer-mismatch", "--corpus",
                  str(jsonl), "--cache-dir", str(tmp_path / "cache"), "--run-dir", str(tmp_path / "run")).endswith(
        "ids ≥ 200 would index past its vocabulary (give a model with vocab_size ≥ 300, or the model's own tokenizer "
        "with --tokenizer)")
    assert not (tmp_path / "cache").exists()  # refused before the corpus was read


# -- item 4: a user's corpus -----------------------------------------------------------------------------------


def _write_formats(root: Path, docs: list[str]) -> dict[str, Path]:
    rows = [{"id": i, "text": d} for i, d in enumerate(docs)]
    ds = datasets.Dataset.from_list(rows)
    out = {"jsonl": root / "c.jsonl", "json": root / "c.json", "parquet": root / "c.parquet",
           "arrow": root / "arrow" / "data.arrow", "save_to_disk": root / "saved", "jsonl folder": root / "shards",
           "txt folder": root / "texts"}
    out["jsonl"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    out["json"].write_text(json.dumps(rows))
    ds.to_parquet(str(out["parquet"]))
    ds.save_to_disk(str(out["save_to_disk"]))
    out["arrow"].parent.mkdir()
    (out["arrow"]).write_bytes(next(out["save_to_disk"].glob("*.arrow")).read_bytes())
    out["jsonl folder"].mkdir()
    for k in range(3):  # sorted file names keep the documents' order
        part = rows[k * len(rows) // 3:(k + 1) * len(rows) // 3]
        (out["jsonl folder"] / f"part-{k}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    out["txt folder"].mkdir()
    for i, d in enumerate(docs):
        (out["txt folder"] / f"doc{i:05d}.txt").write_text(d)
    return out


def test_every_corpus_format_gives_the_tokenizers_own_ids(tmp_path, checkpoint, docs):
    """jsonl, json, parquet, arrow, a save_to_disk folder, a folder of jsonl files and a folder of .txt files:
    the same token files, equal to AutoTokenizer's ids joined with EOS; tokens/s printed per format."""
    from unbubble.data import prepare_tokens
    from unbubble.data.tokenizer import get_tokenizer

    tok = get_tokenizer(f"hf:{checkpoint}")
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)
    for name, path in _write_formats(tmp_path, docs).items():
        data = prepare_tokens(str(path), tok, tmp_path / "cache")
        train, val = _reference_stream(reference, docs, data.meta["val_documents"])
        np.testing.assert_array_equal(data.train, train, err_msg=name)
        np.testing.assert_array_equal(data.val, val, err_msg=name)
        print(f"{name}: {data.meta['train_tokens'] + data.meta['val_tokens']} tokens, "
              f"{data.meta['tokens_per_s']:,} tokens/s")
    _no_half_written(tmp_path / "cache")


def test_a_compressed_jsonl_corpus_gives_the_tokenizers_own_ids(tmp_path, checkpoint, docs):
    """A .jsonl.gz (C4's shards are .json.gz) and a folder of .json.gz shards are read as tables, their rows'
    ids equal to AutoTokenizer's; once they were read as one UTF-8 text file ("is not UTF-8 text")."""
    import gzip

    from unbubble.data import prepare_tokens

    rows = [{"id": i, "body": d} for i, d in enumerate(docs)]
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    shards = tmp_path / "shards"
    shards.mkdir()
    for k in range(2):
        with gzip.open(shards / f"c4-train.{k:05d}-of-00002.json.gz", "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[k * len(rows) // 2:(k + 1) * len(rows) // 2])
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)
    for corpus in (path, shards):
        data = prepare_tokens(str(corpus), f"hf:{checkpoint}", tmp_path / "cache", text_field="body")
        train, val = _reference_stream(reference, docs, data.meta["val_documents"])
        np.testing.assert_array_equal(data.train, train, err_msg=str(corpus))
        np.testing.assert_array_equal(data.val, val, err_msg=str(corpus))


def test_the_cache_is_keyed_by_content_and_tokenizer(tmp_path, checkpoint, docs, caplog):
    from unbubble.data import prepare_tokens

    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    first = prepare_tokens(str(path), f"hf:{checkpoint}", tmp_path / "cache")
    assert first.meta["from_cache"] is False
    assert prepare_tokens(str(path), f"hf:{checkpoint}", tmp_path / "cache").meta["from_cache"] is True
    # one word changed, same size and modification time: a new key, not the stale cache
    stat = path.stat()
    text = path.read_text()
    path.write_text(text.replace("the light", "the ligth", 1) if "the light" in text else text.replace("the", "eht", 1))
    import os

    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    edited = prepare_tokens(str(path), f"hf:{checkpoint}", tmp_path / "cache")
    assert edited.meta["key"] != first.meta["key"] and edited.meta["from_cache"] is False
    # ... holding the edited rows' ids: datasets' own table cache (keyed by path and mtime) once served
    # the old rows here, so the new key held the old tokens
    texts = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert texts != docs
    train, val = _reference_stream(transformers.AutoTokenizer.from_pretrained(checkpoint), texts,
                                   edited.meta["val_documents"])
    np.testing.assert_array_equal(edited.train, train)
    np.testing.assert_array_equal(edited.val, val)
    # another tokenizer (a copy with one more word): another key
    other = tmp_path / "tok2"
    tiny.make_tokenizer(other, [*docs, "zebra"], vocab=300)
    again = prepare_tokens(str(path), f"hf:{other}", tmp_path / "cache")
    assert again.meta["key"] != edited.meta["key"] and again.meta["from_cache"] is False
    # the same tokenizer files in another folder (a model's copy): the same cache, read without a warning
    # (it was matched by the folder's path: "does not match its meta.json; rebuilding" on every switch)
    twin = tmp_path / "twin"
    shutil.copytree(other, twin)
    with caplog.at_level(logging.WARNING, logger="unbubble"):
        shared = prepare_tokens(str(path), f"hf:{twin}", tmp_path / "cache")
    assert shared.meta["key"] == again.meta["key"] and shared.meta["from_cache"] is True
    assert shared.tokenizer == shared.meta["tokenizer"] == f"hf:{twin}" and not caplog.records
    np.testing.assert_array_equal(shared.train, again.train)
    # a bad row late in the corpus: an error, and no half-written files left
    path.write_text(path.read_text() + json.dumps({"text": None}) + "\n")
    with pytest.raises(ConfigError, match=rf"row {len(docs)} of column 'text' is null, not text"):
        prepare_tokens(str(path), f"hf:{checkpoint}", tmp_path / "cache")
    _no_half_written(tmp_path / "cache")


def test_bad_corpora_are_one_line_each_and_nothing_half_written(tmp_path, checkpoint):
    import pyarrow as pa
    import pyarrow.parquet as pq

    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"text": "  "}) + "\n" + json.dumps({"text": ""}) + "\n")
    fields = tmp_path / "fields.jsonl"
    fields.write_text(json.dumps({"content": "in the beginning", "id": 1}) + "\n")
    numbers = tmp_path / "numbers.parquet"
    pq.write_table(pa.table({"text": [1, 2, 3]}), numbers)
    small = tmp_path / "small.jsonl"
    small.write_text("".join(json.dumps({"text": "the word"}) + "\n" for _ in range(10)))
    corrupt = tmp_path / "corrupt.parquet"
    pq.write_table(pa.table({"text": ["the word was with god"] * 50}), corrupt)
    corrupt.write_bytes(corrupt.read_bytes()[:120])
    cache = tmp_path / "cache"
    args = ["--model", f"hf:{checkpoint}", "--cache-dir", str(cache), "--run-dir", str(tmp_path / "run"), "--corpus"]
    messages = {
        empty: f"corpus='{empty}' holds no rows (its files are empty or blank lines only): ",
        blank: f"corpus='{blank}' is an empty corpus: all 2 documents are empty or whitespace",
        fields: f"corpus='{fields}' has no column 'text': its columns are 'content', 'id' (set --text-field to the "
                "one holding the text)",
        numbers: f"corpus='{numbers}': column 'text' holds Value('int64') values, not text (set --text-field to the "
                 "column holding the text)",
        small: "seq_len=16 is too long for this corpus: the validation split has 2 tokens; the corpus has 30",
        corrupt: f"corpus='{corrupt}' is not readable parquet (.parquet) (",
    }
    for path, message in messages.items():
        line = _error(*args, str(path))
        assert line.startswith(message), line
    assert not (tmp_path / "run").exists()
    _no_half_written(cache)
    # the text in another column: --text-field
    fields.write_text("".join(json.dumps({"content": f"in the beginning was the word {i}"}) + "\n" for i in range(60)))
    _train(*args, str(fields), "--text-field", "content", "--steps", "1", "--run-dir", str(tmp_path / "ok"))


def test_a_folder_mixing_text_and_tables_a_bad_json_line_and_blank_lines_are_named(tmp_path, checkpoint, docs):
    """A folder of .txt and .jsonl/.parquet files was read as its .txt files alone (the tables silently
    left out); a broken .jsonl line was reported as datasets' generic "An error occurred"; a file of
    blank lines as "Instruction 'train' corresponds to no data"."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.txt").write_text(docs[0])
    (mixed / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[1:60]))
    pq.write_table(pa.table({"text": docs[60:]}), mixed / "c.parquet")
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[:50]) + "{not json\n")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n  \n")
    cache = tmp_path / "cache"
    args = ["--model", f"hf:{checkpoint}", "--cache-dir", str(cache), "--run-dir", str(tmp_path / "run"), "--corpus"]
    assert _error(*args, str(mixed)).startswith(
        f"corpus='{mixed}' is a folder mixing .txt files and table files ('b.jsonl', 'c.parquet') (keep one format "
        "per corpus): ")
    assert _error(*args, str(broken)).startswith(
        f"corpus='{broken}' is not readable json (.jsonl) (ArrowInvalid: JSON parse error: Missing a name for object "
        "member. in row 50): ")
    assert _error(*args, str(blank)).startswith(f"corpus='{blank}' holds no rows (its files are empty or blank "
                                                "lines only): ")
    assert not (tmp_path / "run").exists()


# -- item 3: a vocabulary above 65,535 ------------------------------------------------------------------------------


def test_a_vocabulary_above_uint16_trains_on_uint32_token_files(tmp_path):
    """70,000 ids, documents of words whose ids are above 65,535: the token files are uint32, and the run's
    version-0 validation loss is the unsplit model's own (model(**batch).logits, torch's cross-entropy) on
    the same windows: no id was truncated to 16 bits."""
    from unbubble.data import val_batches

    folder = tmp_path / "big"
    base = tiny.documents(60)
    tok = tiny.make_tokenizer(folder, base, vocab=70_000)
    rng = np.random.default_rng(0)
    docs = [" ".join([d, *(f"w{i}" for i in rng.integers(65_536, 70_000, size=8))]) for d in base]
    model = tiny.make_model(folder, len(tok), hidden=16, layers=2)
    corpus = tmp_path / "big.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    run = tmp_path / "run"
    t0 = time.perf_counter()
    _train("--model", f"hf:{folder}", "--corpus", str(corpus), "--steps", "3", "--eval-interval", "3",
           "--cache-dir", str(tmp_path / "cache"), "--run-dir", str(run))
    print(f"uint32 run: {time.perf_counter() - t0:.1f} s")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["tokenizer"]["vocab_size"] == 70_000 and summary["tokenizer"]["dtype"] == "uint32"
    (meta_path,) = (tmp_path / "cache").glob("*/meta.json")
    val = np.memmap(meta_path.parent / "val.bin", dtype=np.uint32, mode="r")
    assert json.loads(meta_path.read_text())["dtype"] == "uint32" and int(val.max()) >= 65_536
    model.eval()
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
                  for x, y in val_batches(val, 2, 16, 2, warn=False)]
    print(f"uint32 run: val loss {summary['initial_val_loss']:.4f} -> {summary['final_val_loss']:.4f}")
    assert summary["initial_val_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)
    assert np.isfinite(summary["final_val_loss"])


# -- item 4: --document-mask --------------------------------------------------------------------------------------


def test_document_batches_restart_positions_and_hf_attends_within_each_document(checkpoint):
    from unbubble.train import document_batch

    x = torch.tensor([[5, 6, 2, 7, 8, 9, 2, 4]])
    y = torch.tensor([[6, 2, 7, 8, 9, 2, 4, 3]])
    batch, targets = document_batch(x, y, eos_id=2)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]
    assert targets.tolist() == [[6, 2, -100, 8, 9, 2, -100, 3]]
    # what the stages are given is what HF's own packed rows compute: each document alone
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    model.config.use_cache = False
    with torch.no_grad():
        packed = model(**batch).logits
        alone = torch.cat([model(input_ids=x[:, a:b]).logits for a, b in ((0, 3), (3, 7), (7, 8))], dim=1)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)


def test_document_mask_trains_an_hf_model_and_presets_refuse_it(tmp_path, checkpoint, short):
    """A run with --document-mask: its version-0 validation loss is the unsplit model's own on packed rows
    whose documents are apart (each document's windows run alone, EOS targets not counted)."""
    from unbubble.data import val_batches
    from unbubble.train import document_batch

    run = tmp_path / "run"
    _train("--model", f"hf:{checkpoint}", "--corpus", str(short), "--document-mask", "--steps", "2",
           "--cache-dir", str(tmp_path / "cache"), "--run-dir", str(run))
    (meta_path,) = (tmp_path / "cache").glob("*/meta.json")
    val = np.memmap(meta_path.parent / "val.bin", dtype=np.uint16, mode="r")
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    model.config.use_cache = False
    total, restarts = [], 0
    with torch.no_grad():
        for x, y in val_batches(val, 2, 16, 2, warn=False):
            batch, targets = document_batch(x, y, 2)
            restarts += int((batch["position_ids"][:, 1:] == 0).sum())
            logits = model(**batch).logits
            total.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                           ignore_index=-100).item())
    assert restarts >= 1  # the windows do pack documents
    summary = json.loads((run / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(sum(total) / len(total), abs=1e-5)
    # trained without the cache, exported with it (the export's generate ran without one)
    from unbubble.export import export

    own = json.loads((checkpoint / "config.json").read_text()).get("use_cache", True)
    out = export(run, tmp_path / "export")
    assert own is True and json.loads((out / "config.json").read_text())["use_cache"] is own
    assert transformers.AutoModelForCausalLM.from_pretrained(out).config.use_cache is own
    assert _error("--document-mask", "--model", "llama-tiny", "--corpus", str(short), "--steps", "1").startswith(
        "document_mask=True is not supported by model='llama-tiny': its attention spans the whole packed row; "
        "--document-mask is for the GPT-2 presets (tiny, ")


def test_train_model_with_document_mask_gives_the_caller_its_model_with_its_own_cache(tmp_path, checkpoint, short):
    """train_model(model, document_mask=True) trains with use_cache=False; the caller's model then generates with
    the cache its config asked for (it was left False)."""
    import unbubble

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.config.use_cache is True
    result, _ = unbubble.train_model(model, schedule="1f1b-flush", run_dir=tmp_path / "run", corpus=str(short),
                                     tokenizer=f"hf:{checkpoint}", document_mask=True, steps=1, stages=2, m=2,
                                     seq_len=16, micro_batch_size=2, eval_batches=1, engine="emulator",
                                     tensorboard=False, cache_dir=str(tmp_path / "cache"), progress=False)
    assert result is not None and model.config.use_cache is True


def test_document_mask_on_a_gpt2_preset_equals_each_document_alone(tmp_path, short):
    """The tiny preset with --document-mask on 2 stages: its version-0 validation loss is the whole model
    (one stage, the same seed's weights) run on each packed document alone, causal as usual, EOS targets
    not counted; and a packed row's logits are each document's own."""
    from unbubble.data import val_batches
    from unbubble.models import build_stages, make_config
    from unbubble.train import document_batch

    run = tmp_path / "run"
    _train("--model", "tiny", "--tokenizer", "byte", "--corpus", str(short), "--document-mask", "--steps", "2",
           "--cache-dir", str(tmp_path / "cache"), "--run-dir", str(run))
    (meta_path,) = (tmp_path / "cache").glob("*/meta.json")
    val = np.memmap(meta_path.parent / "val.bin", dtype=np.uint16, mode="r")
    whole = build_stages(make_config("tiny", 257), 1, 0, seq_len=16)[0].eval()
    losses = []
    with torch.no_grad():
        for x, y in val_batches(val, 2, 16, 2, warn=False):
            batch, targets = document_batch(x, y, 256)
            assert ((batch["position_ids"][:, 1:] == 0).sum(dim=1) >= 1).all()  # every row packs documents
            rows = []
            for b in range(x.shape[0]):
                starts = [*torch.nonzero(batch["position_ids"][b] == 0).flatten().tolist(), x.shape[1]]
                rows.append(torch.cat([whole(x[b:b + 1, a:e]) for a, e in zip(starts, starts[1:])], dim=1))
            alone = torch.cat(rows)
            torch.testing.assert_close(whole(batch), alone, rtol=0, atol=1e-5)
            losses.append(torch.nn.functional.cross_entropy(alone.flatten(0, 1), targets.flatten(),
                                                            ignore_index=-100).item())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)


# -- item 5: continued pretraining ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype,shard", [("float32", None), ("bfloat16", "40KB")])
def test_continued_pretraining_starts_from_the_weights_and_exports_what_it_trained(tmp_path, jsonl, docs, dtype,
                                                                                   shard):
    """A folder of bf16 or fp32 safetensors (sharded too) starts the run: the version-0 validation loss is the
    pretrained model's own. The export loads with from_pretrained (tokenizer included), and generate's logits
    are the run's final logits (the trained stages chained on the same prompt)."""
    from unbubble.config import TrainConfig
    from unbubble.data import val_batches
    from unbubble.export import export
    from unbubble.models.external import load_external
    from unbubble.train import train

    folder = tmp_path / "pretrained"
    tok = tiny.make_tokenizer(folder, docs, vocab=300)
    tiny.make_model(folder, len(tok), dtype=dtype, max_shard_size=shard)
    if shard:
        assert len(list(folder.glob("model-*.safetensors"))) > 1
    cfg = TrainConfig(model=f"hf:{folder}", corpus=str(jsonl), steps=4, eval_interval=4, eval_batches=2, seq_len=16,
                      micro_batch_size=2, stages=2, schedule="1f1b-flush", m=4, engine="emulator", tensorboard=False,
                      run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"))
    result, run_dir = train(cfg)
    pretrained = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    (meta_path,) = (tmp_path / "cache").glob("*/meta.json")
    val = np.memmap(meta_path.parent / "val.bin", dtype=np.uint16, mode="r")
    with torch.no_grad():
        losses = [torch.nn.functional.cross_entropy(pretrained(input_ids=x).logits.flatten(0, 1), y.flatten()).item()
                  for x, y in val_batches(val, 2, 16, 2, warn=False)]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["initial_val_loss"] == pytest.approx(sum(losses) / len(losses), abs=1e-5)

    out = export(run_dir, tmp_path / "exported")
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    prompt = tokenizer("in the beginning was the word", return_tensors="pt", add_special_tokens=False)
    generated = exported.generate(**prompt, max_new_tokens=3, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id)
    # the run's final logits: its trained stages, chained, on the prompt and the generated tokens
    from unbubble.models.split import split_model

    stages = split_model(load_external(cfg.model, cfg.seed), 2).stages()
    for stage, state in zip(stages, result.final_states):
        stage.load_state_dict(state)
        stage.eval()
    ids = generated.sequences[:, :-1]
    with torch.no_grad():
        h = ids
        for stage in stages:
            h = stage(h)
    n = prompt["input_ids"].shape[1]
    run_logits = h[:, n - 1:]
    gen_logits = torch.stack(generated.logits, dim=1)
    diff = (run_logits - gen_logits).abs().max().item()
    print(f"{dtype}{' sharded' if shard else ''}: export -> from_pretrained -> generate, max |logit difference| "
          f"{diff:.3g} (logits up to {gen_logits.abs().max().item():.3g})")
    assert diff <= 1e-5
    assert not torch.equal(exported.lm_head.weight, pretrained.lm_head.weight)  # it trained
