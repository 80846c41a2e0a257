"""Per-stage scheduling policies: ``next_action(state) -> Action | None``.

A policy sees only what a real stage can see (:class:`StageState`): which micro-batch
inputs and output-gradients have arrived, its in-flight count, the backward passes
since its last update and its own weight version. The same policy object drives the
simulator, the single-process emulator and the multi-process runtime (DESIGN §3), so
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
    bounded by Δ_i ≤ ⌈(N − i)/a⌉ and the bound is attained in steady state (DESIGN §2).

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


class ListPolicy:
    """Follows a fixed per-stage action list, waiting until each action's inputs arrive.

    Synchronous schedules are lists generated ahead of time; replay mode uses the list
    recorded by another engine, which makes a distributed run follow the emulator's order.
    """

    def __init__(self, actions: list[Action]):
        self.actions = list(actions)

    def next_action(self, state: StageState) -> Action | None:
        if state.n_actions >= len(self.actions):
            return None
        action = self.actions[state.n_actions]
        return action if state.ready(action) else None

    def done(self, state: StageState) -> bool:
        return state.n_actions >= len(self.actions)
