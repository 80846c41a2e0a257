"""A tiny pretrained checkpoint, its own tokenizer and a jsonl corpus, made offline in seconds.

    python examples/tiny_checkpoint.py my-model my-data.jsonl

writes ``my-model/`` (a 4-layer Llama: ``config.json``, ``model.safetensors`` and the tokenizer files
``save_pretrained`` writes: a word-level tokenizer trained with the ``tokenizers`` library on the
corpus, EOS ``</s>``) and ``my-data.jsonl`` (one ``{"text": ...}`` document per line) — what
``unbubble train --model hf:my-model --corpus my-data.jsonl`` continues training, as a real checkpoint
downloaded from the Hub would be (docs/tutorial.md, "Continue training your checkpoint on your data").
``--vocab N`` pads the vocabulary to N ids with extra words (above 65,536 the token files are uint32).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("the light shone in the darkness and the darkness did not overcome it . in the beginning was the word "
         "and the word was with god . the wind blows where it wishes and you hear its sound").split()


def documents(n: int = 400, seed: int = 0) -> list[str]:
    """``n`` short documents of 1–4 sentences drawn from a small word list (deterministic)."""
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) for _ in range(rng.randint(1, 4))]
        docs.append(" . ".join(sentences) + " .")
    return docs


def make_tokenizer(folder: str | Path, texts: list[str], vocab: int | None = None):
    """A word-level tokenizer of ``texts``' words (``<unk>`` 0, ``<pad>`` 1, ``</s>`` 2, EOS), padded with
    words ``w<i>`` to ``vocab`` ids when given, as a ``PreTrainedTokenizerFast`` saved into ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for t in texts for w in t.split()})
    table = {w: i for i, w in enumerate(["<unk>", "<pad>", "</s>", *words])}
    for i in range(len(table), vocab or 0):
        table[f"w{i}"] = i
    backend = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")
    tok.save_pretrained(folder)
    return tok


def make_model(folder: str | Path, vocab: int, dtype: str = "float32", hidden: int = 32, layers: int = 4,
               max_shard_size: str | None = None, seed: int = 0):
    """A small ``LlamaForCausalLM`` (``vocab`` rows, untied head) with random weights saved into ``folder``
    as safetensors (``dtype`` float32 or bfloat16; ``max_shard_size`` shards it, e.g. ``"50KB"``)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128, tie_word_embeddings=False, bos_token_id=None,
                                      eos_token_id=2, pad_token_id=1)
    model = transformers.LlamaForCausalLM(config).to(getattr(torch, dtype))
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(folder, **kwargs)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="folder to write the model and its tokenizer into")
    parser.add_argument("corpus", help="jsonl file to write the documents into")
    parser.add_argument("--vocab", type=int, default=None, help="pad the vocabulary to this many ids")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args()
    docs = documents()
    tok = make_tokenizer(args.model, docs, args.vocab)
    make_model(args.model, len(tok), args.dtype)
    with open(args.corpus, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    print(f"{args.model}: Llama, 4 layers, {len(tok)} ids ({args.dtype}) with its tokenizer; "
          f"{args.corpus}: {len(docs)} documents")


if __name__ == "__main__":
    main()
