"""Checkpoints of a running pipeline: one file per stage, written at drained cuts.

At a cut nothing is in flight, so a checkpoint holds only weights, optimizer and schedule state, each
stage writes its own file without a global barrier, and a resumed run continues bit-identically:
[Note: the checkpoint cut] in docs/architecture.md#runtimecheckpointpy.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unbubble.errors import ConfigError

FORMAT = 1
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class DamagedCheckpoint(ConfigError):
    """A stage file of a checkpoint is missing, unreadable or holds another step's weights: a
    resume passes over that checkpoint for the previous one."""


@dataclass(frozen=True)
class Checkpointing:
    """Checkpoint settings of a job.

    Attributes:
        directory: folder of the ``step-VVVVVVVV/stage-SSS.pt`` files.
        every: K: a checkpoint at every K-th update (0: only at the end and on a stop).
        keep: complete checkpoints kept (each stage deletes its older files), ≥ 2.
        resume_step: start from the complete checkpoint of this step (``None``: from scratch).
        extra_cuts: steps where an earlier run stopped (replayed so the schedule is the same).
        final: also write the last step's checkpoint (``unbubble train``: unless
            ``--no-final-checkpoint``, and always when the run has at least ``every`` steps).
    """

    directory: str
    every: int = 0
    keep: int = 2
    resume_step: int | None = None
    extra_cuts: tuple[int, ...] = ()
    final: bool = True


class CutWriter:
    """Writes each stage's file once per cut, for either engine ([Note: the checkpoint cut]).

    Args:
        job: the ``PipelineJob`` (its ``checkpoint`` says where; ``None``: nothing is written).
        cuts: the process's :class:`~unbubble.schedules.policy.Cuts`.
        enabled: ``False`` on data-parallel replicas other than 0 (their state equals replica 0's).
    """

    def __init__(self, job, cuts, enabled: bool = True):
        self.job, self.cuts = job, cuts
        self.enabled = enabled and job.checkpoint is not None
        self._saved: set[tuple[int, int]] = set()

    def after_update(self, ex) -> None:
        """Stage ``ex`` just applied an update: save if its version is a cut, or the last step
        with ``checkpoint.final``."""
        last = ex.version == self.job.schedule.steps and self.enabled and self.job.checkpoint.final
        if self.cuts.is_cut(ex.version) or last:
            self._save(ex)

    def at_stop(self, executors) -> None:
        """Once a stop at T is placed: save each stage that is already idle at version T (the last
        stage can be there before stage 0 places the stop)."""
        for ex in executors:
            if ex.version == self.cuts.stop_step and ex.idle:
                self._save(ex)

    def _save(self, ex) -> None:
        if self.enabled and (ex.stage, ex.version) not in self._saved:
            self._saved.add((ex.stage, ex.version))
            self.job.save_checkpoint(ex, self.cuts.stop_step)


def stage_path(directory: str | Path, step: int, stage: int) -> Path:
    return Path(directory) / f"step-{step:08d}" / f"stage-{stage:03d}.pt"


def complete_steps(directory: str | Path, n_stages: int) -> list[int]:
    """Steps whose checkpoint has a file for each of ``n_stages`` stages, ascending."""
    root = Path(directory)
    if not root.is_dir():
        return []
    steps = []
    for d in root.iterdir():
        m = _STEP_DIR.match(d.name)
        if m and all(stage_path(root, int(m.group(1)), s).is_file() for s in range(n_stages)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def save_stage(directory: str | Path, step: int, stage: int, payload: dict[str, Any], keep: int = 2) -> Path:
    """Writes one stage's file atomically (temporary file, fsync, rename), then deletes this
    stage's files of all but the newest ``keep`` steps."""
    path = stage_path(directory, step, stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:  # an open file: a full disk raises ENOSPC, not torch's "unexpected pos"
            torch.save({"format": FORMAT, **payload}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:  # the previous checkpoint stays whole; this one's half is removed
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"checkpoint not written: {exc.strerror}", str(path)) from None
    root = Path(directory)
    mine = sorted(int(m.group(1)) for d in root.iterdir() if (m := _STEP_DIR.match(d.name))
                  and stage_path(root, int(m.group(1)), stage).is_file())
    for old in mine[:-keep]:
        stage_path(root, old, stage).unlink(missing_ok=True)
        try:
            stage_path(root, old, stage).parent.rmdir()  # the last stage to leave removes the folder
        except OSError:
            pass
    return path


def load_stage(directory: str | Path, step: int, stage: int) -> dict[str, Any]:
    """Opens one stage's file (tensors and plain containers only: ``weights_only=True``; tensors
    memory-mapped, so checking a fingerprint does not read the weights).

    Raises:
        ConfigError: the file is missing, unreadable or of another format.
    """
    path = stage_path(directory, step, stage)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors read when used
    except FileNotFoundError:
        raise DamagedCheckpoint(f"checkpoint file {str(path)!r} is missing: the checkpoint of step {step} is "
                                "incomplete") from None
    except Exception as exc:  # noqa: BLE001 - any unpickling error means a damaged file
        # torch's own text advises re-saving the file, which a user resuming a run cannot do
        raise DamagedCheckpoint(f"checkpoint file {str(path)!r} cannot be read: it is cut short or not a torch.save "
                                f"file ({type(exc).__name__})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ConfigError(f"checkpoint file {str(path)!r} is not an unbubble checkpoint of format {FORMAT}")
    return data


def fingerprint(job, stage: int, module: torch.nn.Module) -> dict[str, Any]:
    """What must match between the run that wrote a stage file and the run that resumes it."""
    s = job.schedule
    return {"schedule": s.name, "n_stages": s.n_stages, "mb_per_step": s.mb_per_step, "steps": s.steps,
            "dp": job.dp, "stage": stage,
            "params": {n: list(p.shape) for n, p in module.state_dict().items()}}


def check_fingerprint(saved: dict[str, Any], expected: dict[str, Any], where: str) -> None:
    """Raises:
        ConfigError: naming the first field that differs and both values."""
    if not isinstance(saved, dict):
        raise ConfigError(f"checkpoint {where} has no run fingerprint: it was not written by unbubble train")
    labels = {"schedule": "schedule", "n_stages": "stages", "mb_per_step": "micro-batches per step",
              "steps": "steps", "dp": "dp", "stage": "stage"}
    for key, label in labels.items():
        if saved.get(key) != expected[key]:
            raise ConfigError(f"checkpoint {where} was written with {label}={saved.get(key)!r} but this run has "
                              f"{label}={expected[key]!r}: resume with the configuration that wrote it")
    got, want = saved.get("params", {}), expected["params"]
    if got != want:
        diff = sorted(set(got) ^ set(want)) or [n for n in want if got[n] != want[n]]
        name = diff[0]
        raise ConfigError(f"checkpoint {where} holds another model: parameter {name!r} is "
                          f"{got.get(name, 'absent')} there and {want.get(name, 'absent')} in this run "
                          "(resume with the same --model, --stages and tokenizer)")


def rng_state(device: torch.device | None) -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, torch.Tensor], device: torch.device | None) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# [Note: starting from another layout's checkpoint]
# ``unbubble train --init-from RUN`` starts a new run — any schedule, depth N or data-parallel degree D — from the
# complete checkpoint of another run. Stage files are keyed by the model's own parameter names ([Note: stages keep
# the model's names] in docs/architecture.md), so the source stages' weights merge into the whole model's and are
# cut again by the new layout; nothing depends on the source's stage boundaries. :func:`init_checkpoint` writes the
# new run's own checkpoint of step V (the source's version) from them, and the run then resumes it like any other
# cut ([Note: the checkpoint cut]):
#   * weights by name (fp32 master copies where the source trained in bf16); the sets of names and their shapes
#     must be equal, else one line names the first that differs;
#   * optimizer state by name where the optimizer keeps per-parameter state under the same hyper-parameter keys
#     (the same optimizer class): AdamW/NAdam moments and step counts, Muon's momentum, Basis Rotation's per-matrix
#     state. The optimizer's hyper-parameters are the new run's. Another optimizer starts from no state (logged);
#   * the update counter continues at V (the learning-rate schedule of the new run at update V) and the data
#     position too: the new run's first micro-batch id is the one after the source's last (``data_offset``, in
#     global micro-batch ids, so N, a, m and D may all change; micro-batch size and sequence length may not);
#   * what restarts: the non-finite guard's learning-rate factor, PipeMare velocity and error-feedback buffers,
#     clipping statistics and stale norms, drift statistics, the RNG (the new run's seed).
@dataclass(frozen=True)
class InitFrom:
    """What :func:`init_checkpoint` took from the source checkpoint."""

    source: str  #: the source checkpoint's folder (``…/checkpoints/step-VVVVVVVV``)
    step: int  #: V, the source's weight version: the new run starts after update V
    data_offset: int  #: added to every micro-batch id of the new run (global ids, ``batch_fn(k·D + d + offset)``)
    optimizer_carried: bool  #: False: the optimizer starts from no state (another optimizer class)


def find_checkpoint(source: str | Path) -> tuple[Path, int, int]:
    """``(step folder, V, source N)`` of a run folder's newest complete checkpoint, of a ``checkpoints`` folder's,
    or of one ``step-VVVVVVVV`` folder.

    Raises:
        ConfigError: no such folder, or no complete checkpoint in it.
    """
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ConfigError(f"init_from={str(source)!r} does not exist: give a run folder of unbubble train, its "
                          "checkpoints folder, or one of its step-VVVVVVVV folders")
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if _STEP_DIR.match(path.name):
        steps_dir, steps = path.parent, [int(_STEP_DIR.match(path.name).group(1))]
    else:
        steps_dir = path
        steps = sorted(int(m.group(1)) for d in path.iterdir() if (m := _STEP_DIR.match(d.name)))
    for step in reversed(steps):
        first = stage_path(steps_dir, step, 0)
        if not first.is_file():
            continue
        n = load_stage(steps_dir, step, 0).get("fingerprint", {}).get("n_stages")
        if isinstance(n, int) and step in complete_steps(steps_dir, n):
            return steps_dir / f"step-{step:08d}", step, n
    raise ConfigError(f"init_from={str(source)!r} holds no complete checkpoint (a step-VVVVVVVV folder with a "
                      "stage-SSS.pt file for each of its stages)")


def _hyper_keys(groups: list[dict]) -> list[frozenset]:
    return [frozenset(k for k in g if k not in ("params", "param_names", "initial_lr")) for g in groups]


def _state_by_name(job, files: list[dict], weights: dict[str, torch.Tensor], param_names: set) -> dict | None:
    """The source optimizers' per-parameter state by parameter name, or None when this job's optimizer is another
    (other hyper-parameter keys or group sizes). A saved optimizer's state is keyed by position over its groups;
    positions are named by building this job's optimizer over the source stage's parameters (placeholders of their
    shapes, in the stage's order) and reading its groups (torch's ``param_names`` where saved)."""
    by_name: dict[str, Any] = {}
    for s, data in enumerate(files):
        saved = data["executor"]["optimizer"]
        groups = saved["param_groups"]
        if all("param_names" in g for g in groups):
            order = [name for g in groups for name in g["param_names"]]
        else:
            names = [n for n in data["fingerprint"]["params"] if n in param_names]
            placeholders = [torch.nn.Parameter(torch.zeros_like(weights[n], device="cpu")) for n in names]
            built = job.optimizer_fn(list(zip(names, placeholders)), s)
            if [len(g["params"]) for g in built.param_groups] != [len(g["params"]) for g in groups] or \
                    _hyper_keys(built.param_groups) != _hyper_keys(groups):
                return None
            name_of = {id(p): n for n, p in zip(names, placeholders)}
            order = [name_of[id(p)] for g in built.param_groups for p in g["params"]]
        indices = [i for g in groups for i in g["params"]]
        for i, name in zip(indices, order):
            if i in saved["state"]:
                by_name[name] = saved["state"][i]
    return by_name


def init_checkpoint(job, source: str | Path, directory: str | Path) -> InitFrom:
    """Writes ``job``'s checkpoint of step V into ``directory`` from another layout's checkpoint ([Note: starting from
    another layout's checkpoint]); the run then resumes it (``Checkpointing(resume_step=V)``).

    Args:
        job: the new run's ``PipelineJob`` (any schedule, N, D; the same model).
        source: a run folder, its ``checkpoints`` folder or one ``step-VVVVVVVV`` folder.
        directory: the new run's checkpoint folder.

    Returns:
        :class:`InitFrom` (V, the data offset, whether the optimizer state was carried).

    Raises:
        ConfigError: no complete checkpoint, another model (a parameter name absent on one side, or of another
            shape: the first named), or V not below the new run's steps.
    """
    step_dir, step, n_old = find_checkpoint(source)
    files = [load_stage(step_dir.parent, step, s) for s in range(n_old)]
    weights: dict[str, torch.Tensor] = {}
    for data in files:
        saved = data["executor"]
        weights.update(saved["model"])
        if saved.get("masters") is not None and saved.get("master_names") is not None:  # bf16: the fp32 masters
            weights.update(dict(zip(saved["master_names"], saved["masters"])))
    fp = files[0]["fingerprint"]
    if step >= job.schedule.steps:
        raise ConfigError(f"init_from={str(source)!r} is at step {step}, and this run has steps={job.schedule.steps}: "
                          f"give more steps than {step} (the update counter continues from the checkpoint)")
    execs = [job.build_executor(s) for s in range(job.schedule.n_stages)]
    wanted = {k: v for ex in execs for k, v in ex.module.state_dict().items()}
    for name in sorted(set(wanted) | set(weights)):
        if name not in weights or name not in wanted or tuple(weights[name].shape) != tuple(wanted[name].shape):
            there = "absent" if name not in weights else list(weights[name].shape)
            here = "absent" if name not in wanted else list(wanted[name].shape)
            raise ConfigError(f"init_from={str(step_dir)!r} holds another model: parameter {name!r} is {there} there "
                              f"and {here} in this run (give the same --model, tokenizer and --untie)")
    opt_state = _state_by_name(job, files, weights, {n for ex in execs for n in ex.names})
    torch.manual_seed(job.seed)
    rng = rng_state(None)
    for ex in execs:
        ex.module.load_state_dict({k: weights[k] for k in ex.module.state_dict()})
        params = dict(ex.module.named_parameters())
        stepped = ex.masters if ex.masters is not None else [params[n] for n in ex.names]
        if ex.masters is not None:
            with torch.no_grad():
                for name, master in zip(ex.names, ex.masters):
                    master.copy_(weights[name])
        if opt_state is not None:  # positions of this optimizer named by its own parameters
            name_of = {id(p): n for n, p in zip(ex.names, stepped)}
            order = [name_of[id(p)] for g in ex.optimizer.param_groups for p in g["params"]]
            sd = ex.optimizer.state_dict()
            indices = [i for g in sd["param_groups"] for i in g["params"]]
            sd["state"] = {i: opt_state[name] for i, name in zip(indices, order) if name in opt_state}
            ex.optimizer.load_state_dict(sd)
        ex.version = step
        sched = ex.lr_scheduler
        if sched is not None:  # the new run's schedule at update V
            sched.last_epoch = step
            for group, base, fn in zip(ex.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                group["lr"] = base * fn(step)
        save_stage(directory, step, ex.stage, {
            "executor": ex.state_dict(), "rng": rng, "next_mb": step * job.schedule.mb_per_step, "extra_cuts": [],
            "fingerprint": fingerprint(job, ex.stage, ex.module)}, keep=job.checkpoint.keep if job.checkpoint else 2)
    offset = step * fp["mb_per_step"] * fp["dp"] - step * job.schedule.mb_per_step * job.dp
    return InitFrom(str(step_dir), step, offset, opt_state is not None)


def offset_batch(batch_fn, offset: int, k: int):
    """``batch_fn(k + offset)``: micro-batch ids continuing a source run's data position (picklable with partial)."""
    return batch_fn(k + offset)
