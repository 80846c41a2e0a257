"""Nothing lost, nothing silently wrong: files written whole or not at all, operating-system errors
in one line, one process per run folder, and a memory estimate before a model is built.

Notes: [Note: writes are whole or absent], [Note: the run folder's lock] in docs/architecture.md#safetypy.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

from unbubble.errors import ConfigError

log = logging.getLogger(__name__)

#: the lock file's name inside a run folder ([Note: the run folder's lock])
LOCK_NAME = ".lock"

_CAUSES = {
    errno.EROFS: "read-only file system",
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.ENAMETOOLONG: "file name too long",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
    errno.EISDIR: "it is a folder",
    errno.ENOENT: "no such file or folder",
    errno.EEXIST: "it already exists",
    errno.EIO: "input/output error",
    errno.EMFILE: "too many open files",
    errno.ENOTEMPTY: "the folder is not empty",
    errno.EXDEV: "it is on another file system",
    errno.ELOOP: "too many symbolic links",
}


def os_error_line(exc: OSError, path: str | os.PathLike | None = None) -> str:
    """One line for an operating-system error: the path, the cause in words and its errno name,
    e.g. ``"cannot write 'out/model.pt': no space left on device (ENOSPC)"``.

    Args:
        exc: the error.
        path: the path to name when ``exc`` carries none (a failed ``write`` of an open file).
    """
    name = exc.filename if exc.filename is not None else path
    code = exc.errno
    where = f" {str(name)!r}" if name is not None else ""
    if exc.filename2 is not None:
        where += f" → {str(exc.filename2)!r}"
    what = "cannot write" if code in (errno.EROFS, errno.ENOSPC, errno.EDQUOT) else "file system error on"
    note = ""
    if exc.strerror and exc.strerror.startswith("checkpoint not written"):
        what, note = "cannot write checkpoint", "; the previous checkpoint is kept"
    return f"{what}{where}: {os_cause(exc) if code else str(exc)}{note}"


def os_cause(exc: OSError) -> str:
    """The cause of ``exc`` in words with its errno name: ``"file name too long (ENAMETOOLONG)"``."""
    code = exc.errno
    cause = _CAUSES.get(code, (exc.strerror or str(exc)).lower())
    return cause + (f" ({errno.errorcode[code]})" if code in errno.errorcode else "")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write; renamed to ``path`` when the block ends without
    an error, removed otherwise ([Note: writes are whole or absent]). An ``OSError`` from the block
    without a file name gets ``path``'s."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as exc:
        _remove(tmp)
        if exc.filename is None or Path(str(exc.filename)) == tmp:
            raise OSError(exc.errno, exc.strerror, str(path)) from None
        raise
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: Path) -> None:
    try:
        tmp.unlink(missing_ok=True)
    except OSError:
        pass


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)``, whole or not at all ([Note: writes are whole or absent])."""
    with atomic_path(path) as tmp, open(tmp, "w") as f:
        f.write(text)


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save(obj, path)``, whole or not at all; a full disk raises ``OSError`` (ENOSPC)
    naming ``path`` ([Note: writes are whole or absent])."""
    import torch

    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        torch.save(obj, f)


# -- the run folder's lock ----------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _read_lock(path: Path) -> dict | None:
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # being written, or damaged: treated as held by an unknown process
    return info if isinstance(info, dict) else {}


class RunLock:
    """``RUN/.lock``: the run folder belongs to this process until :meth:`release`
    ([Note: the run folder's lock]).

    Raises:
        ConfigError: another live process holds the folder (the line names its pid, host and start).
    """

    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self.held = False
        info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                "started_epoch": time.time()}
        for _ in range(3):  # a stale lock is removed, then taken again (another process may win that race)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                other = _read_lock(self.path)
                if other is None:
                    continue  # released meanwhile
                if self._stale(other):
                    log.warning("run folder %s: removing the stale lock of process %s on %s (started %s), which is "
                                "no longer running", self.path.parent, other.get("pid"), other.get("host"),
                                other.get("started"))
                    self.path.unlink(missing_ok=True)
                    continue
                raise ConfigError(_held_line(self.path, other)) from None
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(info) + "\n")
            self.held = True
            return
        raise ConfigError(_held_line(self.path, _read_lock(self.path) or {}))

    @staticmethod
    def _stale(info: dict) -> bool:
        pid = info.get("pid")
        return (info.get("host") == socket.gethostname() and isinstance(pid, int) and pid != os.getpid()
                and not _alive(pid))

    def release(self) -> None:
        """Removes the lock if this process still holds it (idempotent)."""
        if not self.held:
            return
        self.held = False
        info = _read_lock(self.path)
        if info and info.get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def lock_holder(run_dir: str | os.PathLike) -> dict | None:
    """Who holds ``RUN/.lock`` now (``pid``, ``host``, ``started``; ``{}`` while it is being written),
    or None when the folder is free or its holder is gone ([Note: the run folder's lock])."""
    info = _read_lock(Path(run_dir) / LOCK_NAME)
    return None if info is None or RunLock._stale(info) else info


def _held_line(path: Path, info: dict) -> str:
    who = f"process {info.get('pid', '?')} on {info.get('host', '?')} (started {info.get('started', '?')})"
    return (f"run folder {str(path.parent)!r} is in use by {who}: one process writes a run folder at a time; wait "
            f"for it to end (or stop it), or if it is gone remove {str(path)!r}")


# -- memory before building a model -------------------------------------------------------------------------


def available_memory_bytes() -> int | None:
    """The memory new allocations can get without swapping: ``MemAvailable`` of /proc/meminfo
    (Linux), else ``psutil.virtual_memory().available``, else None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


#: optimizer state in bytes per fp32 parameter, at least: Muon and the momentum methods keep one
#: buffer (its 1-D parameters take AdamW's two, not counted), the Adam family two
_OPTIMIZER_BYTES = {"muon": 4, "nesterov": 4, "sgd": 4}
_ADAM_BYTES = 8


def preset_memory_bytes(config, n_stages: int, seq_len: int, micro_batch_size: int, optimizer: str,
                        precision: str = "fp32", dp: int = 1) -> dict[str, float]:
    """A lower bound of the memory ``unbubble train`` needs on one machine for a preset model, all
    ``n_stages`` stages (× ``dp`` replicas) in this machine's memory (the emulator and the process
    engine alike), in bytes: its parts and their ``total``.

    * parameters: fp32 weights, 4 B each (``bf16``: 2 B and a 4 B fp32 master); the embedding and the
      head are two matrices on more than one stage ([Note: untied head] in docs/architecture.md);
    * the evaluation copy: 4 B per parameter (validation builds the model once more, unsplit by version);
    * gradients: 4 B per parameter;
    * optimizer state: 4 B per parameter for Muon and the momentum methods, 8 B for the Adam family;
    * activations: one micro-batch in flight per stage (at least), ≈ 16 C floats per token per block
      and the logits with their gradient (2 V floats per token) on the last stage.

    Sources: the counts of :func:`unbubble.models.partition.block_shape`; the per-parameter bytes are
    those ``summary.json``'s measured ``memory`` reports per stage.
    """
    from unbubble.models.partition import block_shape, embedding_params, final_norm_params, partition_layers

    ranges = partition_layers(config, n_stages, seq_len)
    C, V = config.n_embd, config.vocab_size
    tied = n_stages == 1 and getattr(config, "tie_embeddings", True)
    params = (embedding_params(config) + len(sum((list(r) for r in ranges), [])) * block_shape(config).params
              + final_norm_params(config) + (0 if tied else V * C))
    weight_b = 6 if precision == "bf16" else 4
    tokens = micro_batch_size * seq_len
    activations = n_stages * tokens * 4 * 16 * C * max(len(r) for r in ranges) + tokens * 4 * 2 * V
    parts = {"parameters": params * weight_b, "evaluation copy": params * 4, "gradients": params * 4,
             "optimizer state": params * _OPTIMIZER_BYTES.get(optimizer, _ADAM_BYTES), "activations": activations}
    parts = {k: v * dp if k != "evaluation copy" else v for k, v in parts.items()}
    parts["total"] = sum(parts.values())
    parts["n_params"] = params
    return parts


def check_memory(model_name: str, config, n_stages: int, seq_len: int, micro_batch_size: int, optimizer: str,
                 precision: str = "fp32", dp: int = 1, available: int | None = None) -> None:
    """Refuses a preset run whose memory (:func:`preset_memory_bytes`, a lower bound) exceeds this
    machine's available memory (:func:`available_memory_bytes`), before any of it is built.

    Raises:
        ConfigError: naming the model, its parameters, the estimate's parts and the memory available.
    """
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    need = preset_memory_bytes(config, n_stages, seq_len, micro_batch_size, optimizer, precision, dp)
    if need["total"] <= available:
        return
    parts = ", ".join(f"{k} {_gib(v)}" for k, v in need.items() if k not in ("total", "n_params"))
    raise ConfigError(f"model={model_name!r} does not fit this machine's memory: {need['n_params'] / 1e9:.2f}B "
                      f"parameters on {n_stages} stage(s) need at least {_gib(need['total'])} ({parts}) but "
                      f"{_gib(available)} is available (pick a smaller --model, or run each stage on its own machine "
                      "with torchrun; `unbubble simulate --model ...` predicts the memory per GPU)")
