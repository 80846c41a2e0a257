"""Pipeline actions and their string / CSV forms.

An action is one unit of work a stage performs: ``F`` forward, ``B`` full backward,
``I`` input-gradient only, ``W`` weight-gradient only, ``U`` local optimizer update.
The string form extends ``torch.distributed.pipelining``'s ``{stage}{F|B|I|W}{mb}``
with ``{stage}U``; micro-batch ids are *global* (they keep increasing across optimizer
steps, DESIGN §1). Stages are 0-based.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from unbubble.errors import ScheduleError


class ActionKind(str, enum.Enum):
    """Kinds of per-stage work (DESIGN §1)."""

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
    """CSV text with one row per rank, one action per cell (torch.distributed.pipelining's layout)."""
    return "".join(",".join(map(str, acts)) + "\n" for acts in order)


def load_csv(text: str) -> list[list[Action]]:
    """Parses :func:`dump_csv` output, or torch.distributed.pipelining's compute-only CSV
    (cells ``{stage}{F|B|I|W}{mb}``; empty cells are ignored).

    Raises:
        ScheduleError: a cell is not an action; the message gives its row and column.
    """
    order = []
    for row_i, line in enumerate(text.splitlines()):
        acts = []
        for col, cell in enumerate(line.split(",")):
            cell = cell.strip()
            if not cell:
                continue
            try:
                acts.append(Action.parse(cell))
            except ScheduleError as exc:
                raise ScheduleError(f"row {row_i}, column {col}: {exc}") from None
        order.append(acts)
    return order


def with_updates(order: list[list[Action]], m: int, steps: int) -> list[list[Action]]:
    """Turns one flushed step without ``U`` (e.g. torch's CSV) into ``steps`` steps: each rank
    applies ``U`` for each of its stages after its step's actions; micro-batch ids shift by m."""
    out = []
    for acts in order:
        stages = sorted({a.stage for a in acts})
        step = [a for a in acts if a.kind is not ActionKind.U] + [Action(s, ActionKind.U) for s in stages]
        out.append([Action(a.stage, a.kind, None if a.mb is None else a.mb + t * m) for t in range(steps) for a in step])
    return out
