"""Convergence sweeps: a grid of (method, N, lr, seed) run in the emulator, resumable, with lr tuning.

A :class:`SweepSpec` names the configuration every run shares, the methods, pipeline depths, an lr grid,
seeds and the micro-batches every run trains on (equal tokens). The protocol (lr tuned per method,
token budgets) and how a stopped sweep resumes:
docs/architecture.md#experimentssweeppy.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import multiprocessing
import os
import re
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from unbubble.errors import ConfigError, PipelineFailure, did_you_mean
from unbubble.progress import elapsed, estimate_span

log = logging.getLogger(__name__)

#: Budgets stop when the seed's last two budgets extrapolate (log-linearly) to the baseline's loss only
#: beyond this multiple of the largest budget (1: train only where the line says a budget suffices).
SKIP_FACTOR = 1.0

#: Columns of runs.csv, in order.
RUN_COLUMNS = ("run_id", "method", "stages", "lr", "seed", "phase", "budget", "schedule", "a", "m", "optimizer", "steps",
               "micro_batches", "tokens", "final_val_loss", "min_val_loss", "final_train_loss", "max_drift",
               "wall_s", "f_s", "b_s", "u_s", "commit", "switch_after")


def source_commit() -> str:
    """The git commit of the unbubble source that trains a run (``+dirty`` when its tracked files
    differ from it; ``""`` outside a git checkout): a change of code that reorders floating-point
    operations moves a run as much as a new seed, so every result row names the code behind it."""
    import subprocess

    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=10", "HEAD"], capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "."],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return head + ("+dirty" if dirty else "")


@dataclass(frozen=True)
class Method:
    """One line of a comparison.

    Attributes:
        label: what tables and plots call it ("paci a=4 + muon").
        overrides: TrainConfig fields that make it (``schedule``, ``a``, ``m``, ``optimizer``…).
        stages: depths to run it at (default: the spec's).
        lrs: its learning-rate grid (default: the spec's).
        lr_from: instead of tuning, take the tuned lr of the method with this label at the
            tuned depth closest to N (on a log scale; ties to the deeper one) — for depths or
            variants the budget cannot tune.
        extra_seeds: run the spec's other seeds too (False: the first seed only, e.g. a scan).
        horizon: its tokens as a multiple of the spec's ``micro_batches`` (a longer horizon, e.g.
            4; usually with ``lr_from`` the same method at horizon 1).
        baseline: the label of the synchronous method whose final loss it is measured against
            (token overhead; the budgets below).
        budgets: token budgets beyond its own, as multiples of them (default: the spec's
            ``budgets`` when a baseline is named); see the module docstring.
        switch_at: train this fraction of each run's updates with 1F1B-flush first, then the
            method's asynchronous schedule (``switch_after`` = round(fraction × steps), at least 1;
            :mod:`unbubble.switch`), at every budget alike.
    """

    label: str
    overrides: dict[str, Any]
    stages: tuple[int, ...] | None = None
    lrs: tuple[float, ...] | None = None
    lr_from: str | None = None
    extra_seeds: bool = True
    horizon: float = 1.0
    baseline: str | None = None
    budgets: tuple[float, ...] | None = None
    switch_at: float | None = None


@dataclass(frozen=True)
class RunSpec:
    """One training run of a sweep."""

    method: str
    overrides: dict[str, Any]
    stages: int
    lr: float
    seed: int
    phase: str  # "tune" (the lr grid), "seeds" (the tuned lr, other seeds), "transfer" (lr_from), "budget"
    budget: float = 1.0  # tokens as a multiple of the method's (token-overhead budgets)

    @property
    def run_id(self) -> str:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.method).strip("-").lower()
        return f"{slug}-N{self.stages}-lr{self.lr:g}-s{self.seed}" + ("" if self.budget == 1 else f"-b{self.budget:g}")


@dataclass
class SweepSpec:
    """A sweep; see the module docstring.

    Attributes:
        name: the sweep's name (folder and titles).
        base: TrainConfig fields shared by every run (model, seq_len, micro_batch_size, …).
        methods: the compared methods.
        stages: pipeline depths N.
        lrs: peak learning-rate grid.
        seeds: seeds; ``seeds[0]`` tunes the lr.
        micro_batches: micro-batches per run (tokens = micro_batches × micro_batch_size × seq_len).
        evals: validation points per run (evenly spaced in updates, plus the end).
        tune: tune the lr on ``seeds[0]``, then run the other seeds at the tuned lr.
        seed_stages: depths at which the other seeds run (None: every depth).
        keep_train_curve: store the training loss of every update in curves.csv.
        extend_grid: rounds of grid extension: a (method, N) whose best lr is the largest (or
            smallest) it tried also tries the next lr beyond it (:func:`next_lr`), so no method
            is reported at the edge of its grid; 0 turns it off.
        budgets: default token budgets of the methods that name a ``baseline`` (multiples of
            their tokens, e.g. [1.5, 2, 3]; values < 1 bracket a method that beats its baseline).
    """

    name: str
    base: dict[str, Any]
    methods: list[Method]
    stages: list[int]
    lrs: list[float]
    seeds: list[int]
    micro_batches: int
    evals: int = 12
    tune: bool = True
    seed_stages: list[int] | None = None
    keep_train_curve: bool = False
    extend_grid: int = 1
    budgets: list[float] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SweepSpec":
        """A spec from a mapping (a YAML file's content).

        Raises:
            ConfigError: a missing or unknown key, an empty grid, or a method whose
                configuration is invalid (checked here, before anything runs).
        """
        if not isinstance(d, dict):
            raise ConfigError(f"a sweep spec must be a mapping, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"sweep key {unknown[0]!r} is unknown{did_you_mean(unknown[0], known)}: valid keys "
                              f"are {', '.join(sorted(known))}")
        for key in ("name", "methods", "stages", "lrs", "seeds", "micro_batches"):
            if key not in d:
                raise ConfigError(f"sweep key {key!r} is missing")
        _check_keys("base", d.get("base") or {}, _train_fields())
        for key, kind in _SPEC_TYPES.items():
            if key in d and not (key in _OPTIONAL and d[key] is None):
                _check_type("sweep", key, d[key], kind)
        if not isinstance(d.get("base", {}) or {}, dict):
            raise ConfigError(f"sweep base={d['base']!r} is invalid: must be a mapping of unbubble train options")
        methods = []
        for i, m in enumerate(d["methods"]):
            if not isinstance(m, dict) or "label" not in m:
                raise ConfigError(f"methods[{i}]={m!r} is invalid: each method needs a label and TrainConfig fields")
            m = dict(m)
            label = m.pop("label")
            _check_keys(f"method {label!r}", m, set(_method_keys()))
            for key, kind in _METHOD_TYPES.items():
                if key in m and m[key] is not None:
                    _check_type(f"method {label!r}:", key, m[key], kind)
            st, lrs = m.pop("stages", None), m.pop("lrs", None)
            budgets = m.pop("budgets", None)
            methods.append(Method(label, m, tuple(st) if st else None, tuple(float(x) for x in lrs) if lrs else None,
                                  m.pop("lr_from", None), bool(m.pop("extra_seeds", True)),
                                  float(m.pop("horizon", 1.0)), m.pop("baseline", None),
                                  None if budgets is None else tuple(float(x) for x in budgets),
                                  m.pop("switch_at", None)))
        spec = cls(name=d["name"], base=dict(d.get("base", {})), methods=methods, stages=list(d["stages"]),
                   lrs=[float(x) for x in d["lrs"]], seeds=[int(s) for s in d["seeds"]],
                   micro_batches=int(d["micro_batches"]), evals=int(d.get("evals", 12)), tune=bool(d.get("tune", True)),
                   seed_stages=d.get("seed_stages"), keep_train_curve=bool(d.get("keep_train_curve", False)),
                   extend_grid=int(d.get("extend_grid", 1)), budgets=[float(x) for x in d.get("budgets", [])])
        spec.validate()
        return spec

    def validate(self) -> None:
        """Builds every method's TrainConfig once so a typo fails before the first run.

        Raises:
            ConfigError: an empty grid, duplicate labels, or an invalid configuration (the
                message names the method).
        """
        for key in ("methods", "stages", "lrs", "seeds"):
            if not getattr(self, key):
                raise ConfigError(f"sweep {key}=[] is invalid: give at least one")
        labels = [m.label for m in self.methods]
        if len(set(labels)) != len(labels):
            raise ConfigError(f"method labels must be unique: {labels}")
        for m in self.methods:
            if m.lr_from is not None and (m.lr_from not in labels or self._method(m.lr_from).lr_from is not None):
                raise ConfigError(f"method {m.label!r}: lr_from={m.lr_from!r} must name a tuned method of this sweep")
        for m in self.methods:
            if m.baseline is not None and (m.baseline not in labels or m.baseline == m.label):
                raise ConfigError(f"method {m.label!r}: baseline={m.baseline!r} must name another method of this "
                                  f"sweep (one of {', '.join(x for x in labels if x != m.label)})")
            if m.switch_at is not None and not 0 < m.switch_at < 1:
                raise ConfigError(f"method {m.label!r}: switch_at={m.switch_at!r} is invalid: must be a fraction of "
                                  "the run's updates in (0, 1)")
            if not m.horizon > 0:
                raise ConfigError(f"method {m.label!r}: horizon={m.horizon!r} is invalid: must be > 0 (a multiple "
                                  "of micro_batches)")
            bad = [b for b in self.method_budgets(m) if not b > 0 or b == 1]
            if bad:
                raise ConfigError(f"method {m.label!r}: budget {bad[0]!r} is invalid: budgets are multiples of the "
                                  "method's tokens, > 0 and ≠ 1 (1 is the method's own run)")
        if self.extend_grid < 0:
            raise ConfigError(f"extend_grid={self.extend_grid} is invalid: give 0 (off) or more rounds")
        for key in ("micro_batches", "evals"):
            if getattr(self, key) < 1:
                raise ConfigError(f"sweep {key}={getattr(self, key)} is invalid: must be ≥ 1")
        for m in self.methods:
            for n in m.stages or self.stages:
                try:
                    run = RunSpec(m.label, m.overrides, n, (m.lrs or self.lrs)[0], self.seeds[0], "tune")
                    cfg = self.config(run, Path("unused"))
                    _check_depth(cfg)
                    if self.micro_batches_of(run) % cfg.mb_per_step:
                        log.warning("method %r at N=%d: %d micro-batches is not a multiple of its %d per update: each "
                                    "run trains %d", m.label, n, self.micro_batches_of(run), cfg.mb_per_step,
                                    cfg.steps * cfg.mb_per_step)
                except (ConfigError, TypeError) as exc:
                    raise ConfigError(f"method {m.label!r} at N={n}: {_spec_message(exc)}") from None

    def method_budgets(self, m: Method) -> tuple[float, ...]:
        """The token budgets of ``m`` (none without a baseline)."""
        if m.baseline is None:
            return ()
        return tuple(self.budgets) if m.budgets is None else m.budgets

    def micro_batches_of(self, run: RunSpec) -> int:
        """Micro-batches of one run: the spec's × the method's horizon × the run's budget."""
        horizon = self._method(run.method).horizon if run.method in {m.label for m in self.methods} else 1.0
        return round(self.micro_batches * horizon * run.budget)

    def config(self, run: RunSpec, out: Path):
        """The TrainConfig of one run (equal micro-batches for every method of one horizon and budget)."""
        from unbubble.config import TrainConfig, check_field

        # a spec's values read as a config file's (auto, 1e-3 as a string); error_feedback 0 unless set: a
        # sweep's methods are the plain algorithms its labels name
        given = {k: check_field(k, v, f"method {run.method!r}") for k, v in {**self.base, **run.overrides}.items()}
        fields = {"engine": "emulator", "checkpoints": False, "tensorboard": False, "eval_batches": 8,
                  "error_feedback": 0.0, **given, "stages": run.stages, "lr": run.lr, "seed": run.seed}
        probe = TrainConfig(**{**fields, "steps": 1, "run_dir": None})
        steps = self.micro_batches_of(run) // probe.mb_per_step
        if steps < 1:
            raise ConfigError(f"micro_batches={self.micro_batches_of(run)} is fewer than one update of "
                              f"{probe.mb_per_step} micro-batches")
        method = self._method(run.method) if run.method in {m.label for m in self.methods} else None
        if method is not None and method.switch_at is not None:
            fields["switch_after"] = min(max(round(method.switch_at * steps), 1), steps - 1)
            # phase 1's checkpoint starts phase 2 (unbubble.switch); phase 2 writes none
            fields.update(checkpoints=True, checkpoint_every=0, final_checkpoint=False)
        return TrainConfig(**{**fields, "steps": steps, "eval_interval": max(steps // self.evals, 1),
                              "run_dir": str(out / "runs" / run.run_id)})

    def _method(self, label: str) -> Method:
        return next(m for m in self.methods if m.label == label)

    def tuning_runs(self) -> list[RunSpec]:
        """Phase 1: every (method, N, lr) with the first seed (every seed when not tuning);
        methods with ``lr_from`` wait for phase 2."""
        seeds = self.seeds[:1] if self.tune else self.seeds
        return [RunSpec(m.label, m.overrides, n, lr, s, "tune")
                for m in self.methods if m.lr_from is None
                for n in (m.stages or self.stages) for lr in (m.lrs or self.lrs) for s in seeds]

    def edge_runs(self, records: list[dict[str, Any]]) -> list[RunSpec]:
        """One round of grid extension: for each tuned (method, N) whose best lr among the
        tuning runs so far is the largest (smallest) of ≥ 2 tried, a tuning run at the next lr
        above (below) it."""
        tried: dict[tuple[str, int], list[float]] = {}
        for r in records:
            if r["phase"] == "tune":
                tried.setdefault((r["method"], int(r["stages"])), []).append(float(r["lr"]))
        best = tuned_lrs(records)
        runs = []
        for m in self.methods:
            if m.lr_from is not None:
                continue
            for n in m.stages or self.stages:
                lrs = sorted(set(tried.get((m.label, n), [])))
                if len(lrs) < 2 or (m.label, n) not in best:
                    continue
                if best[(m.label, n)] in (lrs[0], lrs[-1]):
                    runs.append(RunSpec(m.label, m.overrides, n, next_lr(lrs, up=best[(m.label, n)] == lrs[-1]),
                                        self.seeds[0], "tune"))
        return runs

    def lr_for(self, method: Method, n: int, best: dict[tuple[str, int], float]) -> float | None:
        """The lr phase 2 uses for ``method`` at depth ``n`` (None: nothing tuned to take it from)."""
        if method.lr_from is None:
            return best.get((method.label, n))
        tuned = [d for (label, d) in best if label == method.lr_from]
        if not tuned:
            return None
        depth = min(tuned, key=lambda d: (abs(math.log(d) - math.log(n)), -d))
        return best[(method.lr_from, depth)]

    def seed_runs(self, best: dict[tuple[str, int], float]) -> list[RunSpec]:
        """Phase 2: the other seeds at each (method, N)'s tuned lr ``best[(label, N)]``, and
        every seed of the ``lr_from`` methods at the lr they borrow."""
        if not self.tune:
            return []
        runs = []
        for m in self.methods:
            for n in m.stages or self.stages:
                lr = self.lr_for(m, n, best)
                if lr is None:
                    continue
                more = m.extra_seeds and (self.seed_stages is None or n in self.seed_stages)
                seeds = (self.seeds if m.lr_from else self.seeds[1:]) if more else (self.seeds[:1] if m.lr_from else [])
                runs += [RunSpec(m.label, m.overrides, n, lr, s, "seeds" if m.lr_from is None else "transfer")
                         for s in seeds]
        return runs


    def budget_runs(self, records: list[dict[str, Any]]) -> list[RunSpec]:
        """The next round of token-budget runs (module docstring), given every record so far: for
        each seed of each method with budgets, the next budget that seed still needs."""
        if not self.tune:
            return []
        best = tuned_lrs(records)
        runs = []
        for m in self.methods:
            budgets = self.method_budgets(m)
            if not budgets:
                continue
            base = self._method(m.baseline)
            for n in m.stages or self.stages:
                lr, base_lr = self.lr_for(m, n, best), self.lr_for(base, n, best)
                if lr is None or base_lr is None:
                    continue
                base_runs = [r for r in records if r["method"] == base.label and int(r["stages"]) == n
                             and r["lr"] == base_lr and r.get("budget", 1.0) == 1.0]
                if not base_runs:
                    continue
                mean = statistics.fmean(_loss(r) for r in base_runs)
                twin = {int(r["seed"]): _loss(r) for r in base_runs}
                mine = [r for r in records if r["method"] == m.label and int(r["stages"]) == n and r["lr"] == lr]
                for seed in sorted({int(r["seed"]) for r in mine if r.get("budget", 1.0) == 1.0}):
                    done = {float(r.get("budget", 1.0)): _loss(r) for r in mine if int(r["seed"]) == seed}
                    # paired: each seed's target is its own synchronous twin (same seed, same data order)
                    nxt = next_budget(budgets, done, twin.get(seed, mean))
                    if nxt is not None:
                        runs.append(RunSpec(m.label, m.overrides, n, lr, seed, "budget", nxt))
        return runs


def _loss(record: dict[str, Any]) -> float:
    """A record's final validation loss (inf when it diverged)."""
    return record["final_val_loss"] if record["final_val_loss"] is not None else math.inf


#: Keys of a method besides TrainConfig fields.
METHOD_KEYS = ("label", "stages", "lrs", "lr_from", "extra_seeds", "horizon", "baseline", "budgets", "switch_at")
# TrainConfig fields the sweep sets for every run (from lrs, seeds, micro_batches and evals): a
# method or base that gave them would be overridden silently, so they are unknown keys there.
SWEEP_SETS = {"lr": "lrs (or a method's lrs)", "seed": "seeds", "steps": "micro_batches (and a method's horizon)",
              "eval_interval": "evals", "run_dir": "--out"}


_KINDS = {  # kind -> (test, what is valid)
    "str": (lambda v: isinstance(v, str), "a string"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "int": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer"),
    "number": (lambda v: isinstance(v, (int, float)) and not isinstance(v, bool), "a number"),
    "ints": (lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in v),
             "a list of integers, e.g. [2, 8]"),
    "numbers": (lambda v: isinstance(v, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                      for x in v), "a list of numbers, e.g. [0.001, 0.003]"),
    "dicts": (lambda v: isinstance(v, list), "a list of methods (mappings with a label)"),
}
_SPEC_TYPES = {"name": "str", "methods": "dicts", "stages": "ints", "lrs": "numbers", "seeds": "ints",
               "micro_batches": "int", "evals": "int", "tune": "bool", "seed_stages": "ints",
               "keep_train_curve": "bool", "extend_grid": "int", "budgets": "numbers"}
_OPTIONAL = {"seed_stages"}
_METHOD_TYPES = {"stages": "ints", "lrs": "numbers", "lr_from": "str", "extra_seeds": "bool", "horizon": "number",
                 "baseline": "str", "budgets": "numbers", "switch_at": "number"}


def _check_depth(cfg) -> None:
    """Raises ConfigError when ``cfg``'s model has fewer blocks than its pipeline has stages (found
    here, before a calibration or a first run reads the corpus)."""
    from unbubble.models.registry import make_config
    from unbubble.schedules.registry import VIRTUAL

    layers = make_config(cfg.model).n_layer
    chunks = cfg.stages * (cfg.v if cfg.schedule in VIRTUAL else 1)
    if chunks > layers:
        raise ConfigError(f"stages={cfg.stages} is invalid: model {cfg.model!r} has {layers} blocks, so at most "
                          f"{layers} pipeline stages{' × v' if chunks != cfg.stages else ''} (key stages, or a deeper model)")


def _check_type(where: str, key: str, value: Any, kind: str) -> None:
    """Raises ConfigError unless ``value`` is of ``kind`` (a YAML scalar where a list belongs, a word
    where a number belongs), naming the key and what is valid."""
    test, valid = _KINDS[kind]
    if not test(value):
        raise ConfigError(f"{where} {key}={value!r} is invalid: must be {valid}")


def _check_keys(where: str, keys, valid: set[str]) -> None:
    """Raises ConfigError for the first key not in ``valid``, with the sweep key to use instead for
    a field the sweep sets, else a did-you-mean."""
    bad = sorted(set(keys) - valid)
    if not bad:
        return
    if bad[0] in SWEEP_SETS:
        raise ConfigError(f"{where}: key {bad[0]!r} is set by the sweep for every run: give {SWEEP_SETS[bad[0]]}")
    raise ConfigError(f"{where}: key {bad[0]!r} is unknown{did_you_mean(bad[0], valid)}: "
                      + ("base takes unbubble train options (with _ for -)" if where == "base" else
                         f"a method takes {', '.join(METHOD_KEYS)} and any unbubble train option (docs/experiments.md)"))


def _train_fields() -> set[str]:
    import dataclasses

    from unbubble.config import TrainConfig

    return {f.name for f in dataclasses.fields(TrainConfig)} - set(SWEEP_SETS)


def _method_keys() -> list[str]:
    return sorted(set(METHOD_KEYS) | _train_fields())


def _spec_message(exc: Exception) -> str:
    """A TrainConfig error as a spec error: "(set --flag)" becomes "(key flag)"."""
    return re.sub(r"\(set --([a-z0-9-]+)\)", lambda mt: f"(key {mt.group(1).replace('-', '_')})", str(exc))


def next_budget(budgets: tuple[float, ...] | list[float], done: dict[float, float], target: float) -> float | None:
    """The next token budget one seed needs, or None.

    Args:
        budgets: the budgets to choose from (multiples of the method's tokens; 1 is its own run).
        done: final loss per budget already trained (must hold 1.0).
        target: the baseline's final loss.

    Returns:
        Above 1: while every trained budget ≥ 1 ended above ``target``, the next larger budget, or
        after two budgets the smallest larger one the line through the last two (log budget, loss)
        says reaches ``target``; None when that line puts the target beyond ``SKIP_FACTOR`` × the
        largest budget. Below 1: the largest budget smaller than every
        one trained, while the smallest trained one reached ``target``.
    """
    if 1.0 not in done:
        return None
    if done[1.0] <= target:
        lo = min(done)
        if done[lo] > target:  # bracketed from below
            return None
        smaller = [b for b in budgets if b < lo]
        return max(smaller) if smaller else None
    hi = max(done)
    if done[hi] <= target:
        return None
    larger = sorted(b for b in budgets if b > hi)
    if not larger:
        return None
    tried = sorted(b for b in done if b >= 1.0)
    if len(tried) >= 2:
        (b0, l0), (b1, l1) = [(b, done[b]) for b in tried[-2:]]
        if not (math.isfinite(l0) and math.isfinite(l1)) or l1 >= l0:
            return None  # no improvement with more tokens: the target is out of reach
        needed = b1 * math.exp((l1 - target) / (l0 - l1) * math.log(b1 / b0))
        if needed > SKIP_FACTOR * larger[-1]:
            return None
        # the smallest budget the line says suffices: the seed's overhead is then bracketed, not a bound
        return next(b for b in larger if b >= min(needed, larger[-1]))
    return larger[0]


def plan(spec: SweepSpec, out: Path | None = None) -> list[tuple[str, int, str]]:
    """Every run the sweep will or may train: ``(what, micro-batches, certainty)`` with certainty
    ``"done"`` (finished in ``out``: a rerun skips it), ``"will"`` (tuning, seeds, ``lr_from``)
    or ``"up to k"`` (grid extensions and token budgets, which depend on results); "what" is a
    run id or a description. Phases whose inputs are all finished are listed exactly (the runs
    :func:`run_sweep` would start); the first with an unfinished input and those after it as
    before any run."""
    def trained(run: RunSpec) -> int:  # whole updates only: what the run's TrainConfig will train
        cfg = spec.config(run, Path("unused"))
        return cfg.steps * cfg.mb_per_step

    finished = {}
    if out is not None and (out / "results").is_dir():
        for path in (out / "results").glob("*.json"):
            finished[path.stem] = json.loads(path.read_text())
    rows: list[tuple[str, int, str]] = []
    records: list[dict[str, Any]] = []
    listed: list[tuple[str, int, float]] = []  # (method, N, budget) of the runs listed by id

    def exact(runs: list[RunSpec]) -> bool:
        """Lists ``runs`` as done or will; True when all are done (the next phase is then known)."""
        for r in runs:
            rows.append((r.run_id, trained(r), "done" if r.run_id in finished else "will"))
            listed.append((r.method, r.stages, r.budget))
            if r.run_id in finished:
                records.append(finished[r.run_id])
        return all(r.run_id in finished for r in runs)

    known = exact(spec.tuning_runs())
    rounds = spec.extend_grid if spec.tune else 0
    for _ in range(spec.extend_grid if spec.tune else 0):
        if not known:
            break
        edges = spec.edge_runs(records)
        if not edges:
            rounds = 0
            break
        known = exact(edges)
        rounds -= 1
    seeds_known = known and exact(spec.seed_runs(tuned_lrs(records)))
    while seeds_known:
        more = spec.budget_runs(records)
        if not more:
            return rows
        seeds_known = exact(more)
    ids = {what for what, _, _ in rows}
    budgets_done = [r for r in finished.values() if r.get("budget", 1.0) != 1.0 and r["run_id"] not in ids]
    for m in spec.methods:
        for n in m.stages or spec.stages:
            probe = RunSpec(m.label, m.overrides, n, (m.lrs or spec.lrs)[0], spec.seeds[0], "tune")
            mb = trained(probe)
            if not known and rounds and m.lr_from is None and len(m.lrs or spec.lrs) > 1:
                rows.append((f"{_at(m, n)}: grid extension beyond its best lr", mb, f"up to {rounds}"))
            more = m.extra_seeds and (spec.seed_stages is None or n in spec.seed_stages)
            seeds = (spec.seeds if m.lr_from else spec.seeds[1:]) if more else (spec.seeds[:1] if m.lr_from else [])
            if spec.tune and not known:
                rows += [(f"{_at(m, n)} seed {s} at the {'borrowed' if m.lr_from else 'tuned'} lr", mb, "will")
                         for s in seeds]
            budgets = spec.method_budgets(m)
            if budgets and spec.tune:
                n_seeds = len(spec.seeds if more else spec.seeds[:1])
                for b in budgets:
                    mine = [r for r in budgets_done if (r["method"], int(r["stages"]), r["budget"]) == (m.label, n, b)]
                    rows += [(r["run_id"], int(r["micro_batches"]), "done") for r in mine]
                    left = n_seeds - len(mine) - listed.count((m.label, n, b))
                    if left > 0:
                        rows.append((f"{_at(m, n)} budget {b:g}× (each seed)",
                                     trained(dataclasses.replace(probe, budget=b)), f"up to {left}"))
    return rows


def _at(m: Method, n: int) -> str:
    """A method's label at depth ``n``, naming N once ('paci a=4, N=4', not 'paci a=4, N=4 N=4')."""
    return m.label if re.search(rf"\bN\s*=\s*{n}\b", m.label) else f"{m.label} N={n}"


def estimate(spec: SweepSpec, out: Path, workers: int, rows: list[tuple[str, int, str]], flag=None,
             max_share: float | None = None) -> str:
    """One line: how many runs of ``rows`` (:func:`plan`) will and may train, and about how long
    that takes: seconds per micro-batch from the finished runs in ``out``, or from a calibration
    run of the first tuning run's configuration at 1/20 of its updates (a stop during it sets
    ``flag.stop_requested``). With ``max_share``, no calibration that would train more than that
    share of what will train (a small sweep: its first finished run tells sooner)."""
    will = [mb for _, mb, c in rows if c == "will"]
    may = [mb * int(c.split()[-1]) for _, mb, c in rows if c.startswith("up to")]
    more = sum(int(c.split()[-1]) for _, _, c in rows if c.startswith("up to"))
    n_done = sum(c == "done" for _, _, c in rows)
    done_text = f" ({n_done} already finished in {out})" if n_done else ""
    if not will and not more:
        return f"nothing to train: all {n_done} runs are finished in {out}"
    finished = [json.loads(p.read_text()) for p in (out / "results").glob("*.json")] \
        if (out / "results").is_dir() else []
    finished = [r for r in finished if r.get("micro_batches")]
    timed = [r for r in finished if r.get("train_wall_s")]  # records before it have only wall_s
    if timed:
        per_mb = statistics.median(r["train_wall_s"] / r["micro_batches"] for r in timed)
        startup = statistics.median(max(r["wall_s"] - r["train_wall_s"], 0.0) for r in timed)
        how = f"the median of {len(timed)} finished run(s) in {out}"
    elif finished:
        per_mb = statistics.median(r["wall_s"] / r["micro_batches"] for r in finished)
        how = f"the median of {len(finished)} finished run(s) in {out}"
        startup = 0.0  # in their wall_s
    else:
        import tempfile

        from unbubble.train import train

        first = spec.tuning_runs()[0]
        cfg = spec.config(first, out)
        steps = max(cfg.steps // 20, 2)
        if max_share is not None and steps * cfg.mb_per_step > max_share * sum(will):
            return (f"{len(will)} runs will train" + (f", up to {more} more may" if more else "") + done_text +
                    f" with {workers} worker(s); time: see the progress after the first run")
        with tempfile.TemporaryDirectory() as tmp:
            cfg = dataclasses.replace(cfg, steps=steps, eval_interval=0, checkpoints=False,
                                      run_dir=f"{tmp}/calibration")
            t0 = time.perf_counter()
            quiet = logging.getLogger("unbubble")  # the calibration's own run log is not the plan's
            level = quiet.level
            quiet.setLevel(logging.WARNING)
            try:
                result, _ = train(cfg, on_divergence="record")
            finally:
                quiet.setLevel(level)
        if flag is not None and result.stopped_at is not None:  # its own handlers took the signal
            flag.stop_requested = True
        total = time.perf_counter() - t0
        per_mb = result.wall_s / (steps * cfg.mb_per_step)  # the training loop; start-up once per run
        startup = max(total - result.wall_s, 0.0)
        how = f"a calibration run of {first.method} ({steps} updates, start-up included)"
    low = (sum(will) * per_mb + len(will) * startup) / workers
    high = low + (sum(may) * per_mb + more * startup) / workers
    return (f"{len(will)} runs will train" + (f", up to {more} more may" if more else "") + done_text +
            f"; {estimate_span(low, high)} with {workers} worker(s) ({per_mb * 1e3:.1f} ms per micro-batch"
            + (f" and {startup:.1f} s start-up per run" if startup else "") + f" from {how})")


def summary_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (method, N): the tuned lr (or the one it ran at), seeds, and the final validation loss
    mean ± sample std over seeds at that lr, its own tokens (budget 1) only."""
    best = tuned_lrs(records)
    rows = []
    for key in dict.fromkeys((r["method"], int(r["stages"])) for r in records):
        mine = [r for r in records if (r["method"], int(r["stages"])) == key and r.get("budget", 1.0) == 1.0]
        lr = best.get(key, mine[0]["lr"])
        losses = [_loss(r) for r in mine if r["lr"] == lr]
        mean = statistics.fmean(losses)
        sd = statistics.stdev(losses) if len(losses) > 1 and math.isfinite(mean) else 0.0
        rows.append({"method": key[0], "N": key[1], "lr": lr, "seeds": len(losses),
                     "final val loss": "diverged" if not math.isfinite(mean) else
                     (f"{mean:.4f} ± {sd:.4f}" if len(losses) > 1 else f"{mean:.4f}")})
    return rows


def next_lr(lrs: list[float], up: bool = True) -> float:
    """The lr one grid step beyond the largest (``up``) or smallest of the sorted ``lrs``: a grid
    with the half-decade pattern (3e-4, 1e-3, 3e-3) continues it (1e-2); otherwise the last ratio
    repeats. Rounded to 12 significant digits so run ids stay readable."""
    g = lrs if up else [1 / x for x in reversed(lrs)]
    nxt = g[-2] * 10 if len(g) >= 3 and math.isclose(g[-1] / g[-3], 10, rel_tol=1e-6) else g[-1] ** 2 / g[-2]
    return float(f"{(nxt if up else 1 / nxt):.12g}")


def load_spec(path: str | Path) -> SweepSpec:
    """Reads a YAML sweep spec.

    Raises:
        ConfigError: the file is missing, not YAML (or a key given twice), or not a valid spec.
    """
    p = Path(path)
    if p.exists() and not p.is_file():
        raise ConfigError(f"spec={str(p)!r} is not a file: give a YAML sweep spec")
    from unbubble.config import read_text_file, read_yaml

    return SweepSpec.from_dict(read_yaml(read_text_file(p, "spec", "give a YAML sweep spec such as examples/grid.yaml"),
                                         str(p)))


def _stage_costs(trace) -> tuple[list[float], list[float], list[float]]:
    """Median F, B and U seconds of each stage in a measured trace (0 where none ran)."""
    n = trace.n_stages
    d: list[list[list[float]]] = [[[], [], []] for _ in range(n)]
    col = {0: 0, 1: 1, 4: 2}  # KIND_INDEX: F, B, (I, W), U
    for s, k, _, t0, t1, _, _ in trace.rows():
        if k in col:
            d[s][col[k]].append(t1 - t0)
    med = [[statistics.median(x) if x else 0.0 for x in per] for per in d]
    return [m[0] for m in med], [m[1] for m in med], [m[2] for m in med]


class SweepStopped(PipelineFailure):
    """A stop signal (or a stopped run) ended a sweep or an experiment early: no run started after
    it, finished runs are kept (``results/``), and running the same command again continues."""


class _StopFlag:
    """What :func:`~unbubble.runtime.launch.install_stop_handlers` sets on a stop (all it needs of
    a :class:`~unbubble.schedules.policy.Cuts`)."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.busy = 0  # runs being trained (their handlers stop them at a step boundary)


class OutsideARun(KeyboardInterrupt):
    """A stop signal while no run was training (the plan, the analysis, between runs): there is
    nothing to stop gracefully, so it stops at once instead of being ignored."""


@contextmanager
def training():
    """Marks a run (or a sweep's phase of runs) as training: a first stop signal then stops it at its
    next step boundary; outside, a stop raises :class:`OutsideARun` at once."""
    flag = _current_stop
    if flag is not None:
        flag.busy += 1
    try:
        yield
    finally:
        if flag is not None:
            flag.busy -= 1


#: The stop flag of the sweep or experiment this process is running (None: no handlers installed).
_current_stop: _StopFlag | None = None


@contextmanager
def stop_handlers():
    """SIGINT/SIGTERM while this is active stop the sweep or experiment: the first one sets the
    flag it yields (no new run starts; a running run stops at its next step boundary), a second one
    raises KeyboardInterrupt (stop at once). The single-run handlers of ``runtime.launch`` with
    their echo filter (GNU ``timeout`` delivers one stop twice). Nested uses share one flag; off
    the main thread (signals cannot be handled there) the flag is never set."""
    global _current_stop
    import signal
    import threading

    if _current_stop is not None:
        yield _current_stop
        return
    from unbubble.runtime.launch import install_stop_handlers

    flag = _StopFlag()
    on_main = threading.current_thread() is threading.main_thread()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)} if on_main else {}
    if on_main:
        install_stop_handlers(flag, announce=False)  # announced by the sweep, which knows what is running
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _outside_runs(flag, signal.getsignal(sig)))
    _current_stop = flag
    try:
        yield flag
    finally:
        _current_stop = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _outside_runs(flag: _StopFlag, inner):
    """The stop handler: while no run trains (``flag.busy == 0``), the analysis or the plan stops at
    once (:class:`OutsideARun`) rather than ignoring the signal; else ``inner`` (stop at the next
    step boundary, a second signal at once)."""
    import signal

    def handler(signum, frame):
        if not flag.busy and not flag.stop_requested:
            flag.stop_requested = True
            raise OutsideARun(f"{signal.Signals(signum).name} while no run was training")
        inner(signum, frame)

    return handler


