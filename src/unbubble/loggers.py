"""Experiment loggers fed by the run writer: TensorBoard event files (default) and Weights & Biases (offline).

:class:`~unbubble.metrics.RunWriter` forwards every step, evaluation and the finished run here, so the
loggers see what metrics.jsonl records. What is logged:
docs/architecture.md#loggerspy.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np

from unbubble.analysis import drift_values, step_utilization
from unbubble.config import TrainConfig
from unbubble.errors import ConfigError


def check_loggers(cfg: TrainConfig) -> None:
    """Fails early when a requested logger's package is missing.

    Raises:
        ConfigError: ``wandb=True`` without the ``wandb`` package, or ``tensorboard=True``
            without ``tensorboard``; one line saying what to install or which flag to drop.
    """
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("wandb=True needs the wandb package, which is not installed: pip install wandb "
                          "(or pip install 'unbubble[wandb]'), or drop --wandb")
    if cfg.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("tensorboard=True needs the tensorboard package, which is not installed: "
                          "pip install tensorboard, or give --no-tensorboard")


def open_loggers(run_dir: Path, cfg: TrainConfig) -> list["Logger"]:
    """The loggers ``cfg`` asks for, writing into ``run_dir`` (see :func:`check_loggers` for errors)."""
    check_loggers(cfg)
    loggers: list[Logger] = []
    if cfg.tensorboard:
        loggers.append(TensorBoardLogger(run_dir, cfg))
    if cfg.wandb:
        loggers.append(WandbLogger(run_dir, cfg))
    return loggers


def perplexity(loss: float) -> float:
    """exp(loss), capped at e^50 so a diverged run (loss in the thousands, or inf) still reports."""
    return math.exp(min(loss, 50.0))


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    keys = ("schedule", "stages", "mb_per_step", "steps", "engine", "optimizer", "tokens", "train_wall_s",
            "tokens_per_s", "utilization", "simulated_utilization", "max_drift", "drift_bound", "final_train_loss",
            "final_val_loss", "final_val_ppl")
    rows = []
    for k in keys:
        v = summary.get(k)
        if v is None:
            continue
        if isinstance(v, float):
            v = f"{v:.4g}"
        elif isinstance(v, list):
            v = ", ".join(f"{x:.3f}" if isinstance(x, float) else str(x) for x in v)
        rows.append((k, str(v)))
    return rows


class Logger:
    """Interface of a logger: live steps and evaluations, then the finished run."""

    def step(self, step: int, loss: float, info: dict[str, Any]) -> None: ...

    def eval(self, version: int, val_loss: float) -> None: ...

    def router(self, version: int, stats: dict[str, Any]) -> None: ...

    def finish(self, result, summary: dict[str, Any]) -> None: ...

    def close(self) -> None:
        """Closes the logger's files without a summary (a run that ended before its first step)."""


class TensorBoardLogger(Logger):
    """Event files in the run folder, written with ``torch.utils.tensorboard.SummaryWriter``."""

    def __init__(self, run_dir: Path, cfg: TrainConfig):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir), flush_secs=10)
        self.cfg = cfg
        table = "| option | value |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in cfg.to_dict().items())
        self.writer.add_text("config", table, 0)

    def step(self, step: int, loss: float, info: dict[str, Any]) -> None:
        w = self.writer
        w.add_scalar("train/loss", loss, step)
        w.add_scalar("train/perplexity", perplexity(loss), step)
        if "tok_per_s" in info:
            w.add_scalar("train/tokens_per_s", info["tok_per_s"], step)
        if "max_drift" in info:
            w.add_scalar("train/max_drift", info["max_drift"], step)

    def eval(self, version: int, val_loss: float) -> None:
        self.writer.add_scalar("val/loss", val_loss, version)
        self.writer.add_scalar("val/perplexity", perplexity(val_loss), version)

    def router(self, version: int, stats: dict[str, Any]) -> None:
        for name, value in _router_scalars(stats).items():
            self.writer.add_scalar(name, value, version)

    def finish(self, result, summary: dict[str, Any]) -> None:
        w = self.writer
        from unbubble.schedules.registry import get_schedule
        from unbubble.sim.measured import simulated_on_measured

        cfg = self.cfg
        simulated = None if result.sim_trace is None else simulated_on_measured(
            get_schedule(cfg.schedule, cfg.stages, cfg.steps, a=cfg.a, m=cfg.m, v=cfg.v), result.trace)
        for prefix, trace in (("utilization", result.trace), ("simulated_utilization", simulated)):
            if trace is None:
                continue
            steps, util = step_utilization(trace)
            for r in range(util.shape[0]):
                for t, u in zip(steps, util[r]):
                    w.add_scalar(f"{prefix}/rank_{r}", float(u), t)
        last = summary.get("steps") or 0
        for s, values in enumerate(drift_values(result.trace)):
            if values:
                w.add_histogram(f"drift/stage_{s}", np.asarray(values), last, bins=np.arange(-0.5, max(values) + 1.5))
        table = "| | |\n|---|---|\n" + "\n".join(f"| {k} | {v} |" for k, v in _summary_rows(summary))
        w.add_text("summary", table, last)
        w.close()

    def close(self) -> None:
        self.writer.close()


class WandbLogger(Logger):
    """A Weights & Biases run in offline mode under ``RUN/wandb/`` (nothing leaves the machine)."""

    def __init__(self, run_dir: Path, cfg: TrainConfig):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(mode="offline", dir=str(run_dir), project="unbubble", name=run_dir.name,
                              config=cfg.to_dict())
        self.run.define_metric("train/step")
        self.run.define_metric("train/*", step_metric="train/step")
        self.run.define_metric("val/version")
        self.run.define_metric("val/*", step_metric="val/version")

    def step(self, step: int, loss: float, info: dict[str, Any]) -> None:
        rec = {"train/step": step, "train/loss": loss, "train/perplexity": perplexity(loss)}
        if "tok_per_s" in info:
            rec["train/tokens_per_s"] = info["tok_per_s"]
        if "max_drift" in info:
            rec["train/max_drift"] = info["max_drift"]
        self.run.log(rec)

    def eval(self, version: int, val_loss: float) -> None:
        self.run.log({"val/version": version, "val/loss": val_loss, "val/perplexity": perplexity(val_loss)})

    def router(self, version: int, stats: dict[str, Any]) -> None:
        self.run.log({"val/version": version, **_router_scalars(stats)})

    def finish(self, result, summary: dict[str, Any]) -> None:
        rec: dict[str, Any] = {}
        for s, values in enumerate(drift_values(result.trace)):
            if values:
                counts, edges = np.histogram(values, bins=np.arange(-0.5, max(values) + 1.5))
                rec[f"drift/stage_{s}"] = self.wandb.Histogram(np_histogram=(counts, edges))
        if rec:
            self.run.log(rec)
        self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str, list))})
        self.run.finish()

    def close(self) -> None:
        self.run.finish()


def _router_scalars(stats: dict[str, Any]) -> dict[str, float]:
    """Scalar names and values of one ``router_stats`` result."""
    out = {"router/max_load": stats["max_load"], "router/dropped_frac": stats["mean_dropped_frac"]}
    for j, shares in stats["load"].items():
        for e, share in enumerate(shares):
            out[f"router/block_{j}/expert_{e}"] = share
    return out
