"""Pipeline actions and their string / CSV forms.

An action is one unit of work a stage performs: ``F`` forward, ``B`` full backward,
``I`` input-gradient only, ``W`` weight-gradient only, ``U`` local optimizer update.
The string form extends ``torch.distributed.pipelining``'s ``{stage}{F|B|I|W}{mb}``
with ``{stage}U``; micro-batch ids are *global* (they keep increasing across optimizer
steps, docs/architecture.md#terms). Stages are 0-based.

CSV: :func:`dump_csv`/:func:`load_csv` are unbubble's full format (one row per rank, ``U``
included); :func:`load_csv` also reads torch.distributed.pipelining's files (torch 2.13) and
:func:`export_torch_csv` writes one step in the form torch's ``_load_csv`` accepts.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from unbubble.errors import ScheduleError


class ActionKind(str, enum.Enum):
    """Kinds of per-stage work (docs/architecture.md#terms)."""

    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # input-gradient only  # noqa: E741 - the field's name
    W = "W"  # weight-gradient only
    U = "U"  # optimizer update (local to one stage)


_ACTION_RE = re.compile(r"^(\d+)([FBIWU])(\d*)$")


@dataclass(frozen=True, slots=True)
class Action:
    """One action of one stage.

    Attributes:
        stage: 0-based stage index.
        kind: what the stage does.
        mb: global micro-batch id ``k`` (``None`` for ``U``).
    """

    stage: int
    kind: ActionKind
    mb: int | None = None

    def __post_init__(self) -> None:
        if (self.kind is ActionKind.U) != (self.mb is None):
            raise ScheduleError(
                f"action {self.stage}{self.kind.value}{self.mb} is invalid: U takes no micro-batch id "
                "and F/B/I/W need one"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{'' if self.mb is None else self.mb}"

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parses ``"2F17"`` or ``"3U"``.

        Raises:
            ScheduleError: the text is not of the form ``{stage}{F|B|I|W}{mb}`` or ``{stage}U``.
        """
        m = _ACTION_RE.match(text.strip())
        if m is None:
            raise ScheduleError(
                f"action={text!r} is invalid: expected '{{stage}}{{F|B|I|W}}{{mb}}' or '{{stage}}U', e.g. '2F17', '3U'"
            )
        stage, kind, mb = int(m.group(1)), ActionKind(m.group(2)), m.group(3)
        return cls(stage, kind, int(mb) if mb else None)


@dataclass(frozen=True, slots=True)
class Overlap:
    """A compound action: two compute actions of one rank run as one, overlapped (DualPipeV's
    forward of one chunk with the backward of the other, torch's ``OVERLAP_F_B``).

    The engines run the parts one after the other, in order (as torch's runtime does without a
    custom overlap function); the simulator gives the pair the duration
    d₁ + d₂ − φ·min(d₁, d₂), φ the cost model's ``overlap`` factor (0: sequential, the CPU case;
    1: the shorter part hidden entirely under the longer).

    Attributes:
        first: the part that runs first (a forward in DualPipeV).
        second: the part that runs second (a backward).
    """

    first: Action
    second: Action

    def __str__(self) -> str:
        return f"({self.first};{self.second})OVERLAP_F_B"

    @property
    def parts(self) -> tuple[Action, Action]:
        return self.first, self.second


def flatten(acts: list) -> tuple[list[Action], frozenset[int]]:
    """A rank's list with :class:`Overlap` items as ``(plain actions, positions of each compound's
    first part)``: what the engines run and where the simulator applies the overlap."""
    out: list[Action] = []
    firsts = []
    for a in acts:
        if isinstance(a, Overlap):
            firsts.append(len(out))
            out += a.parts
        else:
            out.append(a)
    return out, frozenset(firsts)


def F(stage: int, mb: int) -> Action:
    return Action(stage, ActionKind.F, mb)


def B(stage: int, mb: int) -> Action:
    return Action(stage, ActionKind.B, mb)


def U(stage: int) -> Action:
    return Action(stage, ActionKind.U)


def format_order(order: list[list[Action]]) -> str:
    """One line per stage, actions separated by spaces (for logs and errors)."""
    return "\n".join(f"stage {s}: " + " ".join(map(str, acts)) for s, acts in enumerate(order))


def dump_csv(order: list[list[Action]]) -> str:
    """unbubble's full CSV: one row per rank, one action per cell, ``U`` included, global
    micro-batch ids (every step); an :class:`Overlap` is one ``(a;b)OVERLAP_F_B`` cell, as torch
    writes it. :func:`load_csv` reads it back; torch's loader does not (it has no ``U``): use
    :func:`export_torch_csv` for torch."""
    return "".join(",".join(map(str, acts)) + "\n" for acts in order)


# Cell types of torch.distributed.pipelining's CSVs beyond F/B/I/W (torch 2.13). SEND_*/RECV_* are
# implied by our F/B (the runtime sends every forward's output and every backward's input
# gradient); UNSHARD/RESHARD are FSDP's all-gather/free, and unbubble does not shard stages.
_TORCH_NO_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD")
_CELL_RE = re.compile(r"^(\d+)(F|B|I|W|U|REDUCE_GRAD|UNSHARD|RESHARD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)OVERLAP_F_B$")
_CELL_FORMS = ("'{stage}{F|B|I|W}{mb}', '{stage}U', torch's '{stage}REDUCE_GRAD', '{stage}UNSHARD', "
               "'{stage}RESHARD', '{stage}SEND_F{mb}' (SEND_B, RECV_F, RECV_B) or '(2F3;1B0)OVERLAP_F_B'")


def parse_cell(cell: str) -> list[Action]:
    """The unbubble actions one CSV cell stands for (0, 1 or several).

    ``{stage}{F|B|I|W}{mb}`` and ``{stage}U`` are one action. torch's ``{stage}REDUCE_GRAD`` is
    that stage's ``U``: torch puts it right after a stage's m-th backward (B or W) of the step
    and steps the optimizer after ``schedule.step()``; the stage has no work left in the step
    by then, so updating at that point computes the same thing. ``(a;b)OVERLAP_F_B`` (DualPipeV)
    is its sub-actions in order. ``SEND_*``/``RECV_*`` and ``UNSHARD``/``RESHARD`` give none
    (see ``_TORCH_NO_OPS``). An empty cell gives none.

    Raises:
        ScheduleError: the cell is none of these forms, or has a micro-batch id where it takes
            none (or lacks one where it needs one).
    """
    cell = cell.strip()
    if not cell:
        return []
    if (overlap := _OVERLAP_RE.match(cell)) is not None:
        subs = [a for part in overlap.group(1).split(";") for a in parse_cell(part)]
        if not subs or any(a.kind is ActionKind.U for a in subs):
            raise ScheduleError(f"cell {cell!r} is invalid: OVERLAP_F_B holds compute actions "
                                "'{stage}{F|B|I|W}{mb}' separated by ';', e.g. '(2F3;1B0)OVERLAP_F_B'")
        return subs
    m = _CELL_RE.match(cell)
    if m is None:
        raise ScheduleError(f"cell {cell!r} is not an action: expected {_CELL_FORMS}")
    stage, kind, mb = int(m.group(1)), m.group(2), m.group(3)
    takes_mb = kind in ("F", "B", "I", "W") or kind.startswith(("SEND", "RECV"))
    if takes_mb != bool(mb):
        raise ScheduleError(f"cell {cell!r} is invalid: {kind} {'needs' if takes_mb else 'takes no'} micro-batch id "
                            f"(expected {_CELL_FORMS})")
    if kind in _TORCH_NO_OPS:
        return []
    if kind == "REDUCE_GRAD":
        return [Action(stage, ActionKind.U)]
    return [Action(stage, ActionKind(kind), int(mb) if mb else None)]


def _cell_stages(cell: str) -> list[int]:
    """Stage indices a cell names, no-ops included (they say where a stage lives too)."""
    return [int(s) for s in re.findall(r"(?:^|[(;])\s*(\d+)", cell.strip())]


def load_csv(text: str) -> list[list[Action]]:
    """Parses an action CSV: one row per rank, one cell per action (cell forms: :func:`parse_cell`).

    Reads :func:`dump_csv` output and torch.distributed.pipelining's files (``_dump_csv`` of its
    schedules, torch 2.13), compute-only and with comms (``format="compute_comms"``): comms and
    FSDP cells are dropped, ``REDUCE_GRAD`` becomes ``U`` where torch put it, ``OVERLAP_F_B``
    its two actions; empty cells (torch's idle steps) and trailing blank lines are ignored. A
    torch file holds one step without an optimizer step of its own: :func:`with_updates`
    repeats it for several steps.

    The placement is read from the rows: stage s on rank s mod N (N rows), or a V (rank r holds
    stages r and 2N − 1 − r: torch's ScheduleZBVZeroBubble and ScheduleDualPipeV).

    Raises:
        ScheduleError: a cell is not an action (the message gives its row and column); or the rows
            place their stages neither way (the message names the rank and the stage).
    """
    rows = text.splitlines()
    while rows and not rows[-1].strip():  # a trailing blank line is not an empty rank
        rows.pop()
    n = len(rows)
    order, where = [], []
    for row_i, line in enumerate(rows):
        acts = []
        for col, cell in enumerate(line.split(",")):
            try:
                acts += parse_cell(cell)
            except ScheduleError as exc:
                raise ScheduleError(f"row {row_i}, column {col}: {exc}") from None
            where += [(s, row_i, col) for s in _cell_stages(cell)]
        order.append(acts)
    stages = 1 + max((s for s, _, _ in where), default=-1)
    v_shaped = stages == 2 * n > 2 and all(r == min(s, 2 * n - 1 - s) for s, r, _ in where)
    for s, r, col in where:
        want = min(s, 2 * n - 1 - s) if v_shaped else s % n
        if r != want:
            layout = "a V (stages r and 2N−1−r on rank r)" if v_shaped else "rank s mod N"
            raise ScheduleError(
                f"row {r}, column {col}: rank {r} runs stage {s}, but the file places its stages on {layout}, which "
                f"puts stage {s} on rank {want} for N={n} ranks: unbubble runs stages s mod N or in a V")
    return order


def with_updates(order: list[list[Action]], m: int, steps: int) -> list[list[Action]]:
    """Turns one flushed step (micro-batches 0…m−1, e.g. torch's CSV) into ``steps`` steps;
    micro-batch ids shift by m per step. Each stage updates once per step: where the step
    already has its ``U`` (torch's ``REDUCE_GRAD``, after the stage's last backward) it stays
    there, otherwise ``U`` follows the rank's step actions.

    Raises:
        ScheduleError: a micro-batch id is outside 0…m−1.
    """
    out = []
    for r, acts in enumerate(order):
        for a in acts:
            if a.mb is not None and not 0 <= a.mb < m:
                raise ScheduleError(f"{a} (rank {r}) is outside the step: with m={m} a step's micro-batches "
                                    f"are 0…{m - 1}")
        has_u = {a.stage for a in acts if a.kind is ActionKind.U}
        step = list(acts) + [Action(s, ActionKind.U) for s in sorted({a.stage for a in acts} - has_u)]
        out.append([Action(a.stage, a.kind, None if a.mb is None else a.mb + t * m)
                    for t in range(steps) for a in step])
    return out


def export_torch_csv(order: list[list]) -> str:
    """CSV text that torch.distributed.pipelining's ``_load_csv`` accepts (its compute-only
    format, torch 2.13): one row per rank, cells ``{stage}{F|B|I|W}{mb}`` of one step with
    micro-batches 0…m−1, every stage s on rank s mod N (or in a V); an :class:`Overlap` (a
    schedule's :meth:`~unbubble.schedules.registry.Schedule.compound_order`: DualPipeV) is one
    ``({F};{B})OVERLAP_F_B`` cell, torch's compound action.

    Where the updates go: torch's format has no optimizer step; its lowering adds a
    ``REDUCE_GRAD`` after each stage's m-th backward and the caller steps the optimizer after
    ``schedule.step()``. That is what a flushed order's ``U`` means, so ``U`` is omitted. The
    file cannot say so: torch's reader takes every line as a rank, so a comment line breaks it.
    An order of several steps is written as its first step, after checking that every step
    repeats it. An order without any ``U`` is written as it is (one step).

    Raises:
        ScheduleError: the order cannot be one torch step repeated: a stage updates while a
            micro-batch is in flight (asynchronous: PACI, PipeDream, …; :func:`dump_csv` writes
            unbubble's full format), stages update different numbers of times, a step is not the
            first one shifted by m, or a stage has actions after its last ``U``.
    """
    flat = [flatten(acts)[0] for acts in order]  # the checks see the compound actions' parts in order
    cells = [[a for a in acts if isinstance(a, Overlap) or a.kind is not ActionKind.U] for acts in order]
    if any(a.kind is ActionKind.U for acts in flat for a in acts):
        m = _check_flushed(flat)
        for r, acts in enumerate(flat):
            acts = [a for a in acts if a.kind is not ActionKind.U]
            first = [a for a in acts if a.mb < m]
            repeated = [Action(a.stage, a.kind, a.mb + t * m) for t in range(len(acts) // max(len(first), 1))
                        for a in first]
            for pos, (got, want) in enumerate(zip(acts + [None], repeated + [None])):
                if got != want:
                    raise ScheduleError(
                        f"rank {r}, action {pos} (U not counted) is {got or 'missing'} where step 0 repeated gives "
                        f"{want or 'nothing'}: torch's CSV is one step of m={m} micro-batches that every "
                        "optimizer step repeats")
        # a flushed step holds both parts of each of its compound actions
        cells = [[c for c in acts if all(a.mb < m for a in (c.parts if isinstance(c, Overlap) else (c,)))]
                 for acts in cells]
    return "".join(",".join(map(str, acts)) + "\n" for acts in cells)


def _check_flushed(order: list[list[Action]]) -> int:
    """m, if each stage's actions between its updates are whole micro-batches m·t … m·t+m−1
    (every forward's backward before the next ``U``), for the same number of steps on every stage."""
    segments: dict[int, list[list[Action]]] = {}
    for r, acts in enumerate(order):
        for a in acts:
            segs = segments.setdefault(a.stage, [[]])
            if a.kind is ActionKind.U:
                fwd = {x.mb for x in segs[-1] if x.kind is ActionKind.F}
                done = {x.mb for x in segs[-1] if x.kind in (ActionKind.B, ActionKind.W)}
                if fwd != done:
                    k = min(fwd ^ done)
                    where = "in flight (its forward ran, its backward comes after the update)" if k in fwd else \
                        "finished on the weights of an earlier step (its forward ran before the previous update)"
                    raise ScheduleError(
                        f"stage {a.stage} (rank {r}) applies U number {len(segs)} while micro-batch {k} is {where}: "
                        "the order is asynchronous and torch's CSV steps the optimizer only between schedule steps "
                        "(dump_csv writes unbubble's full format)")
                segs.append([])
            else:
                segs[-1].append(a)
    steps = {s: len(segs) - 1 for s, segs in segments.items()}
    if len(set(steps.values())) > 1:
        raise ScheduleError("stages apply U different numbers of times (" +
                            ", ".join(f"stage {s}: {k}" for s, k in sorted(steps.items())) +
                            "): torch's CSV updates every stage once per step")
    for s, segs in sorted(segments.items()):
        if segs[-1]:
            raise ScheduleError(f"stage {s} runs {segs[-1][0]} after its last U: torch's CSV ends every step "
                                "with an update of every stage (add the U, or drop the partial step)")
    m = len({a.mb for a in segments[min(segments)][0] if a.kind is ActionKind.F})
    for s, segs in sorted(segments.items()):
        for t, seg in enumerate(segs[:-1]):
            mbs = {a.mb for a in seg if a.kind is ActionKind.F}
            if mbs != set(range(t * m, t * m + m)):
                raise ScheduleError(
                    f"stage {s}'s step {t} runs micro-batches {sorted(mbs)}, expected {t * m}…{t * m + m - 1}: "
                    f"torch's CSV repeats one step of m={m} micro-batches")
    return m