def stop_requested() -> bool:
    """True once a stop signal reached the running sweep or experiment (:func:`stop_handlers`)."""
    return _current_stop is not None and _current_stop.stop_requested


class _RunStopped(PipelineFailure):
    """One run ended at a stop, before its last step (not recorded)."""


class _StopOnRequest:
    """Run listener in a sweep worker: forwards to the run writer, and once the sweep asks for a stop
    (``event``) signals this process, whose run's own handler then stops it at its next step
    boundary. From a step, so the run's handler is the one installed (a signal before would be lost)."""

    def __init__(self, writer, event) -> None:
        self.writer, self.event, self.sent = writer, event, False

    def on_step(self, step: int, loss: float, info: dict[str, Any]) -> None:
        self.writer.on_step(step, loss, info)
        if not self.sent and self.event.is_set():
            import signal

            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)

    def __getattr__(self, name: str):  # on_eval, on_event, on_snapshot: the writer's
        return getattr(self.writer, name)


def execute(run: RunSpec, spec: SweepSpec, out: Path, stop_event=None) -> dict[str, Any]:
    """Trains one run and writes ``out/results/<run id>.json`` (atomically). Returns its record.

    Args:
        stop_event: in a worker process, the sweep's stop (a ``multiprocessing.Event``): set, the
            run stops at its next step boundary. In the sweep's own process the run's signal
            handlers see the stop directly.

    Raises:
        PipelineFailure: a stop signal ended the run early; nothing is recorded (a partial run
            must not count as finished), so running the sweep again retrains it.
    """
    import shutil

    from unbubble.train import train

    cfg = spec.config(run, out)
    if Path(cfg.run_dir).exists():  # a run cut short by a stop: start it again
        shutil.rmtree(cfg.run_dir)
    t0 = time.perf_counter()
    if stop_event is None:
        result, _ = train(cfg, on_divergence="record")
    else:
        result, _ = train(cfg, on_divergence="record", listener_factory=lambda writer, total: _StopOnRequest(writer, stop_event))
    wall = time.perf_counter() - t0
    if len(result.step_losses) < cfg.steps:  # a stop at the last step boundary cut nothing short
        raise _RunStopped(f"{spec.name}: run {run.run_id} was stopped at step {len(result.step_losses)} of "
                          f"{cfg.steps}; it is not recorded: run the same command again to continue "
                          "(finished runs are kept)")
    f_s, b_s, u_s = _stage_costs(result.trace)
    vals = result.val_losses
    mb_per_update = cfg.mb_per_step
    tokens_per_update = mb_per_update * cfg.micro_batch_size * cfg.seq_len
    record = {
        "run_id": run.run_id, "method": run.method, "stages": run.stages, "lr": run.lr, "seed": run.seed,
        "phase": run.phase, "budget": run.budget, "schedule": cfg.schedule, "a": cfg.a, "m": cfg.m, "optimizer": cfg.optimizer,
        "switch_after": cfg.switch_after,
        "steps": cfg.steps, "micro_batches": cfg.steps * mb_per_update, "tokens": cfg.steps * tokens_per_update,
        "final_val_loss": _finite(vals[-1][1]) if vals else None,
        "min_val_loss": min((_finite(v) for _, v in vals if math.isfinite(v)), default=None),
        "final_train_loss": _finite(result.step_losses[-1]) if result.step_losses else None,
        "max_drift": max(result.max_drift()), "wall_s": wall,
        "train_wall_s": result.wall_s,  # the training loop alone: wall_s less start-up and final reports
        "commit": source_commit(),
        "f_s": json.dumps(f_s), "b_s": json.dumps(b_s), "u_s": json.dumps(u_s),
        "val_curve": [[v, v * tokens_per_update, _finite(loss)] for v, loss in vals],
        "train_curve": [_finite(x) for x in result.step_losses] if spec.keep_train_curve else [],
    }
    path = out / "results" / f"{run.run_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)
    return record


