"""Deterministic micro-batch sampling from a 1-D token stream.

Training micro-batches are random windows whose offsets depend only on
``(seed, k)`` (``k`` = global micro-batch id), so pipeline stages or data
ranks that build their own sampler see identical batches for the same ``k``
without communicating. Validation batches are a fixed set of windows.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from unbubble.errors import ConfigError, check_int

logger = logging.getLogger(__name__)


def _check_tokens(tokens: np.ndarray, micro_batch_size: int, seq_len: int) -> np.ndarray:
    """Validates sampler arguments; returns ``tokens`` as a 1-D integer array (no copy)."""
    check_int("micro_batch_size", micro_batch_size, 1, "set --micro-batch-size", integers=(int, np.integer))
    check_int("seq_len", seq_len, 1, "set --seq-len", integers=(int, np.integer))
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"tokens of shape {arr.shape} and dtype {arr.dtype} are invalid: must be a 1-D integer array")
    if arr.size <= seq_len + 1:
        raise ConfigError(
            f"seq_len={seq_len} is too large for a corpus of {arr.size} tokens: "
            f"need more than seq_len + 1 tokens; use a bigger corpus or a smaller seq_len (set --seq-len)"
        )
    return arr


def check_split_sizes(n_train: int, n_val: int, seq_len: int) -> None:
    """Checks that both splits of a corpus hold a window of ``seq_len`` + 1 tokens.

    Args:
        n_train: tokens of the training split.
        n_val: tokens of the validation split.
        seq_len: tokens per window (the target is shifted by one, so a split needs ``seq_len + 2``).

    Raises:
        ConfigError: a split is too small; the message names the smaller failing split, its size,
            the corpus's size and the largest ``seq_len`` that fits.
    """
    failing = [(n, name) for n, name in ((n_train, "training"), (n_val, "validation")) if n <= seq_len + 1]
    if not failing:
        return
    n, name = min(failing)
    fix = f"set --seq-len {n - 2} or less, or give a larger corpus" if n > 2 else "give a larger corpus"
    raise ConfigError(f"seq_len={seq_len} is too long for this corpus: the {name} split has {n:,} tokens; the corpus "
                      f"has {n_train + n_val:,} (a split needs seq_len + 2 = {seq_len + 2:,}): {fix}")


def _gather(tokens: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cuts windows ``tokens[s : s + seq_len + 1]`` and returns (x, y) int64 tensors of shape (B, seq_len)."""
    idx = starts[:, None] + np.arange(seq_len + 1, dtype=np.int64)[None, :]
    buf = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


