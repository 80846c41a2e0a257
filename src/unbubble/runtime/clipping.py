"""Gradient-norm clipping and the non-finite check over the whole pipeline, for every schedule.

A global clip needs every stage's gradient norm at every update: an all-reduce across the pipeline,
a barrier that stalls PACI's staggered stages. Each rank exchanges its stages' per-tensor norms once
per update and clips with scope ``sync`` (exact, as torchtitan), ``stale`` (the norm of update t − s,
which by causality never makes a rank wait) or ``stage`` (local); norms are reduced in stage order,
so the emulator and the processes compute the same bits. The scopes' vocabulary is
``schedules/clip.py``.

Notes: [Note: clip scopes], [Note: stale lag] (the lag's proof, why neither scope deadlocks, why
``post-validate`` is refused) in docs/architecture.md#global-operations-are-barriers.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from unbubble.errors import ConfigError, ScheduleError, check_int
from unbubble.schedules.clip import check_clip
from unbubble.schedules.clip import stale_lag as _lag

log = logging.getLogger(__name__)

#: torch.nn.utils.clip_grads_with_norm_'s ε in max_norm / (norm + ε).
EPS = 1e-6
_LOGGED = 3


def check_rank_updates(schedule) -> None:
    """A rank with several stages exchanges their norms once per update, at its first ``U`` of
    that update: refuses a schedule whose list interleaves other actions between one rank's
    updates of one step (none of ours does; every stage's gradients must be complete there).

    Raises:
        ConfigError: naming the schedule, rank and action.
    """
    if schedule.virtual == 1 or schedule.asynchronous:
        return
    for rank, acts in enumerate(schedule.static_order()):
        run = 0
        for a in acts[: 4 * schedule.mb_per_step * 3 * schedule.virtual + 8]:  # the first steps: lists repeat per step
            if a.kind.value == "U":
                run += 1
            elif 0 < run < schedule.virtual:
                raise ConfigError(f"schedule={schedule.name!r} runs {a} between rank {rank}'s updates of one step: "
                                  "global clipping needs them adjacent (set --clip-scope stage)")
            else:
                run = 0


def tensor_norms(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """The 2-norm of each tensor as ``torch.nn.utils.get_total_norm`` computes them (``torch._foreach_norm``
    per device and dtype, else ``vector_norm``), as one float32 vector; 0 for a ``None`` (a parameter
    without a gradient), so the length is fixed."""
    present = [t for t in tensors if t is not None]
    if not present:
        return torch.zeros(len(tensors))
    from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

    norms: dict[int, torch.Tensor] = {}
    index = {id(t): i for i, t in enumerate(tensors) if t is not None}
    grouped = _group_tensors_by_device_and_dtype([present])
    for (device, _), ([group], _) in grouped.items():
        if _has_foreach_support(group, device):
            values = torch._foreach_norm(group, 2.0)
        else:
            values = [torch.linalg.vector_norm(g, 2.0) for g in group]
        for t, v in zip(group, values):
            norms[index[id(t)]] = v
    first = present[0].device
    zero = torch.zeros((), device=first)
    return torch.stack([norms.get(i, zero).to(first, torch.float32) for i in range(len(tensors))])


def total_norm(vector: torch.Tensor) -> torch.Tensor:
    """The 2-norm of the per-tensor norms (``get_total_norm``'s last step)."""
    return torch.linalg.vector_norm(vector, 2.0)


def stage_sizes(ex) -> tuple[int, int]:
    """``(gradient tensors, parameters)`` of one stage's executor."""
    return len(ex.grad_params), sum(p.numel() for p in ex.grad_params)


def _assemble(schedule, sizes: dict[int, tuple[int, int]], per_rank: list[torch.Tensor]) -> torch.Tensor:
    """Every stage's per-tensor norms, in stage order, from each rank's contribution (its stages'
    norms concatenated in increasing stage order, possibly padded)."""
    parts = []
    for s in range(schedule.n_stages):
        r = schedule.rank_of(s)
        offset = sum(sizes[o][0] for o in schedule.stages_of(r) if o < s)
        parts.append(per_rank[r][offset: offset + sizes[s][0]])
    return torch.cat(parts)


class LocalExchange:
    """The emulator's all-gather: every rank's contribution of update t, assembled in one process."""

    def __init__(self, schedule, sizes: dict[int, tuple[int, int]]):
        self.schedule, self.sizes = schedule, sizes
        self._parts: dict[int, dict[int, torch.Tensor]] = {}
        self._reads: dict[int, int] = {}

    def start(self, rank: int, t: int, vector: torch.Tensor) -> None:
        self._parts.setdefault(t, {})[rank] = vector

    def ready(self, t: int) -> bool:
        return len(self._parts.get(t, ())) == self.schedule.n_ranks

    def result(self, t: int) -> torch.Tensor:
        if not self.ready(t):
            raise ScheduleError(f"the global gradient norm of update {t} is incomplete: ranks "
                                f"{sorted(set(range(self.schedule.n_ranks)) - set(self._parts.get(t, ())))} have not "
                                "reached it (the stale lag's guarantee failed; [Note: stale lag])")
        parts = self._parts[t]
        out = _assemble(self.schedule, self.sizes, [parts[r] for r in range(self.schedule.n_ranks)])
        self._reads[t] = self._reads.get(t, 0) + 1
        if self._reads[t] == self.schedule.n_ranks:  # every rank has its copy
            del self._parts[t], self._reads[t]
        return out

    def drain(self) -> None:
        pass


class DistExchange:
    """The process engine's all-gather over one replica's pipeline ranks (a dedicated group): each
    rank's vector is padded to the longest, gathered (``async_op`` under ``stale``) and assembled in
    stage order, the same bits as :class:`LocalExchange`."""

    def __init__(self, group, schedule, sizes: dict[int, tuple[int, int]], blocking: bool):
        self.group, self.schedule, self.sizes, self.blocking = group, schedule, sizes, blocking
        self.width = max(sum(sizes[s][0] for s in schedule.stages_of(r)) for r in range(schedule.n_ranks))
        self._pending: dict[int, tuple[Any, list[torch.Tensor], torch.Tensor]] = {}

    @staticmethod
    def gather_sizes(group, schedule, rank: int, local: dict[int, tuple[int, int]],
                     device: torch.device | None = None) -> dict[int, tuple[int, int]]:
        """Every stage's :func:`stage_sizes` from each rank's own (one blocking all-gather at set-up;
        ``device``: where the group's backend takes tensors, the GPU under NCCL)."""
        mine = torch.tensor([local[s] for s in schedule.stages_of(rank)], dtype=torch.int64, device=device)
        out = [torch.empty_like(mine) for _ in range(schedule.n_ranks)]
        dist.all_gather(out, mine, group=group)
        return {s: tuple(int(x) for x in out[r][i].tolist()) for r in range(schedule.n_ranks)
                for i, s in enumerate(schedule.stages_of(r))}

    def start(self, rank: int, t: int, vector: torch.Tensor) -> None:
        padded = torch.zeros(self.width, dtype=vector.dtype, device=vector.device)
        padded[: vector.numel()] = vector
        out = [torch.empty_like(padded) for _ in range(self.schedule.n_ranks)]
        work = dist.all_gather(out, padded, group=self.group, async_op=not self.blocking)
        self._pending[t] = (work, out, padded)

    def ready(self, t: int) -> bool:
        return True

    def result(self, t: int) -> torch.Tensor:
        work, out, _ = self._pending.pop(t)
        if work is not None:
            work.wait()
        return _assemble(self.schedule, self.sizes, out)

    def drain(self) -> None:
        """Waits for every collective still in flight (the last s updates' under ``stale``)."""
        for t in sorted(self._pending):
            work = self._pending.pop(t)[0]
            if work is not None:
                work.wait()


class RankClipper:
    """Clips the updates of one rank's stages ([Note: clip scopes]); set as their executors'
    ``clipper``. The rank contributes its stages' per-tensor norms once per update t, at its first
    ``U`` of t (all its stages' gradients of t are complete there, :func:`check_rank_updates`).

    Args:
        max_norm: X.
        scope: one of :data:`~unbubble.schedules.clip.CLIP_SCOPES`.
        lag: s of ``stale`` (:attr:`~unbubble.schedules.registry.Schedule.stale_lag`: update t is clipped by
            the global norm of update t − s, [Note: stale lag]).
        rank: the pipeline rank.
        execs: the rank's executors by stage.
        exchange: :class:`LocalExchange` or :class:`DistExchange` (``None`` for ``stage``).
        sizes: every stage's ``(gradient tensors, parameters)``.
    """

    def __init__(self, max_norm: float, scope: str, lag: int, rank: int, execs: dict, exchange,
                 sizes: dict[int, tuple[int, int]]):
        self.max_norm, self.scope, self.lag, self.rank = float(max_norm), scope, lag, rank
        self.execs = dict(sorted(execs.items()))
        self.exchange = exchange
        total = sum(p for _, p in sizes.values())
        self.share = {s: math.sqrt(sizes[s][1] / total) if total else 1.0 for s in self.execs}
        self._totals: dict[int, torch.Tensor] = {}
        self._own: dict[int, torch.Tensor] = {}  # stage -> its per-tensor norms of the update contributed last
        self._contributed = -1
        for ex in self.execs.values():
            ex.clipper = self

    def restore(self) -> None:
        """After loading a checkpoint: contributes the saved norms of the last s updates again, in
        update order (every rank does the same), so updates T … T + s − 1 clip as uninterrupted."""
        first = next(iter(self.execs.values()))
        if self.scope == "stale":
            missing = [t for t in range(max(0, first.version - self.lag), first.version) if t not in first.clip_recent]
            if missing:
                raise ConfigError(f"the checkpoint of step {first.version} holds no gradient norms of updates "
                                  f"{missing[0]}–{missing[-1]}, which clip_scope='stale' (lag {self.lag}) needs: it was "
                                  "written with another --clip-scope or --clip-grad-norm; resume with that one")
        for t in sorted(first.clip_recent):
            self._start(t, [ex.clip_recent[t].to(self._device(ex)) for ex in self.execs.values()])

    @staticmethod
    def _device(ex) -> torch.device:
        return ex.grad_params[0].device if ex.grad_params else torch.device("cpu")

    def _start(self, t: int, vectors: list[torch.Tensor]) -> None:
        self.exchange.start(self.rank, t, torch.cat(vectors))
        self._contributed = t

    def contribute(self, t: int) -> None:
        """The rank's part of update t's exchange (once; prepares each of its stages' update)."""
        if t <= self._contributed:
            return
        vectors = []
        for ex in self.execs.values():
            ex.prepare_update()
            v = self._own[ex.stage] = tensor_norms([p.grad for p in ex.grad_params])
            if self.scope == "stale":  # what a resume must contribute again ([Note: stale lag])
                ex.clip_recent[t] = v.detach().cpu()
                for old in [u for u in ex.clip_recent if u <= t - self.lag]:
                    del ex.clip_recent[old]
            vectors.append(v)
        self._start(t, vectors)

    def ready(self, ex) -> bool:
        """Whether ``ex``'s next update can run now (the emulator's barrier under ``sync``)."""
        if self.scope != "sync":
            return True
        self.contribute(ex.version)
        return ex.version in self._totals or self.exchange.ready(ex.version)

    def _global(self, t: int) -> torch.Tensor:
        total = self._totals.get(t)
        if total is None:
            total = self._totals[t] = total_norm(self.exchange.result(t))
            for old in [u for u in self._totals if u < t - self.lag]:
                del self._totals[old]
        return total

    def clip(self, ex) -> bool:
        """Clips ``ex``'s accumulated gradients for its update ``ex.version`` in place.

        Returns:
            ``True`` to apply the update, ``False`` to skip it (a non-finite norm).
        """
        t, s = ex.version, ex.stage
        if self.scope == "stage":
            local = total_norm(tensor_norms([p.grad for p in ex.grad_params]))
            return self._apply(ex, local, self.max_norm * self.share[s], "its own gradient norm", "this stage")
        self.contribute(t)
        if self.scope == "sync":
            return self._apply(ex, self._global(t), self.max_norm, f"the global gradient norm of update {t}",
                               "every stage")
        local = total_norm(self._own[s])  # stale: the local check at once (the norms just contributed)
        if not bool(torch.isfinite(local)):
            return self._apply(ex, local, self.max_norm, "its own gradient norm", "this stage (at once)")
        if t < self.lag:  # no global norm yet: clipped as scope stage
            ex.clip_stats["local"] += 1
            return self._apply(ex, local, self.max_norm * self.share[s], "its own gradient norm", "this stage")
        return self._apply(ex, self._global(t - self.lag), self.max_norm,
                           f"the global gradient norm of update {t - self.lag}", "every stage")

    def _apply(self, ex, norm: torch.Tensor, threshold: float, what: str, where: str) -> bool:
        coef = threshold / (norm + EPS)
        finite, clipped = torch.stack([torch.isfinite(norm), coef < 1]).tolist()
        if not finite:
            ex.clip_stats["skipped"] += 1
            ex.events.append({"stage": ex.stage, "mb": None, "version": ex.version, "policy": f"clip-{self.scope}",
                              "what": f"{what} (update skipped on {where})"})
            if ex.clip_stats["skipped"] <= _LOGGED:
                log.warning("stage %d skipped update %d: %s is non-finite (clip scope %s; skipped on %s)",
                            ex.stage, ex.version, what, self.scope, where)
            return False
        if clipped:
            ex.clip_stats["clipped"] += 1
        torch.nn.utils.clip_grads_with_norm_(ex.grad_params, threshold, norm)
        return True


def attach_local(job, execs: list) -> dict[int, RankClipper]:
    """The emulator's clippers, one per rank (all stages in this process); ``{}`` without clipping."""
    if job.clip_grad_norm is None:
        return {}
    sched = job.schedule
    sizes = {ex.stage: stage_sizes(ex) for ex in execs}
    exchange = None if job.clip_scope == "stage" else LocalExchange(sched, sizes)
    clippers = {r: RankClipper(job.clip_grad_norm, job.clip_scope, sched.stale_lag, r,
                               {s: execs[s] for s in sched.stages_of(r)}, exchange, sizes)
                for r in range(sched.n_ranks)}
    for c in clippers.values():
        c.restore()
    return clippers


def attach_dist(job, execs: dict, rank: int, group, device: torch.device | None = None) -> RankClipper | None:
    """One stage process's clipper: exchanges the stages' sizes once (a blocking all-gather over
    ``group``, the replica's pipeline ranks), then contributes its saved norms after a resume."""
    if job.clip_grad_norm is None:
        return None
    sched = job.schedule
    sizes = DistExchange.gather_sizes(group, sched, rank, {s: stage_sizes(ex) for s, ex in execs.items()}, device)
    exchange = None if job.clip_scope == "stage" else DistExchange(group, sched, sizes, job.clip_scope == "sync")
    clipper = RankClipper(job.clip_grad_norm, job.clip_scope, sched.stale_lag, rank, execs, exchange, sizes)
    clipper.restore()
    return clipper


def clip_summary(job, stats: list[dict[str, int]]) -> dict[str, Any] | None:
    """``summary.json``'s ``clip``: scope, threshold, lag and per-stage counts of clipped updates,
    skipped updates and (``stale``) updates clipped locally before the first global norm."""
    if job.clip_grad_norm is None:
        return None
    out = {"scope": job.clip_scope, "max_norm": job.clip_grad_norm,
           "lag": job.schedule.stale_lag if job.clip_scope == "stale" else None,
           "clipped": [s.get("clipped", 0) for s in stats], "skipped": [s.get("skipped", 0) for s in stats]}
    if job.clip_scope == "stale":
        out["local"] = [s.get("local", 0) for s in stats]
    return out


def causal_lag(schedule, orders: list[list]) -> int:
    """The smallest lag s such that, in every execution of ``orders`` (per-rank action lists),
    every stage has started its update t − s before any stage starts its update t: exact, from
    vector clocks over the lists' program order and messages (F(s, k) → F(s+1, k); the backward
    or input-gradient of (s, k) → that of (s−1, k)); costs and timing play no part.

    Raises:
        ScheduleError: the lists deadlock (a message never sent before it is needed).
    """
    n = schedule.n_stages
    clocks = [[0] * n for _ in range(schedule.n_ranks)]
    sent: dict[tuple[str, int, int], list[int]] = {}
    pos = [0] * schedule.n_ranks
    need = 1
    progress = True
    while progress:
        progress = False
        for r, acts in enumerate(orders):
            while pos[r] < len(acts):
                a = acts[pos[r]]
                kind = a.kind.value
                key = None
                if kind == "F" and a.stage > 0:
                    key = ("F", a.stage - 1, a.mb)
                elif kind in "BI" and a.stage < n - 1:
                    key = ("B", a.stage + 1, a.mb)
                if key is not None:
                    if key not in sent:
                        break
                    clocks[r] = [max(x, y) for x, y in zip(clocks[r], sent[key])]
                if kind == "U":
                    t = clocks[r][a.stage]  # its update index: the updates of its own stage seen so far
                    need = max(need, max(t + 1 - c for c in clocks[r]))
                    clocks[r][a.stage] += 1
                elif kind == "F" and a.stage < n - 1:
                    sent[("F", a.stage, a.mb)] = list(clocks[r])
                elif kind in "BI" and a.stage > 0:
                    sent[("B", a.stage, a.mb)] = list(clocks[r])
                pos[r] += 1
                progress = True
    stuck = [r for r in range(schedule.n_ranks) if pos[r] < len(orders[r])]
    if stuck:
        raise ScheduleError(f"the orders deadlock at ranks {stuck}: next {[str(orders[r][pos[r]]) for r in stuck]}")
    return need


class PipelineClip:
    """Gradient clipping for a loop over torch's ``PipelineStage`` (``unbubble.pipelining.SchedulePACI``,
    one stage per rank), with the scopes of [Note: clip scopes]: call it on every rank right after
    ``schedule.step()`` (every rank then holds the gradients of its update t) and step the optimizer
    only if the norm it returns is finite.

    .. code-block:: python

        clip = PipelineClip(1.0, "stale", a=4, group=pp_group)   # s = ⌈N/a⌉
        for step in range(steps):
            optimizer.zero_grad()
            schedule.step(data_iterator, losses=losses)
            norm = clip(model_part.parameters())                  # stale: no rank waits
            if torch.isfinite(norm):
                optimizer.step()
            lr_scheduler.step()
        schedule.drain()
        clip.drain()                                              # the last s updates' all-gathers

    ``sync`` is :func:`unbubble.pipelining.clip_grad_norm_pp`'s global clip made deterministic (an
    all-gather of the per-tensor norms summed in rank order instead of an all-reduce whose order the
    backend picks); ``stale`` clips update t by the global norm of update t − s, s = ⌈N/a⌉ (the
    all-gather of update t − s was started s calls earlier and every rank has entered it: [Note: stale
    lag]); ``stage`` clips by the rank's own norm against X·√(P_i/P). Updates t < s under ``stale`` clip
    as ``stage``. The norms are those of unbubble's own runtime, so with the same model, data and order
    the weights equal the emulator's bit for bit (tested on ``examples/torch_pipelining_paci.py``).

    Args:
        max_norm: X.
        scope: ``"sync"``, ``"stale"`` or ``"stage"``.
        a: backwards per update (PACI's a); sets s = ⌈N/a⌉. Give ``lag`` instead for a flushed torch
            schedule (1).
        lag: s, overriding ``a``.
        group: the pipeline's process group (default: the world), one rank per stage in stage order.
            A group of its own keeps the ``stale`` collectives apart from the schedule's sends.

    Raises:
        ConfigError: a bad ``max_norm`` or ``scope``, or neither ``a`` nor ``lag`` under ``stale``.
    """

    def __init__(self, max_norm: float, scope: str = "stale", *, a: int | None = None, lag: int | None = None,
                 group=None):
        check_clip(max_norm, scope)
        self.max_norm, self.scope, self.group = float(max_norm), scope, group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if lag is None and a is not None:
            check_int("a", a, 1, "PACI's backwards per update")
            lag = _lag(self.n, a)
        if scope == "stale":
            check_int("lag", lag, 1, valid="scope 'stale' needs a (s = ⌈N/a⌉) or an integer lag ≥ 1")
        self.lag = lag or 1
        self.step = 0  # updates clipped so far on this rank: the next call is update t = step
        self.recent: dict[int, torch.Tensor] = {}  # stale: own per-tensor norms of the last s updates
        self._sizes: list[tuple[int, int]] | None = None
        self._pending: dict[int, tuple[Any, list[torch.Tensor]]] = {}

    def _setup(self, count: int, numel: int, device: torch.device) -> None:
        mine = torch.tensor([count, numel], dtype=torch.int64, device=device)
        out = [torch.empty_like(mine) for _ in range(self.n)]
        dist.all_gather(out, mine, group=self.group)
        self._sizes = [tuple(int(x) for x in o.tolist()) for o in out]
        total = sum(p for _, p in self._sizes)
        self.share = math.sqrt(numel / total) if total else 1.0
        self.width = max(c for c, _ in self._sizes)

    def _start(self, t: int, vector: torch.Tensor) -> None:
        padded = torch.zeros(self.width, dtype=vector.dtype, device=vector.device)
        padded[: vector.numel()] = vector
        out = [torch.empty_like(padded) for _ in range(self.n)]
        work = dist.all_gather(out, padded, group=self.group, async_op=self.scope == "stale")
        self._pending[t] = (work, out)

    def _global(self, t: int) -> torch.Tensor:
        work, out = self._pending.pop(t)
        if work is not None:
            work.wait()
        return total_norm(torch.cat([o[:c] for o, (c, _) in zip(out, self._sizes)]))

    def __call__(self, parameters) -> torch.Tensor:
        """Clips this rank's gradients of update t (the call count) in place.

        Returns:
            The norm the update was clipped by (a 0-dim tensor); non-finite: skip this update's
            ``optimizer.step()`` (under ``sync`` and for a stale global norm every rank gets the same value).
        """
        params = [p for p in parameters if p.requires_grad]
        vector = tensor_norms([p.grad for p in params])
        device = vector.device
        if self._sizes is None:
            self._setup(len(params), sum(p.numel() for p in params), device)
        t, self.step = self.step, self.step + 1
        if self.scope == "stage":
            return self._apply(params, total_norm(vector), self.max_norm * self.share)
        self._start(t, vector)
        if self.scope == "sync":
            return self._apply(params, self._global(t), self.max_norm)
        self.recent[t] = vector.detach().cpu()
        for old in [u for u in self.recent if u <= t - self.lag]:
            del self.recent[old]
        local = total_norm(vector)
        if not bool(torch.isfinite(local)):
            return local
        if t < self.lag:
            return self._apply(params, local, self.max_norm * self.share)
        return self._apply(params, self._global(t - self.lag), self.max_norm)

    @staticmethod
    def _apply(params: list[torch.Tensor], norm: torch.Tensor, threshold: float) -> torch.Tensor:
        if bool(torch.isfinite(norm)):
            torch.nn.utils.clip_grads_with_norm_(params, threshold, norm)
        return norm

    def drain(self) -> None:
        """Waits for the all-gathers still in flight (call on every rank before the group is destroyed)."""
        for t in sorted(self._pending):
            work = self._pending.pop(t)[0]
            if work is not None:
                work.wait()

    def state_dict(self) -> dict[str, Any]:
        """What a resume needs: the update count and, under ``stale``, this rank's norms of the last s updates."""
        return {"step": self.step, "recent": dict(self.recent)}

    def load_state_dict(self, state: dict[str, Any], parameters) -> None:
        """Restores :meth:`state_dict` on a fresh object, before its first call, and starts the saved
        updates' all-gathers again in order (every rank does the same, like the first call's exchange of
        sizes), so updates T … T + s − 1 clip as in the uninterrupted run.

        Args:
            state: :meth:`state_dict` of this rank.
            parameters: this rank's parameters (the ones the calls will get).

        Raises:
            ConfigError: the state lacks norms ``stale`` needs (saved under another scope or lag).
        """
        params = [p for p in parameters if p.requires_grad]
        step, recent = state["step"], dict(state["recent"])
        missing = [t for t in range(max(0, step - self.lag), step) if t not in recent]
        if self.scope == "stale" and missing:
            raise ConfigError(f"the clip state of update {step} holds no gradient norms of updates {missing[0]}–"
                              f"{missing[-1]}, which scope 'stale' (lag {self.lag}) needs: it was saved with another "
                              "scope or lag")
        device = params[0].device if params else torch.device("cpu")
        self._setup(len(params), sum(p.numel() for p in params), device)
        self.step, self.recent = step, recent
        if self.scope == "stale":
            for t in sorted(recent):
                self._start(t, recent[t].to(device))