def _finite(x: float) -> float | None:
    return float(x) if x is not None and math.isfinite(x) else None


def _load(out: Path, run: RunSpec) -> dict[str, Any] | None:
    path = out / "results" / f"{run.run_id}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def reuse_runs(spec: SweepSpec, out: Path, folder: str | Path, source: SweepSpec) -> list[str]:
    """Files the published runs of ``folder`` (``runs.csv`` + ``curves.csv`` of the sweep
    ``source``) as finished runs of ``spec`` in ``out/results/``, so that ``spec`` does not train
    them again: only runs whose method has the same label, settings (TrainConfig overrides and
    horizon) and depth in both specs, under the same ``base``, ``micro_batches`` and ``evals``.
    A run already in ``out/results/`` is kept. Returns the reused run ids.

    The settings check is what makes reuse sound: a label names a configuration only within its
    own spec. The reused records lack ``train_wall_s`` and the training curve (not published).
    """
    if (spec.base, spec.micro_batches, spec.evals) != (source.base, source.micro_batches, source.evals):
        return []
    same = {m.label for m in spec.methods for s in source.methods
            if m.label == s.label and (m.overrides, m.horizon) == (s.overrides, s.horizon)}
    data = read_tables(folder)
    reused = []
    for row in data.runs:
        if row["method"] not in same:
            continue
        path = out / "results" / f"{row['run_id']}.json"
        if path.is_file():
            continue
        record = {k: row.get(k, "") for k in RUN_COLUMNS}
        for k in ("f_s", "b_s", "u_s"):
            record[k] = json.dumps(row[k])
        record["val_curve"] = [list(p) for p in data.val.get(row["run_id"], [])]
        record["train_curve"] = []
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record))
        reused.append(row["run_id"])
    return reused


