"""Per-stage scheduling policies: ``next_action(state) -> Action | None``.

A policy sees only what a real stage can see (:class:`StageState`): which micro-batch
inputs and output-gradients have arrived, its in-flight count, the backward passes
since its last update and its own weight version. The same policy object drives the
simulator, the single-process emulator and the multi-process runtime (docs/architecture.md#one-policy-three-engines), so
a schedule is defined exactly once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from unbubble.schedules.actions import Action, ActionKind


@dataclass
class StageState:
    """What one stage knows locally.

    Attributes:
        stage: 0-based stage index.
        n_stages: pipeline depth N.
        total_mb: micro-batches the run processes (ids ``0 … total_mb-1``).
        fwd_ready: ids whose input activation has arrived and not yet been forwarded.
            The first stage reads tokens itself, so every id ``< total_mb`` counts as arrived.
        bwd_ready: ids whose output gradient has arrived (on the last stage: whose forward,
            which computes the loss, is done).
        in_flight: forwards not yet matched by a backward (q_i in PACI).
        bwd_since_update: backward passes accumulated since the last ``U``.
        version: weight version v = number of ``U`` applied.
        n_actions: actions executed so far (the position in a static action list).
    """

    stage: int
    n_stages: int
    total_mb: int
    fwd_ready: set[int] = field(default_factory=set)
    bwd_ready: set[int] = field(default_factory=set)
    in_flight: int = 0
    bwd_since_update: int = 0
    version: int = 0
    n_fwd: int = 0
    n_bwd: int = 0
    n_actions: int = 0

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.n_stages - 1

    def input_ready(self, mb: int) -> bool:
        """True if the forward of ``mb`` can start (its input is here)."""
        return mb < self.total_mb if self.is_first else mb in self.fwd_ready

    def grad_ready(self, mb: int) -> bool:
        return mb in self.bwd_ready

    def ready(self, action: Action) -> bool:
        """True if ``action``'s inputs are present on this stage."""
        if action.kind is ActionKind.F:
            return self.input_ready(action.mb)
        if action.kind in (ActionKind.B, ActionKind.I):
            return self.grad_ready(action.mb)
        return True

    def apply(self, action: Action) -> None:
        """Updates the local state after ``action`` has run."""
        kind = action.kind
        if kind is ActionKind.F:
            self.fwd_ready.discard(action.mb)
            self.in_flight += 1
            self.n_fwd += 1
            if self.is_last:
                self.bwd_ready.add(action.mb)
        elif kind in (ActionKind.B, ActionKind.I):
            self.bwd_ready.discard(action.mb)
            self.in_flight -= 1
            self.n_bwd += 1
            self.bwd_since_update += 1
        elif kind is ActionKind.U:
            self.version += 1
            self.bwd_since_update = 0
        self.n_actions += 1


class RankView:
    """The local state of a rank that hosts several (virtual) stages, e.g. interleaved 1F1B.

    A rank runs one action at a time; each of its stages keeps its own :class:`StageState`.
    """

    def __init__(self, states: list[StageState]):
        self.states = {st.stage: st for st in states}
        self.n_actions = 0

    def ready(self, action: Action) -> bool:
        return self.states[action.stage].ready(action)

    def apply(self, action: Action) -> None:
        self.states[action.stage].apply(action)
        self.n_actions += 1


class Policy(Protocol):
    """Decides a stage's next action from its local state."""

    def next_action(self, state: StageState) -> Action | None:
        """The action to run now, or ``None`` to wait for a message."""

    def done(self, state: StageState) -> bool:
        """True once the stage has nothing left to do."""


class PaciPolicy:
    """PACI(a): asynchronous 1F1B, never flushed, update after every a-th backward.

    Rules for stage i (1-based, i = stage + 1), checked in this order:
      1. ``U`` once a backward passes have accumulated (no barrier with other stages);
      2. ``B`` of the oldest micro-batch whose output gradient has arrived (B has priority);
      3. ``F`` of the next micro-batch if its input is here and the in-flight count
         q_i < N + 1 − i (local back-pressure).

    With a = 1 this is naive asynchronous 1F1B. The weight-version drift of stage i is
    bounded by Δ_i ≤ ⌈(N − i)/a⌉ and the bound is attained in steady state
    (docs/architecture.md#schedules-and-their-semantics).

    Source: PACI, arXiv 2606.07881, §3 (accumulation as version control, local flow control).
    """

    def __init__(self, stage: int, n_stages: int, a: int):
        self.stage, self.n_stages, self.a = stage, n_stages, a
        self.cap = n_stages - stage  # N + 1 - i with i = stage + 1
        self._next_fwd = 0

    def next_action(self, state: StageState) -> Action | None:
        if state.bwd_since_update >= self.a:
            return Action(self.stage, ActionKind.U)
        if state.bwd_ready:
            return Action(self.stage, ActionKind.B, min(state.bwd_ready))
        k = state.n_fwd
        if k < state.total_mb and state.in_flight < self.cap and state.input_ready(k):
            return Action(self.stage, ActionKind.F, k)
        return None

    def done(self, state: StageState) -> bool:
        return state.n_bwd == state.total_mb and state.bwd_since_update == 0


