"""The run folder: config, per-step metrics (JSONL), per-action telemetry, summary, plots.

[Note: a diverged run fails]
A run diverged when a step's training loss (the mean of the micro-batches the non-finite guard
kept, so non-finite only when the guard is off or kept nothing finite), a validation loss (the
guard never sees an evaluation) or a weight of its final state is not finite. ``unbubble train``
stops at the first of these with one line naming the step, what was non-finite and how many
micro-batches the guard had dropped (``nan_policy``), exits 1 and prints no end lines (no
break-even: a diverged run's throughput says nothing); summary.json says ``"status": "diverged"``.
The guard's own abort (every micro-batch of ``MAX_DROPPED_UPDATES`` updates dropped, or
``nan_policy="abort"``) ends the same way. Sweeps that tune the learning rate call
``train(on_divergence="record")``: the run goes on as before, and its summary still says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

from unbubble.config import TrainConfig, config_to_yaml
from unbubble.errors import ConfigError, Diverged, NonFiniteError, SecondSignal
from unbubble.loggers import open_loggers, perplexity
from unbubble.models.moe import router_stats
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.telemetry import RunResult
from unbubble.safety import atomic_write_text, os_cause

log = logging.getLogger(__name__)

#: The synchronous phase's run folder inside a switched run's (``--switch-after``).
SYNC_PHASE_DIR = "synchronous"


def describe_blocks(ranges: list[range]) -> str:
    """Which transformer blocks each stage holds, inclusive and 0-based:
    ``"stage 0: blocks 0–3, stage 1: blocks 4–7"`` ("block 4" for one, "no blocks" for none)."""
    def blocks(r: range) -> str:
        return "no blocks" if not r else f"block {r.start}" if len(r) == 1 else f"blocks {r.start}–{r[-1]}"

    return ", ".join(f"stage {s}: {blocks(r)}" for s, r in enumerate(ranges))


class RunWriter:
    """Writes a run folder and receives live progress (a :class:`~unbubble.runtime.telemetry.Listener`).

    Files: ``config.yaml`` and ``config.json`` (the effective configuration; ``unbubble train
    --config RUN/config.yaml --run-dir NEW`` repeats the run), ``metrics.jsonl`` (one line per
    step and per evaluation), ``actions.jsonl`` (every action: stage, micro-batch, start/end
    seconds, v_F/v_B, Δ), ``summary.json``, ``loss.png``, and TensorBoard event files (and a
    ``wandb/`` offline run) from :mod:`unbubble.loggers`.

    Raises:
        ConfigError: a requested logger's package is not installed.
    """

    def __init__(self, run_dir: Path, cfg: TrainConfig, job: PipelineJob, resume_step: int | None = None):
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"run_dir={str(run_dir)!r} cannot be created: {os_cause(exc)} (set --run-dir)") from None
        self.dir, self.cfg, self.job = run_dir, cfg, job
        self.info: dict[str, Any] = {}
        self.resume_step = resume_step
        self._elapsed_before = 0.0
        if resume_step is None:
            atomic_write_text(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2) + "\n")
            atomic_write_text(run_dir / "config.yaml", config_to_yaml(cfg))
        else:  # continuing: keep the config and the metrics up to the checkpoint, drop later ones
            path = run_dir / "metrics.jsonl"
            lines = path.read_text().splitlines(keepends=True) if path.exists() else []
            # from step 0 nothing is kept: the run evaluates version 0 again
            kept = [ln for ln in lines if resume_step and _step_of(ln) <= resume_step]
            path.write_text("".join(kept))
            # training seconds before the resume: elapsed_s continues from them, so loss-against-time
            # curves of a resumed run keep rising (start-ups excluded, as within one invocation)
            self._elapsed_before = max((json.loads(ln).get("elapsed_s", 0.0) for ln in kept), default=0.0)
        self.loggers = open_loggers(run_dir, cfg)
        self._metrics = open(run_dir / "metrics.jsonl", "w" if resume_step is None else "a")
        self.last: dict[str, Any] = {}
        self.stop_on_divergence = True  # train(on_divergence="record") turns it off
        self.n_dropped = 0  # micro-batches the non-finite guard dropped in this invocation
        self._router_since: dict | None = None  # router counters at the previous snapshot

    @staticmethod
    def choose_dir(cfg: TrainConfig) -> Path:
        """The run folder for ``cfg``; refuses a non-empty existing folder (nothing is overwritten).

        Raises:
            ConfigError: ``cfg.run_dir`` exists and is not empty.
        """
        if cfg.run_dir is None:
            base = Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.schedule}-N{cfg.stages}"
            path, i = base, 1
            while path.exists():
                path, i = Path(f"{base}-{i}"), i + 1
            return path
        path = Path(cfg.run_dir)
        # a switched run's asynchronous phase shares its folder with the synchronous phase it starts from
        ok = {SYNC_PHASE_DIR} if cfg.init_from and Path(cfg.init_from).parent == path.resolve() else set()
        if path.exists() and (not path.is_dir() or any(p.name not in ok for p in path.iterdir())):
            raise ConfigError(f"run_dir={str(path)!r} already exists and is not empty: choose a new folder "
                              "(set --run-dir); nothing was overwritten")
        parent = path.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"run_dir={str(path)!r} cannot be created: {str(parent)!r} is not a writable folder "
                              "(set --run-dir)")
        return path

    def describe(self, **info: Any) -> None:
        model = info["model"]
        tokens = info["tokens"]
        self.info = {
            "n_params": info["n_params"],
            "stage_layers": [[r.start, r.stop] for r in info["ranges"]],
            "model": {k: getattr(model, k) for k in ("n_layer", "n_head", "n_embd", "block_size", "vocab_size")},
            "train_tokens": int(tokens.train.size),
            "val_tokens": int(tokens.val.size),
            # which ids the run trained on: the tokenizer's name (hf:/folder for a model's own), its
            # vocabulary, EOS and the token files' dtype
            "tokenizer": {"name": tokens.tokenizer, "vocab_size": int(tokens.vocab_size), "eos_id": int(tokens.eos_id),
                          "dtype": str(tokens.train.dtype), "fingerprint": tokens.meta.get("tokenizer_fingerprint",
                                                                                            tokens.tokenizer)},
            "tokens_per_step": self.cfg.mb_per_step * self.cfg.micro_batch_size * self.cfg.seq_len * self.cfg.dp,
        }
        log.info("run folder %s", self.dir)
        log.info("model %s: %.2fM parameters; %s", self.cfg.model, info["n_params"] / 1e6,
                 describe_blocks(info["ranges"]))
        log.info("corpus %s: %d train / %d val tokens (%s tokenizer, %d ids); %d tokens per step",
                 self.cfg.corpus, tokens.train.size, tokens.val.size, tokens.tokenizer, tokens.vocab_size,
                 self.info["tokens_per_step"])

    # Listener ---------------------------------------------------------------------------
    def on_step(self, step: int, loss: float, info: dict[str, Any]) -> None:
        if "elapsed_s" in info and self._elapsed_before:
            info = {**info, "elapsed_s": info["elapsed_s"] + self._elapsed_before}
        self.last = {"step": step, "loss": loss, **info}
        self._metrics.write(json.dumps({"step": step, "loss": loss, **info}) + "\n")
        self._metrics.flush()
        for lg in self.loggers:
            lg.step(step, loss, info)
        if self.stop_on_divergence and not math.isfinite(loss):  # the mean of the micro-batches the guard kept: none could be kept
            raise Diverged(self.diverged_line(step, f"the training loss is {loss}"))

    def diverged_line(self, step: int, what: str) -> str:
        """The one line of a diverged run ([Note: a diverged run fails])."""
        guard = ("" if self.cfg.nan_policy == "off" else
                 f" after the non-finite guard ({self.cfg.nan_policy}) dropped {self.n_dropped} micro-batch(es)")
        return (f"training diverged at step {step}: {what}{guard}; start again with a lower --lr (this run: "
                f"{self.cfg.lr:g}){'' if self.cfg.nan_policy == 'lower-lr' else ' or --nan-policy lower-lr'}; "
                f"{self.dir}/summary.json says diverged")

    def on_event(self, event: dict[str, Any]) -> None:
        """A micro-batch the non-finite guard dropped: one JSONL line."""
        self._metrics.write(json.dumps({"event": "nonfinite", "step": event["version"], **event}) + "\n")
        self._metrics.flush()
        self.n_dropped += 1

    def on_snapshot(self, version: int, states: dict[int, dict]) -> None:
        """Router statistics of a mixture of experts since the previous evaluation: one JSONL line
        ``{"step": v, "router": {...}}`` and TensorBoard scalars (``models.moe.router_stats``; nothing for a
        dense model)."""
        merged = {k: v for state in states.values() for k, v in state.items()}
        stats = router_stats(merged, self._router_since)
        if stats is None or stats["assignments"] == 0:  # dense, or nothing routed yet (version 0)
            return
        self._router_since = {k: v for k, v in merged.items() if k.endswith((".routed", ".dropped"))}
        self._metrics.write(json.dumps({"step": version, "router": stats}) + "\n")
        self._metrics.flush()
        log.info("router at version %d: max load %.2f × even share, %.1f %% of assignments dropped", version,
                 stats["max_load"], 100 * stats["mean_dropped_frac"])
        for lg in self.loggers:
            lg.router(version, stats)

    def on_eval(self, version: int, val_loss: float) -> None:
        rec = {"step": version, "val_loss": val_loss, "val_ppl": perplexity(val_loss)}
        self._metrics.write(json.dumps(rec) + "\n")
        self._metrics.flush()
        for lg in self.loggers:
            lg.eval(version, val_loss)
        log.info("eval at version %d: val loss %.4f, ppl %.2f", version, val_loss, rec["val_ppl"])
        if self.stop_on_divergence and not math.isfinite(val_loss):  # the guard never sees an evaluation: the weights themselves diverged
            raise Diverged(self.diverged_line(version, f"the validation loss is {val_loss}"))

    # End of run ---------------------------------------------------------------------------
    def discard(self) -> None:
        """Closes the run's files and removes its folder: a new run that ended before its first
        step leaves nothing a later run with the same ``--run-dir`` would refuse."""
        import shutil

        self._metrics.close()
        for lg in self.loggers:
            lg.close()
        if (self.dir / SYNC_PHASE_DIR).is_dir():  # a switched run keeps its finished synchronous phase
            for p in self.dir.iterdir():
                if p.name != SYNC_PHASE_DIR:
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
            return
        shutil.rmtree(self.dir, ignore_errors=True)

    def finish(self, result: RunResult, total_wall_s: float, started_at: float | None = None) -> dict[str, Any]:
        self._metrics.close()
        versions = result.trace.versions()
        recompute = self.job.recompute == "full"
        with open(self.dir / "actions.jsonl", "w") as f:
            for r in result.trace.records:
                a = r.action
                rec = {"stage": a.stage, "action": str(a), "kind": a.kind.value, "mb": a.mb,
                       "start_s": r.start, "end_s": r.end, "version": r.version}
                if a.kind.value in "BI" and (a.stage, a.mb) in versions:
                    vf, vb = versions[(a.stage, a.mb)]
                    rec.update(v_F=vf, v_B=vb, drift=vb - vf)
                    if recompute:  # the recomputed forward ran on the backward's weights ([Note: precision ...])
                        rec["recomputed_v"] = vb
                f.write(json.dumps(rec) + "\n")
        sched = self.job.schedule
        train, val = self.history()
        summary = {
            "schedule": sched.name, "stages": sched.n_stages, "mb_per_step": sched.mb_per_step,
            "steps": sched.steps, "engine": self.cfg.engine, **self.info,
            "tokens": result.tokens, "train_wall_s": result.wall_s, "total_wall_s": total_wall_s,
            "tokens_per_s": result.tokens_per_s,
            "utilization": result.trace.utilization(),  # measured wall clock (serial in the emulator)
            # emulator: its schedule on N devices at the measured stage costs (sim/measured.py)
            "simulated_utilization": _simulated_utilization(sched, result),
            "max_drift": result.max_drift(),
            "drift_bound": [sched.drift_bound(s) for s in range(sched.n_stages)],
            "optimizer": self.cfg.optimizer,
            "precision": self.job.precision, "recompute": self.job.recompute,
            "compile_backend": self.job.compile_backend,  # None: eager stages
            # per stage, measured by the executor (StageExecutor.memory_bytes): parameter, fp32 master,
            # gradient, optimizer-state, peak activation and weight-copy bytes
            "memory": result.memory,
            # process engine: per stage, the resident memory of the process hosting it after its last
            # action, and its peak; interleaved stages of one rank repeat their process's figures, and
            # with --dp only replica 0's processes are listed (the emulator runs every stage in the
            # command's own process: None)
            "rss_bytes": [m.get("process_rss_bytes") for m in result.memory] if self.cfg.engine != "emulator" else None,
            "peak_rss_bytes": [m.get("process_peak_rss_bytes") for m in result.memory]
            if self.cfg.engine != "emulator" else None,
            # seconds from the command's start (the CLI's process start; train()'s call from Python) to
            # the end of the first optimizer step on every stage
            "startup_s": None if result.first_step_end is None or started_at is None
            else result.first_step_end - started_at,
            "optimizer_extra_bytes": [b.get("extra_bytes") for b in result.optimizer_bytes],
            "optimizer_extra_per_rotated_param": [b.get("extra_per_rotated_param") for b in result.optimizer_bytes],
            "final_train_loss": train[-1][1] if train else None,
            "val_losses": val,  # the whole run's, across resumes (from metrics.jsonl)
            "initial_val_loss": val[0][1] if val else None,
            "final_val_loss": val[-1][1] if val else None,
            "steps_done": train[-1][0] if train else 0,
            "resumed_from_step": self.resume_step,
            # the whole run across resumes (tokens, train_wall_s and tokens_per_s count this invocation)
            "run_tokens": (train[-1][0] if train else 0) * self.info.get("tokens_per_step", 0),
            "run_train_wall_s": self._elapsed_before + result.wall_s,
            "stopped_at_step": result.stopped_at,
            "nonfinite_dropped": [{k: e[k] for k in ("stage", "mb", "version", "what")} for e in result.events],
            # gradient clipping ([Note: clip scopes] in docs/architecture.md): scope, max_norm, stale lag, and per
            # stage the updates clipped and skipped (non-finite norm) over the whole run; None without clipping
            "clip": result.clip,
            # mixture of experts: load per expert and dropped assignments over the whole run (None if dense)
            "router": router_stats({k: v for state in result.final_states for k, v in state.items()}),
        }
        if summary["final_val_loss"] is not None:
            summary["final_val_ppl"] = perplexity(summary["final_val_loss"])
        summary.update(_ending(self, result, summary))
        atomic_write_text(self.dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        self._plot(train, val)
        for lg in self.loggers:
            lg.finish(result, summary)
        return summary

    def finish_failed(self, exc: BaseException) -> dict[str, Any]:
        """The summary of a run that ended by an exception after steps were done: what is known
        (losses from metrics.jsonl, the model) and how it ended: ``status`` ``diverged`` (a
        :class:`~unbubble.errors.Diverged` or the guard's ``NonFiniteError``), ``stopped`` (a second
        signal) or ``crashed``, and ``error``, the one line the command printed."""
        with contextlib.suppress(Exception):
            self._metrics.close()
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if isinstance(exc, (Diverged, NonFiniteError)) or "NonFiniteError" in text:
            status = "diverged"
        elif isinstance(exc, (KeyboardInterrupt, SecondSignal)) or "second SIG" in text:
            status = "stopped"
        else:
            status = "crashed"
        train, val = self.history()
        sched = self.job.schedule
        summary = {"schedule": sched.name, "stages": sched.n_stages, "mb_per_step": sched.mb_per_step,
                   "steps": sched.steps, "engine": self.cfg.engine, **self.info,
                   "optimizer": self.cfg.optimizer, "precision": self.job.precision,
                   "final_train_loss": train[-1][1] if train else None, "val_losses": val,
                   "initial_val_loss": val[0][1] if val else None, "final_val_loss": val[-1][1] if val else None,
                   "steps_done": train[-1][0] if train else 0, "resumed_from_step": self.resume_step,
                   "stopped_at_step": None, "status": status, "diverged": status == "diverged", "error": text}
        try:
            atomic_write_text(self.dir / "summary.json", json.dumps(summary, indent=2) + "\n")
            self._plot(train, val)
        except Exception as write_error:  # noqa: BLE001 - the run's own error is the one to report
            log.warning("%s: summary.json not written (%s)", self.dir, write_error)
        for lg in self.loggers:
            with contextlib.suppress(Exception):
                lg.close()
        return summary

    def history(self) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
        """``(train, validation)`` losses as ``(step, loss)`` pairs of the whole run, across resumes,
        read back from metrics.jsonl."""
        steps, evals = read_metrics(self.dir)
        return [(r["step"], r["loss"]) for r in steps], [(r["step"], r["val_loss"]) for r in evals]

    def _plot(self, train: list[tuple[int, float]], val: list[tuple[int, float]]) -> None:
        from unbubble._figures import LOSS_LABEL, new_figure, plot_validation, save

        fig = new_figure(7, 4)
        ax = fig.add_subplot()
        ax.plot([s for s, _ in train], [v for _, v in train], lw=1, label="train (last stage, mean over the step)")
        if val:
            plot_validation(ax, [s for s, _ in val], [v for _, v in val])
        ax.set_xlabel("optimizer step (weight version)")
        ax.set_ylabel(LOSS_LABEL)
        sched = self.job.schedule
        ax.set_title(f"{sched.name}, N={sched.n_stages}, {'a' if sched.asynchronous else 'm'}={sched.mb_per_step}")
        save(fig, ax, self.dir / "loss.png")


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A run folder's metrics.jsonl read back: ``(steps, evaluations)``, its records in file order —
    a training step's ``{"step", "loss", "elapsed_s", …}`` (the ``on_step`` lines) and an evaluation's
    ``{"step", "val_loss", "val_ppl"}``; the guard's ``event`` lines, router statistics and blank
    lines are left out. No file: two empty lists.

    Raises:
        json.JSONDecodeError: a line is not JSON; ValueError: a line is JSON but not an object (the
            callers say which folder).
    """
    path = Path(run_dir) / "metrics.jsonl"
    steps, evals = [], []
    for n, line in enumerate(path.read_text().splitlines() if path.exists() else [], 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if not isinstance(rec, dict):
            raise ValueError(f"line {n} holds {type(rec).__name__}, not an object")
        if "val_loss" in rec:
            evals.append(rec)
        elif "loss" in rec and "event" not in rec:
            steps.append(rec)
    return steps, evals


def _ending(writer: RunWriter, result: RunResult, summary: dict[str, Any]) -> dict[str, Any]:
    """``status`` (``finished``, ``stopped`` or ``diverged``), ``diverged`` and, when diverged,
    ``error``: a run diverged when its last training or validation loss, or a weight of its final
    state, is not finite ([Note: a diverged run fails])."""
    import torch

    if summary["stopped_at_step"] is not None:
        return {"status": "stopped", "diverged": False}
    step = summary["steps_done"]
    what = None
    for name in ("final_train_loss", "final_val_loss"):
        value = summary.get(name)
        if value is not None and not math.isfinite(value):
            what = f"the {'training' if name == 'final_train_loss' else 'validation'} loss is {value}"
    if what is None:
        for s, state in enumerate(result.final_states or []):
            bad = next((k for k, t in state.items() if isinstance(t, torch.Tensor) and t.is_floating_point()
                        and not bool(torch.isfinite(t).all())), None)
            if bad is not None:
                what = f"stage {s}'s weight {bad} is not finite"
                break
    if what is None:
        return {"status": "finished", "diverged": False}
    return {"status": "diverged", "diverged": True, "error": writer.diverged_line(step, what)}


def _step_of(line: str) -> float:
    """The ``step`` of a metrics.jsonl line (∞ for a damaged line, so it is dropped)."""
    try:
        return json.loads(line).get("step", 0)
    except (ValueError, AttributeError):
        return float("inf")


def _simulated_utilization(schedule, result) -> list[float] | None:
    """An emulated run's utilization on N devices (:func:`~unbubble.sim.measured.simulated_on_measured`)."""
    if result.sim_trace is None:
        return None
    from unbubble.sim.measured import simulated_on_measured

    trace = simulated_on_measured(schedule, result.trace)
    return trace.utilization() if trace is not None else None
