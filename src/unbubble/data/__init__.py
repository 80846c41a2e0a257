"""Offline text data: tokenizers, corpora, uint16 token caches and micro-batch samplers."""

from unbubble.data.corpus import BUILTIN_CORPORA, corpus_fingerprint, load_documents
from unbubble.data.memmap import TokenData, load_bin, prepare_tokens
from unbubble.data.sampler import MicroBatchSampler, val_batches, val_overlap_warning
from unbubble.data.tokenizer import Tokenizer, get_tokenizer

__all__ = [
    "BUILTIN_CORPORA",
    "MicroBatchSampler",
    "TokenData",
    "Tokenizer",
    "corpus_fingerprint",
    "get_tokenizer",
    "load_bin",
    "load_documents",
    "prepare_tokens",
    "val_batches",
    "val_overlap_warning",
]