class OrderedPaciPolicy(PaciPolicy):
    """PACI(a) in a fixed per-stage order: the same actions, the same admission, update and
    drift rules as :class:`PaciPolicy`, in an order that does not depend on arrival times.

    [Note: deterministic order]
    Stage i (1-based, i = stage + 1) runs the 1F1B sequence of the never-flushed pipeline:
      1. ``U`` once a backward passes have accumulated;
      2. ``F`` of the next micro-batch while the in-flight count q_i < N + 1 − i (back-pressure:
         N + 1 − i warm-up forwards, then one forward after each backward), waiting for its input;
      3. otherwise ``B`` of the oldest micro-batch in flight, waiting for its gradient.
    Each choice is a function of the stage's own counts (forwards, backwards, version), never of
    which message came first, so every run of the same job executes the same actions on the
    same weight versions in the same order, on any engine and however fast each stage is: the
    losses are reproducible run to run (checkpoint drains included; only a stop signal lands
    where its timing puts it). With unit costs (F = 1, B = 2, no latency; the emulator's
    default) :class:`PaciPolicy` produces exactly this order, for every asynchronous schedule
    (``tests/unit/test_schedules.py``), so the process engine equals the emulator bit for bit. The drift bound holds as for :class:`PaciPolicy`: a forward
    starts only while q_i < N + 1 − i and backwards run oldest first, so at most N − i backwards,
    hence at most ⌈(N − i)/a⌉ updates, fall between a micro-batch's F and its B.

    The price: a stage waits for the message its order names even when another one is already
    there (a gradient that came before the activation it waits for). With balanced stages the
    order is the one the arrivals give anyway; ``benchmarks/bench_runtime.py`` measures the
    cost against :class:`PaciPolicy` on real processes.
    """

    def next_action(self, state: StageState, forward: bool = True) -> Action | None:
        """The next action of the order, or ``None`` while its input has not arrived.

        Args:
            state: this stage's local state.
            forward: ``False`` when the next forward may not start (a checkpoint drain or a stop,
                :class:`CutPolicy`): the stage runs its backwards meanwhile.
        """
        if state.bwd_since_update >= self.a:
            return Action(self.stage, ActionKind.U)
        k = state.n_fwd
        if forward and k < state.total_mb and state.in_flight < self.cap:
            return Action(self.stage, ActionKind.F, k) if state.input_ready(k) else None
        if state.in_flight > 0:
            k = state.n_bwd  # backwards run in forward order: the oldest in flight
            return Action(self.stage, ActionKind.B, k) if state.grad_ready(k) else None
        return None


#: Orders of asynchronous schedules ([Note: deterministic order]): ``deterministic`` follows a
#: fixed per-stage order (:class:`OrderedPaciPolicy`, reproducible); ``dynamic`` decides by
#: arrival (:class:`PaciPolicy`: a backward whose gradient is here goes first; on real processes
#: the order, and so the losses, vary run to run).
ORDERS = ("deterministic", "dynamic")


def check_order(order: str) -> None:
    """Raises ConfigError unless ``order`` is one of :data:`ORDERS` (with a did-you-mean)."""
    from unbubble.errors import ConfigError, did_you_mean

    if order not in ORDERS:
        raise ConfigError(f"order={order!r} is invalid{did_you_mean(order, ORDERS)}: must be one of "
                          f"{', '.join(ORDERS)} (set --order)")


class ListPolicy:
    """Follows a fixed per-stage action list, waiting until each action's inputs arrive.

    Synchronous schedules are lists generated ahead of time; replay mode uses the list
    recorded by another engine, which makes a distributed run follow the emulator's order.
    """

    def __init__(self, actions: list[Action], overlaps: frozenset[int] = frozenset()):
        self.actions = list(actions)
        #: positions of the first parts of compound actions (:func:`~unbubble.schedules.actions.flatten`)
        self.overlaps = overlaps

    def next_action(self, state: StageState) -> Action | None:
        if state.n_actions >= len(self.actions):
            return None
        action = self.actions[state.n_actions]
        return action if state.ready(action) else None

    def done(self, state: StageState) -> bool:
        return state.n_actions >= len(self.actions)