class MicroBatchSampler:
    """Random training micro-batches, a pure function of ``(seed, k)``.

    Micro-batch ``k`` holds ``micro_batch_size`` windows starting at offsets
    drawn uniformly from ``[0, len(tokens) - seq_len - 1]`` by
    ``np.random.default_rng([seed, k])``; ``y`` is ``x`` shifted by one token.

    Args:
        tokens: 1-D integer token stream (e.g. ``TokenData.train``, uint16 memmap).
        micro_batch_size: Windows per micro-batch, >= 1.
        seq_len: Tokens per window, >= 1; ``len(tokens)`` must exceed ``seq_len + 1``.
        seed: Non-negative integer run seed.

    Raises:
        ConfigError: On invalid sizes, a negative seed, or a corpus too small for ``seq_len``.
    """

    def __init__(self, tokens: np.ndarray, micro_batch_size: int, seq_len: int, seed: int) -> None:
        self.tokens = _check_tokens(tokens, micro_batch_size, seq_len)
        check_int("seed", seed, 0, "set --seed", integers=(int, np.integer))
        self.micro_batch_size = int(micro_batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.n_starts = int(self.tokens.size - self.seq_len)  # valid offsets: 0 .. n_starts - 1

    def offsets(self, k: int) -> np.ndarray:
        """Start offsets of micro-batch ``k``.

        Args:
            k: Global micro-batch id, >= 0.

        Returns:
            int64 array, shape ``(micro_batch_size,)``, values in ``[0, len(tokens) - seq_len - 1]``.
        """
        check_int("micro-batch id k", k, 0, error=ValueError, integers=(int, np.integer))
        rng = np.random.default_rng([self.seed, int(k)])
        return rng.integers(0, self.n_starts, size=self.micro_batch_size, dtype=np.int64)

    def get(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns micro-batch ``k``.

        Args:
            k: Global micro-batch id, >= 0.

        Returns:
            ``(x, y)``: ``torch.int64`` tensors of shape ``(micro_batch_size, seq_len)``
            with ``y[:, t] == tokens[start + t + 1]`` and ``x[:, t] == tokens[start + t]``.
        """
        return _gather(self.tokens, self.offsets(k), self.seq_len)

    def __repr__(self) -> str:
        return (f"MicroBatchSampler(n_tokens={self.tokens.size}, micro_batch_size={self.micro_batch_size}, "
                f"seq_len={self.seq_len}, seed={self.seed})")


def val_overlap_warning(n_tokens: int, micro_batch_size: int, seq_len: int, n_batches: int) -> str | None:
    """The warning :func:`val_batches` logs when a validation stream of ``n_tokens`` holds fewer
    disjoint windows of ``seq_len`` than the ``n_batches × micro_batch_size`` it reads (they then
    overlap, and the loss averages repeated tokens), with the remedy; ``None`` when they fit."""
    windows = (n_tokens - 1) // seq_len
    wanted = n_batches * micro_batch_size
    if wanted <= windows:
        return None
    fits = windows // micro_batch_size
    remedy = (f"set --eval-batches {fits} or less, or give a larger corpus" if fits >= 1 else
              "give a larger corpus, or a smaller --seq-len or --micro-batch-size")
    return (f"the validation split's {n_tokens:,} tokens hold {windows} window{'' if windows == 1 else 's'} of "
            f"seq_len={seq_len}, fewer than "
            f"the {wanted} an evaluation reads (eval_batches={n_batches} × micro_batch_size={micro_batch_size}): "
            f"windows overlap and the validation loss counts tokens more than once ({remedy})")


def val_batches(
    tokens: np.ndarray, micro_batch_size: int, seq_len: int, n_batches: int, warn: bool = True
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation micro-batches spread evenly over a token stream.

    ``n = n_batches * micro_batch_size`` windows start at
    ``j * (len(tokens) - seq_len - 1) // (n - 1)``; when
    ``n <= (len(tokens) - 1) // seq_len`` their ``x`` parts do not overlap,
    otherwise they overlap (:func:`val_overlap_warning` is logged unless ``warn`` is false) but
    stay evenly spaced.

    Args:
        tokens: 1-D integer token stream (e.g. ``TokenData.val``).
        micro_batch_size: Windows per micro-batch, >= 1.
        seq_len: Tokens per window, >= 1.
        n_batches: Number of micro-batches, >= 1.
        warn: log the overlap warning (a training run logs it once, up front, not in every stage).

    Returns:
        ``n_batches`` pairs ``(x, y)`` of ``torch.int64`` tensors, each of shape
        ``(micro_batch_size, seq_len)``, ``y`` = ``x`` shifted by one token.

    Raises:
        ConfigError: On invalid sizes or a stream too small for ``seq_len``.
    """
    arr = _check_tokens(tokens, micro_batch_size, seq_len)
    check_int("n_batches", n_batches, 1, "set --eval-batches", integers=(int, np.integer))
    n = int(n_batches) * int(micro_batch_size)
    last = arr.size - seq_len - 1  # largest valid start
    if n == 1:
        starts = np.zeros(1, dtype=np.int64)
    else:
        starts = (np.arange(n, dtype=np.int64) * last) // (n - 1)
    message = val_overlap_warning(arr.size, micro_batch_size, seq_len, n_batches)
    if warn and message is not None:
        logger.warning(message)
    out = []
    for b in range(int(n_batches)):
        out.append(_gather(arr, starts[b * micro_batch_size:(b + 1) * micro_batch_size], seq_len))
    return out