def tuned_lrs(records: list[dict[str, Any]]) -> dict[tuple[str, int], float]:
    """The lr with the lowest final validation loss per (method, N), over the tuning runs
    (a diverged run, loss None, loses; ties go to the smaller lr)."""
    best: dict[tuple[str, int], tuple[float, float]] = {}
    for r in records:
        if r["phase"] != "tune":
            continue
        key = (r["method"], int(r["stages"]))
        loss = r["final_val_loss"] if r["final_val_loss"] is not None else math.inf
        if key not in best or (loss, r["lr"]) < best[key]:
            best[key] = (loss, r["lr"])
    return {k: v[1] for k, v in best.items()}


def run_sweep(spec: SweepSpec, out: Path, workers: int = 2,
              progress: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Runs the sweep (skipping finished runs), then writes runs.csv and curves.csv.

    Args:
        spec: the sweep.
        out: its folder (results/, runs/, runs.csv, curves.csv).
        workers: runs trained at once, each in its own process on one torch thread
            (2 on a 2-core machine); with 1, runs train one after another in this process.
        progress: called with the plan (runs and estimated time) first, then one line per
            finished run.

    Returns:
        Every run's record, tuning runs first.

    Raises:
        SweepStopped: SIGINT/SIGTERM (:func:`stop_handlers`): no run started after the first, the
            running ones stopped at their next step boundary (a second stopped them at once); the
            message says what finished.
    """
    say = progress or log.info
    out.mkdir(parents=True, exist_ok=True)
    with stop_handlers() as flag:
        try:
            rows = plan(spec, out)
            if any(c != "done" for _, _, c in rows):
                say(f"{spec.name}: " + estimate(spec, out, workers, rows, flag, max_share=0.05))
            records = _run_all(spec.tuning_runs(), spec, out, workers, say, flag)
            for _ in range(spec.extend_grid if spec.tune else 0):
                edges = spec.edge_runs(records)
                if not edges:
                    break
                records += _run_all(edges, spec, out, workers, say, flag)
            records += _run_all(spec.seed_runs(tuned_lrs(records)), spec, out, workers, say, flag)
            while True:  # token budgets: each round decides from the finished ones
                more = spec.budget_runs(records)
                if not more:
                    break
                records += _run_all(more, spec, out, workers, say, flag)
        except KeyboardInterrupt as exc:  # a second stop signal (the workers were ended at once), or one outside runs
            n = len(list((out / "results").glob("*.json")))
            how = f"stopped at once ({exc})" if isinstance(exc, OutsideARun) else "stopped at once by a second signal"
            raise SweepStopped(f"{spec.name}: {how}; the running runs are not "
                               f"recorded, {n} finished run(s) are kept in {out / 'results'}: run the same "
                               "command again to continue") from None
    write_tables(records, out)
    return records


def _run_all(runs: list[RunSpec], spec: SweepSpec, out: Path, workers: int,
             say: Callable[[str], None], flag: _StopFlag) -> list[dict[str, Any]]:
    done = {r.run_id: rec for r in runs if (rec := _load(out, r)) is not None}
    todo = [r for r in runs if r.run_id not in done]
    if done:
        say(f"{spec.name}: {len(done)} of {len(runs)} {runs[0].phase} runs already finished (skipped)")
    t0 = time.perf_counter()
    count = [0]

    def finished(rec: dict[str, Any]) -> None:
        done[rec["run_id"]] = rec
        count[0] += 1
        loss = rec["final_val_loss"]
        say(f"{spec.name}: {count[0]}/{len(todo)} {rec['run_id']}: val loss "
            f"{'diverged' if loss is None else format(loss, '.4f')} "
            f"({elapsed(rec['wall_s'])}, {elapsed(time.perf_counter() - t0)} so far)")

    with training():
        stopped = _train_all(todo, spec, out, workers, finished, flag, say)
    if flag.stop_requested and (stopped or len(done) < len(runs)):
        left = len(todo) - count[0] - len(stopped)
        first = stopped[0] if len(stopped) == 1 else (
            f"{spec.name}: runs stopped before their last step: " + ", ".join(m.split()[2] for m in stopped) +
            "; they are not recorded: run the same command again to continue (finished runs are kept)"
            if stopped else f"{spec.name}: stopped before the next run started: run the same command again to "
                            "continue (finished runs are kept)")
        raise SweepStopped(f"{first}; this {runs[0].phase} phase: {count[0]} of {len(todo)} finished, {left} not "
                           f"started; {len(list((out / 'results').glob('*.json')))} finished run(s) in "
                           f"{out / 'results'}")
    return [done[r.run_id] for r in runs]


def _train_all(todo: list[RunSpec], spec: SweepSpec, out: Path, workers: int, finished: Callable[[dict], None],
               flag: _StopFlag, say: Callable[[str], None]) -> list[str]:
    """Trains ``todo`` (here or in worker processes); returns the messages of the runs a stop ended."""
    stopped: list[str] = []
    if len(todo) == 1 or (todo and workers == 1):  # in this process: no interpreter to start
        for r in todo:
            if flag.stop_requested:
                break
            try:
                finished(execute(r, spec, out))
            except _RunStopped as exc:  # the run's own handlers took the signal
                stopped.append(str(exc))
                flag.stop_requested = True
            except PipelineFailure as exc:
                if isinstance(exc.__context__, KeyboardInterrupt):  # the run's handlers took a second signal
                    raise KeyboardInterrupt from None
                raise
    elif todo:
        stopped = _in_workers(todo, spec, out, workers, finished, flag, say)
    return stopped


def _worker(tasks, results, stop, parent: int) -> None:
    """A sweep's worker process: trains the runs it is handed, one at a time, until it gets None."""
    import pickle
    import signal

    from unbubble.runtime.launch import _STOP_SIGNALS, _die_with_parent

    _die_with_parent()
    if os.getppid() != parent:  # the sweep died before PDEATHSIG was set
        os._exit(1)
    for sig in _STOP_SIGNALS:  # discards a Ctrl-C still pending from the start (blocked then)
        signal.signal(sig, signal.SIG_IGN)
    os.setpgrp()  # a terminal's Ctrl-C (or timeout's to the group) reaches the sweep only, which tells the run
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    while (task := tasks.get()) is not None:
        run, spec, out = task
        try:
            results.put(("done", run.run_id, execute(run, spec, out, stop)))
        except _RunStopped as exc:
            results.put(("stopped", run.run_id, str(exc)))
        except BaseException as exc:  # noqa: BLE001 - re-raised by the sweep
            try:
                pickle.dumps(exc)
            except Exception:  # noqa: BLE001
                exc = PipelineFailure(f"{spec.name}: run {run.run_id} failed: {type(exc).__name__}: {exc}")
            results.put(("failed", run.run_id, exc))


def _in_workers(todo: list[RunSpec], spec: SweepSpec, out: Path, workers: int, finished: Callable[[dict], None],
                flag: _StopFlag, say: Callable[[str], None]) -> list[str]:
    """Trains ``todo`` in ``workers`` processes, each handed a run only when it is idle, so that
    none is queued to start after a stop (or a failure: the others then stop too). Returns the
    messages of the runs a stop ended; raises the first failure once every worker is idle."""
    import queue
    import signal
    import threading

    from unbubble.runtime.launch import _STOP_SIGNALS

    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no forked torch thread pools
    results, stop = ctx.Queue(), ctx.Event()
    tasks = [ctx.SimpleQueue() for _ in range(min(workers, len(todo)))]
    procs = [ctx.Process(target=_worker, args=(t, results, stop, os.getpid()), name=f"unbubble-sweep-{i}")
             for i, t in enumerate(tasks)]
    on_main = threading.current_thread() is threading.main_thread()
    queued, running, stopped, failure = list(todo), {}, [], None
    try:
        if on_main:  # they start with SIGINT/SIGTERM blocked, and a second stop must not cut a start short
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            for p in procs:
                p.start()
        finally:
            if on_main:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        idle = list(range(len(procs)))
        while running or (queued and not stop.is_set()):
            if (flag.stop_requested or failure is not None) and not stop.is_set():
                stop.set()  # each running run signals itself at its next step (_StopOnRequest)
                if flag.stop_requested:
                    say(f"{spec.name}: stop requested: no new run starts; the {len(running)} running run(s) stop at "
                        "their next step boundary (send it again to stop at once)")
                continue
            while idle and queued and not stop.is_set():
                w, run = idle.pop(), queued.pop(0)
                tasks[w].put((run, spec, out))
                running[w] = run
            try:
                kind, run_id, payload = results.get(timeout=0.5)
            except queue.Empty:
                for w, run in running.items():
                    if procs[w].exitcode is not None:
                        raise PipelineFailure(f"{spec.name}: the worker process training run {run.run_id} exited "
                                              f"with code {procs[w].exitcode} without a report; it is not recorded")
                continue
            w = next(w for w, run in running.items() if run.run_id == run_id)
            del running[w]
            idle.append(w)
            if kind == "done":
                finished(payload)
            elif kind == "stopped":
                stopped.append(payload)
            elif failure is None:
                failure = payload
        for t in tasks:
            t.put(None)
        for p in procs:
            p.join(timeout=10)
    finally:
        for p in procs:  # after a second stop or a failure here: at once
            if p.pid is not None and p.is_alive():
                p.kill()
                p.join(timeout=10)
    if failure is not None:
        raise failure
    return stopped


def raw_tables(out: Path) -> list[Path]:
    """``[out/runs.csv, out/curves.csv]``: where :func:`write_tables` writes a sweep's raw data."""
    return [out / "runs.csv", out / "curves.csv"]


def write_tables(records: list[dict[str, Any]], out: Path) -> tuple[Path, Path]:
    """``runs.csv`` (one row per run) and ``curves.csv`` (run_id, kind, update, tokens, loss)."""
    runs_csv, curves_csv = raw_tables(out)
    with open(runs_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(RUN_COLUMNS))
        w.writeheader()
        for r in records:
            w.writerow({k: r.get(k, "") for k in RUN_COLUMNS})  # records before "commit" lack it
    with open(curves_csv, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run_id", "kind", "update", "tokens", "loss"])
        for r in records:
            for v, tok, loss in r["val_curve"]:
                w.writerow([r["run_id"], "val", v, tok, "" if loss is None else f"{loss:.5f}"])
            per_update = r["tokens"] // max(r["steps"], 1)
            for i, loss in enumerate(r["train_curve"], 1):
                w.writerow([r["run_id"], "train", i, i * per_update, "" if loss is None else f"{loss:.5f}"])
    return runs_csv, curves_csv


@dataclass
class SweepData:
    """runs.csv and curves.csv read back (what every analysis starts from)."""

    runs: list[dict[str, Any]]
    val: dict[str, list[tuple[int, int, float | None]]] = field(default_factory=dict)
    train: dict[str, list[float | None]] = field(default_factory=dict)


def read_tables(folder: str | Path) -> SweepData:
    """Reads ``runs.csv`` and ``curves.csv`` of a sweep folder.

    Raises:
        ConfigError: either file is missing.
    """
    folder = Path(folder)
    for name in ("runs.csv", "curves.csv"):
        if not (folder / name).is_file():
            raise ConfigError(f"{folder / name} is missing: run the sweep first (or give the folder that holds it)")
    num = {"stages": int, "seed": int, "a": int, "m": int, "steps": int, "micro_batches": int, "tokens": int,
           "max_drift": int, "lr": float, "wall_s": float, "budget": float, "switch_after": int}
    runs = []
    with open(folder / "runs.csv") as f:
        for row in csv.DictReader(f):
            row.setdefault("budget", "1.0")  # sweeps written before token budgets
            row.setdefault("commit", "")  # sweeps written before the commit was recorded
            row["switch_after"] = row.get("switch_after") or "0"  # sweeps written before --switch-after
            for k, conv in num.items():
                row[k] = conv(row[k])
            for k in ("final_val_loss", "min_val_loss", "final_train_loss"):
                row[k] = float(row[k]) if row[k] not in ("", "None") else None
            for k in ("f_s", "b_s", "u_s"):
                row[k] = json.loads(row[k])
            runs.append(row)
    data = SweepData(runs)
    with open(folder / "curves.csv") as f:
        for row in csv.DictReader(f):
            loss = float(row["loss"]) if row["loss"] else None
            if row["kind"] == "val":
                data.val.setdefault(row["run_id"], []).append((int(row["update"]), int(row["tokens"]), loss))
            else:
                data.train.setdefault(row["run_id"], []).append(loss)
    return data
