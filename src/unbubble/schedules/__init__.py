"""Schedules as data and per-stage policies (pure Python: importing this never imports torch)."""

from unbubble.schedules.actions import (Action, ActionKind, dump_csv, export_torch_csv, format_order, load_csv,
                                       with_updates)
from unbubble.schedules.policy import ORDERS, ListPolicy, OrderedPaciPolicy, PaciPolicy, Policy, StageState
from unbubble.schedules.registry import REGISTRY, SCHEDULES, Schedule, ScheduleInfo, get_schedule, schedule_info
from unbubble.schedules.static import one_f_one_b_flush

__all__ = [
    "Action", "ActionKind", "dump_csv", "export_torch_csv", "format_order", "load_csv", "with_updates",
    "ListPolicy", "ORDERS", "OrderedPaciPolicy", "PaciPolicy", "Policy", "StageState",
    "REGISTRY", "SCHEDULES", "Schedule", "ScheduleInfo", "get_schedule", "one_f_one_b_flush", "schedule_info",
]