@dataclass
class Cuts:
    """Where a run drains for a checkpoint, and where it stops
    ([Note: the checkpoint cut] in ``runtime/checkpoint.py``).

    A *cut* after update V is a point where no micro-batch is in flight on any stage: every
    micro-batch ``< V·mb_per_step`` is done and none after it has started. Flushed schedules
    reach one after every update; asynchronous ones only where :class:`CutPolicy` drains.

    Attributes:
        mb_per_step: micro-batches per update.
        every: K: a cut after every K-th update (0: none but the end and the stop).
        extra: further cut steps (a stop placed by an earlier run, replayed on resume).
        stop_step: T once a stop has been placed: the run ends at the cut after update T.
        stop_requested: a stop was asked for (SIGINT/SIGTERM) and not yet placed.
        decide: whether this process places the stop itself when it hosts stage 0 (``False``
            with data-parallel replicas, which agree on T collectively).
    """

    mb_per_step: int
    every: int = 0
    extra: tuple[int, ...] = ()
    stop_step: int | None = None
    stop_requested: bool = False
    decide: bool = True

    def is_cut(self, step: int) -> bool:
        """True if the pipeline is drained after update ``step`` (≥ 1)."""
        return step == self.stop_step or step in self.extra or (self.every > 0 and step % self.every == 0)

    def place_stop(self, n_fwd: int) -> int:
        """Places the stop at the first step boundary stage 0 has not passed: T = ⌈n_fwd / mb_per_step⌉
        (every micro-batch already forwarded finishes; none is dropped)."""
        if self.stop_step is None:
            self.stop_step = -(-n_fwd // self.mb_per_step)
        return self.stop_step


class CutPolicy:
    """Wraps a rank's policy with checkpoint cuts and a stop (:class:`Cuts`).

    * Drain: no stage forwards the first micro-batch after a cut step V
      (``k = V·mb_per_step``) until its own update V is applied (stage 0 is the one that waits:
      the others get that micro-batch only after stage 0's update V). Everything before the cut
      then finishes on every stage before anything after it starts (backward passes reach
      stage 0 last), and each stage is idle at its update V. Flushed schedules already order
      their lists this way, so for them this never waits.
    * Stop: once ``cuts.stop_step = T``, no forward of ``k ≥ T·mb_per_step`` starts and the rank
      is done when each of its stages has applied update T.

    Args:
        inner: the schedule's policy for this rank.
        cuts: shared by every policy of one process (one object in the emulator).
    """

    def __init__(self, inner, cuts: Cuts):
        self.inner, self.cuts = inner, cuts
        self.overlaps = getattr(inner, "overlaps", frozenset())  # for the simulator's compound actions

    @staticmethod
    def _states(view) -> list[StageState]:
        return list(view.states.values()) if isinstance(view, RankView) else [view]

    def next_action(self, view) -> Action | None:
        cuts = self.cuts
        states = self._states(view)
        first = next((st for st in states if st.stage == 0), None)
        if first is not None and cuts.stop_requested and cuts.decide and cuts.stop_step is None:
            cuts.place_stop(first.n_fwd)
        if isinstance(self.inner, OrderedPaciPolicy):  # a fixed order: its backwards go on meanwhile
            return self.inner.next_action(view, forward=not self._refused(view, view.n_fwd))
        action = self.inner.next_action(view)
        if action is None or action.kind is not ActionKind.F:
            return action
        own = next(st for st in states if st.stage == action.stage)
        return None if self._refused(own, action.mb) else action

    def _refused(self, state: StageState, mb: int) -> bool:
        """True if the forward of ``mb`` on ``state``'s stage may not start now: it is at or
        after the stop, or it is the first micro-batch after a cut step V and the stage has not
        applied its own update V (the drain; stages > 0 reach it before their input comes anyway)."""
        cuts = self.cuts
        m = cuts.mb_per_step
        if cuts.stop_step is not None and mb >= cuts.stop_step * m:
            return True
        return mb > 0 and mb % m == 0 and cuts.is_cut(mb // m) and state.version < mb // m

    def done(self, view) -> bool:
        t = self.cuts.stop_step
        if t is not None and all(st.version >= t for st in self._states(view)):
            return True
        return self.inner.done(view)


def resume_state(state: StageState, step: int, mb_per_step: int) -> None:
    """Moves a fresh :class:`StageState` to the cut after update ``step``: every micro-batch
    ``< step·mb_per_step`` forwarded and backwarded, version ``step``, nothing in flight."""
    state.n_fwd = state.n_bwd = step * mb_per_step
    state.version = step


def resume_position(actions: list[Action], stages: list[int], step: int) -> int:
    """Index in a rank's action list right after the last of its stages' ``step``-th ``U``
    (where a run resumed at the cut after update ``step`` continues; 0 if ``step`` is 0).

    Raises:
        ValueError: the list has fewer than ``step`` updates for one of ``stages``.
    """
    if step == 0:
        return 0
    seen = dict.fromkeys(stages, 0)
    for i, a in enumerate(actions):
        if a.kind is ActionKind.U:
            seen[a.stage] += 1
            if all(c >= step for c in seen.values()):
                return i + 1
    raise ValueError(f"the action list has fewer than {step} updates for stages {stages}")
