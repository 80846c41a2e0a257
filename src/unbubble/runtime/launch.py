"""Process engine: one process per pipeline rank and replica on this machine, or under ``torchrun``.

A run has ``job.dp × R`` processes ([Note: 2-D rank layout] in docs/architecture.md); the backend is NCCL
with one CUDA device per process when CUDA has enough devices, else gloo on the CPU. A failure ends the
run at once, naming the culprit and its last action, never leaving a process behind:
[Note: failure handling] in docs/architecture.md#runtimelaunchpy.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unbubble.errors import ConfigError, NonFiniteError, PipelineFailure, SecondSignal, StartupInterrupted
from unbubble.runtime import lazy_dynamo
from unbubble.runtime.clipping import clip_summary
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.reports import Done, Event, Failed, Final, Records, Report, Snapshot, Started, StepLoss, \
    Stopped
from unbubble.runtime.telemetry import Listener, RunResult, Telemetry
from unbubble.runtime.worker import from_bytes, run_stage
from unbubble.schedules.policy import Cuts
from unbubble.schedules.actions import Action
from unbubble.sim.engine import ActionRecord

log = logging.getLogger(__name__)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def choose_backend(local_processes: int, backend: str | None = None) -> str:
    """``backend`` if given, else ``"nccl"`` when CUDA has a device for each of this machine's
    ``local_processes``, else ``"gloo"``.

    Raises:
        ConfigError: ``backend`` is not gloo or nccl, or nccl without enough CUDA devices.
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        return "nccl" if gpus >= local_processes else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend={backend!r} is invalid: must be gloo or nccl")
    if backend == "nccl" and gpus < local_processes:
        raise ConfigError(f"backend='nccl' needs one CUDA device per process: {local_processes} processes here "
                          f"but {gpus} devices (use backend='gloo')")
    return backend


def _init(backend: str, local_rank: int, **kwargs):
    """Initialises the default group; returns ``(device, control group)`` for :func:`run_stage`."""
    device = None
    if backend == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group(backend, **kwargs)
    control = dist.new_group(backend="gloo") if backend == "nccl" else None  # host-side control messages
    return device, control


#: Exit status of a stage process that found itself re-running the caller's ``__main__`` module.
_NO_GUARD_EXIT = 86


def _no_guard_message(where: str) -> str:
    return (f"run_processes was called from a script without an `if __name__ == \"__main__\":` guard ({where}): "
            "each stage process starts by importing that script and would run it again; move the call under "
            "the guard")


def check_main_guard() -> None:
    """Refuses to start stage processes when the code calling :func:`run_processes` runs at the
    top level of the ``__main__`` script, outside ``if __name__ == "__main__":``: the spawned
    processes re-import that script (Python's ``spawn`` start method) and would run it again.

    Interactive sessions, ``python -c`` and notebooks have no script to re-import: no check.

    Raises:
        ConfigError: the call is not under the guard; names the script and the line.
    """
    import ast

    path = getattr(sys.modules.get("__main__"), "__file__", None)
    frame, top = sys._getframe(1), None
    while frame is not None:  # the outermost frame running the script's top level
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            top = frame
        frame = frame.f_back
    if path is None or top is None:
        return
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return
    line = top.f_lineno
    for stmt in tree.body:
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            if isinstance(stmt, ast.If) and "__name__" in ast.unparse(stmt.test):
                return
            raise ConfigError(_no_guard_message(f"{path}, line {line}"))


def _rank_name(job: PipelineJob, rank: int) -> int | str:
    """How errors name a process: its stage (one replica) or ``"s (replica d)"``."""
    if job.dp == 1:
        return rank
    d, r = divmod(rank, job.schedule.n_ranks)
    return f"{r} (replica {d})"


def stopped_at_once(signame: str, checkpoint, n_stages: int, run_dir=None) -> str:
    """The line for a run that a second stop signal ended at once: the first signal's checkpoint
    is written only at the next step boundary, so what is kept is the newest *complete* checkpoint
    on disk now (every stage's file; a write the signal cut short is left as a temporary file that
    --resume deletes), and --resume continues from exactly that one.

    Args:
        signame: the second signal (``"SIGINT"``).
        checkpoint: the job's :class:`~unbubble.runtime.checkpoint.Checkpointing`, or ``None``.
        n_stages: stages with a file in each checkpoint.
        run_dir: the run folder, to name the resume command (``None``: "--resume").
    """
    from unbubble.runtime.checkpoint import complete_steps

    head = f"second {signame}: stopped at once"
    if checkpoint is None:
        return f"{head}; checkpoints are off, so no step was kept"
    resume = f"unbubble train --resume {run_dir}" if run_dir is not None else "--resume"
    steps = complete_steps(checkpoint.directory, n_stages)
    if not steps:
        return f"{head}, before any checkpoint was complete: {resume} starts again from step 0"
    path = os.path.join(str(checkpoint.directory), f"step-{steps[-1]:08d}")
    return f"{head}; the newest complete checkpoint, step {steps[-1]} ({path}), is kept: {resume} continues from it"


#: Fields of a :class:`PipelineJob` that are often functions (checked first, so the message names them).
_CALLABLE_FIELDS = ("stage_fn", "loss_fn", "batch_fn", "optimizer_fn", "lr_lambda", "val_fn")


def _describe(obj) -> str:
    """How a picklability error names ``obj``: a function by its qualified name (``mod.f.<locals>.<lambda>``)."""
    import functools

    if isinstance(obj, functools.partial):
        return f"functools.partial({_describe(obj.func)}, …)"
    name = getattr(obj, "__qualname__", None)
    if name is not None and callable(obj):
        return f"{getattr(obj, '__module__', '?')}.{name}"
    return type(obj).__name__


def check_picklable(job: PipelineJob) -> None:
    """Refuses a job the process engine could not send to its stage processes (each one rebuilds
    the job from a pickle): up front, before any process starts, naming the field, rather than a
    raw ``PicklingError`` from inside ``Process.start``.

    Raises:
        ConfigError: one line naming the field and its object, and what to do.
    """
    import dataclasses
    import pickle

    names = list(_CALLABLE_FIELDS) + [f.name for f in dataclasses.fields(job) if f.name not in _CALLABLE_FIELDS]
    for name in names:
        value = getattr(job, name)
        try:
            pickle.dumps(value)
        except (pickle.PicklingError, AttributeError, TypeError):  # lambdas, local functions, locks, ...
            fix = ("give a module-level function (or a functools.partial of one)" if callable(value)
                   else "give a picklable value")
            raise ConfigError(f"job.{name}={_describe(value)} cannot be pickled, and the processes engine sends the "
                              f"job to every stage process: {fix}, or run it on the emulator engine") from None


#: Seconds without a heartbeat after which the launcher declares a stage process hung.
HANG_S = 20.0
#: A stop signal within this many seconds of the previous one is the same stop delivered twice:
#: GNU ``timeout -s INT`` (without --foreground) signals the command and then its process group.
ECHO_S = 0.25
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent dies, so no stage outlives a killed
    launcher (``prctl(PR_SET_PDEATHSIG)``); elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except OSError:
            pass


class _Echoes:
    """Tells a stop signal from its echo: one within ``ECHO_S`` seconds of the previous signal."""

    def __init__(self) -> None:
        self._last = -math.inf  # time.monotonic() of the previous signal

    def __call__(self) -> bool:
        now = time.monotonic()
        echo, self._last = now - self._last < ECHO_S, now
        return echo


def pass_on_late_stop(previous, signum: int) -> None:
    """A stop signal that reached a run at or after its last step boundary cut nothing short (the
    run is complete): hand it to the handler that was installed before the run, so that a sweep or
    an experiment still starts no further run. Python's default handler is not called: it would turn
    a finished run into a KeyboardInterrupt and lose its results."""
    if callable(previous) and previous is not signal.default_int_handler:
        previous(signum, None)


def install_stop_handlers(cuts: Cuts, announce: bool = True) -> None:
    """SIGINT/SIGTERM ask the run to stop at its next cut (checkpoint, then exit); a second
    signal stops at once (the previous complete checkpoint stays), unless it follows the first
    within ``ECHO_S`` seconds (one stop sent twice). ``announce`` logs the first."""
    echo = _Echoes()

    def handler(signum, frame):
        if echo():
            return  # the same stop, delivered twice
        if cuts.stop_requested:
            raise SecondSignal(signal.Signals(signum).name)
        cuts.stop_requested = True
        if announce:
            log.warning("%s: stopping at the next step boundary (send it again to stop at once)",
                        signal.Signals(signum).name)

    for sig in _STOP_SIGNALS:
        signal.signal(sig, handler)


def _stage_entry(rank: int, job: PipelineJob, replay, q, port: int, threads: int, timeout_s: float,
                 backend: str = "gloo", beats=None, last_actions=None, parent: int | None = None) -> None:
    _die_with_parent()
    if parent is not None and os.getppid() != parent:  # the launcher died before PDEATHSIG was set
        os._exit(1)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)-8s [rank {rank}] %(message)s")
    for sig in _STOP_SIGNALS:  # discards a terminal's Ctrl-C still pending from the start (blocked then)
        signal.signal(sig, signal.SIG_IGN)
    os.setpgrp()  # a terminal's Ctrl-C reaches the launcher only, which forwards it once
    torch.set_num_threads(threads)
    cuts = job.cuts()
    install_stop_handlers(cuts, announce=False)  # the launcher announces it
    # a stop signal during the rendezvous would interrupt its connects (EINTR) and print C++ retry
    # warnings with stack traces: it stays pending (blocked in every thread) until run_stage has
    # set up its process groups and unblocks it
    signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
    slot = last_actions[rank] if last_actions is not None else None

    def on_action(action) -> None:
        slot.value = str(action).encode()[:31]

    if beats is not None:  # liveness from a thread, so a long action is not a hang
        def beat() -> None:
            while True:
                beats[rank] = time.time()
                time.sleep(1.0)

        threading.Thread(target=beat, name="heartbeat", daemon=True).start()
    try:
        device, control = _init(backend, rank, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=job.dp * job.schedule.n_ranks, timeout=timedelta(seconds=timeout_s))
        if job.compile_backend is None:  # after init_process_group, which touches a loaded torch._dynamo, and
            lazy_dynamo.defer()  # before any optimizer exists: [Note: eager stage processes without Dynamo]
        run_stage(job, rank, q.put, replay, recv_timeout_s=timeout_s, device=device, control_group=control,
                  cuts=cuts, on_action=on_action if slot is not None else None)
        dist.destroy_process_group()
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, then exit 1
        text = f"{type(exc).__name__}: {exc}"
        q.put(Failed(rank, text))
        # a neighbour's failure (the launcher names the culprit) or a known condition: no traceback
        if not any(mark in text for mark in _SECONDARY) and not isinstance(exc, NonFiniteError):
            traceback.print_exc()
        sys.stderr.flush()
        q.close()
        q.join_thread()  # flush the report before the hard exit
        os._exit(1)


class _Collector:
    """Turns stage reports (``runtime/reports.py``) into telemetry (shared by the local launcher and torchrun)."""

    def __init__(self, job: PipelineJob, listener: Listener | None):
        self.job = job
        self.telemetry = Telemetry(job, listener, start_step=job.start_step)
        self.finals: dict[int, Final] = {}
        self.done_walls: list[float] = []  # from replicas d > 0
        self.stopped_at: int | None = None

    @property
    def complete(self) -> bool:
        """Every stage of every replica has finished."""
        n = self.job.schedule.n_stages
        return len(self.finals) == n and len(self.done_walls) == (self.job.dp - 1) * n

    def handle(self, report: Report) -> None:
        """Adds one report (a :class:`Failed` is the launcher's to handle, not this).

        Raises:
            TypeError: ``report`` is not a report this collector knows.
        """
        match report:
            case Records(records=records):
                for action, start, end, version, weights in records:
                    self.telemetry.add_record(ActionRecord(Action.parse(action), start, end, version, weights))
            case StepLoss(loss=loss):
                self.telemetry.add_step_loss(loss)
            case Snapshot(stage=stage, version=version, state=state):
                self.telemetry.add_snapshot(stage, version, from_bytes(state))
            case Final(stage=stage):
                self.finals[stage] = report
            case Done(wall_s=wall_s):
                self.done_walls.append(wall_s)
            case Event(event=event):
                self.telemetry.add_event(event)
            case Stopped(step=step):
                self.stopped_at = step
            case Started(t0=t0):
                self.telemetry.set_start(t0)
            case _:
                raise TypeError(f"a stage report of type {type(report).__name__} is not one of runtime/reports.py's")

    def result(self) -> RunResult:
        n = self.job.schedule.n_stages
        finals = [self.finals[s] for s in range(n)]
        wall = max([f.wall_s for f in finals] + self.done_walls)
        return self.telemetry.result([from_bytes(f.state) for f in finals], wall,
                                     optimizer_bytes=[f.optimizer_bytes for f in finals], stopped_at=self.stopped_at,
                                     memory=[f.memory for f in finals],
                                     clip=clip_summary(self.job, [f.clip_stats for f in finals]))


_SECONDARY = ("PeerFailure", "Connection closed by peer", "Connection reset by peer", "Broken pipe")


def _root_cause(first: Failed, q, wait_s: float = 2.0) -> Failed:
    """Among the errors stages report within ``wait_s``, the one that is not a neighbour's
    reaction to another failure (a closed connection, a receive timeout)."""
    errors, deadline = [first], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            msg = q.get(timeout=0.1)
        except queue.Empty:
            continue
        if isinstance(msg, Failed):
            errors.append(msg)
    primary = [e for e in errors if not any(mark in e.text for mark in _SECONDARY)]
    return (primary or errors)[0]


def run_processes(job: PipelineJob, replay: list[list[Action]] | None = None, listener: Listener | None = None,
                  threads_per_stage: int = 1, timeout_s: float = 60.0, backend: str | None = None,
                  hang_s: float = HANG_S) -> RunResult:
    """Trains ``job`` with ``job.dp × R`` spawned processes (one per pipeline rank and replica)
    over ``torch.distributed``.

    Failures ([Note: failure handling]): a stage that raises, dies or stops sending its
    heartbeat for ``hang_s`` seconds ends the run: every process is killed, and the error names
    the stage and its last action. Stage processes run in
    their own process group and die with this process (``PR_SET_PDEATHSIG``), so none is left
    behind. SIGINT/SIGTERM to this process are forwarded once: the run stops at the next step
    boundary after a checkpoint (``job.checkpoint``); a second signal terminates at once.

    Args:
        job: what to train; must be picklable.
        replay: per-rank action lists to follow (e.g. an emulator run's ``trace.order()``):
            the run is then bit-identical to that run (every replica follows them).
        listener: receives per-step losses and evaluations (in this, the coordinating process).
        threads_per_stage: ``torch.set_num_threads`` in each stage process.
        timeout_s: a stage waiting longer than this for a neighbour's message fails the run
            (seconds; also the process-group set-up timeout).
        backend: ``"gloo"`` or ``"nccl"``; default :func:`choose_backend` (NCCL when CUDA has
            a device per process).
        hang_s: seconds without a heartbeat after which a stage counts as hung; at most half of
            ``timeout_s`` (and at least 3 s), so a hung stage is named before a neighbour's receive
            times out and would be blamed instead.

    Returns:
        A :class:`RunResult`; ``trace`` holds wall-clock times (seconds since the shared
        start) and ``wall_s`` the slowest stage's training time (start-up excluded);
        ``stopped_at`` is set when a signal stopped the run.

    Raises:
        PipelineFailure: a stage process raised, died or hung; every other stage is terminated.
    """
    if getattr(mp.current_process(), "_inheriting", False):  # a stage process re-running an unguarded script
        os._exit(_NO_GUARD_EXIT)  # silently: the launcher says why
    check_main_guard()
    check_picklable(job)  # before any process starts: a lambda would fail inside Process.start
    backend = choose_backend(job.dp * job.schedule.n_ranks, backend)
    hang_s = min(hang_s, max(3.0, timeout_s / 2))  # the hung stage, not its waiting neighbour
    return _LocalLaunch(job, replay, listener, threads_per_stage, timeout_s, backend, hang_s).run()


class _LocalLaunch:
    """One :func:`run_processes` call: the stage processes, their heartbeats and last actions, the
    stop signals and the reports' collector."""

    def __init__(self, job: PipelineJob, replay: list[list[Action]] | None, listener: Listener | None,
                 threads_per_stage: int, timeout_s: float, backend: str, hang_s: float):
        self.job, self.hang_s = job, hang_s
        n = job.schedule.n_ranks
        self.world = world = job.dp * n
        ctx = mp.get_context("spawn")
        self.q = ctx.Queue()
        port = _free_port()
        self.beats = ctx.Array("d", world, lock=False)
        self.last_actions = [ctx.Array("c", 32, lock=False) for _ in range(world)]
        self.procs = [
            ctx.Process(target=_stage_entry, name=f"unbubble-rank-{g}",
                        args=(g, job, None if replay is None else replay[g % n], self.q, port, threads_per_stage,
                              timeout_s, backend, self.beats, self.last_actions, os.getpid()))
            for g in range(world)
        ]
        self.signals: list[int] = []
        self.forwarded: set[int] = set()
        self.starting = True  # while the stage processes are spawned: a stop waits until they all have been
        self.echo = _Echoes()
        self.on_main = threading.current_thread() is threading.main_thread()
        self.previous = {sig: signal.getsignal(sig) for sig in _STOP_SIGNALS} if self.on_main else {}
        self.collector = _Collector(job, listener)

    def run(self) -> RunResult:
        try:
            self._start()
            self._collect()
            for p in self.procs:
                p.join(timeout=60)
        except SecondSignal as exc:  # the stages die first, so no checkpoint completes after the line is written
            for p in self.procs:
                if p.pid is not None and p.is_alive():
                    p.kill()
            for p in self.procs:
                if p.pid is not None:
                    p.join(timeout=10)
            raise PipelineFailure(stopped_at_once(exc.signame, self.job.checkpoint, self.job.schedule.n_stages)) \
                from None
        except KeyboardInterrupt as exc:
            raise PipelineFailure(f"{exc}; the newest complete checkpoint, if any, is unchanged") from None
        finally:
            self._clean_up()
        result = self.collector.result()
        if self.signals and result.stopped_at in (None, self.job.schedule.steps):  # the stop cut nothing short
            pass_on_late_stop(self.previous.get(self.signals[0]), self.signals[0])
        return result

    def _start(self) -> None:
        """Spawns the stage processes with stop signals held back until all have started."""
        if self.on_main:  # children start with SIGINT/SIGTERM blocked (a terminal's Ctrl-C reaches them too, and
            # they discard it); here a signal that arrives while they start waits until they all have
            for sig in _STOP_SIGNALS:
                signal.signal(sig, self._on_signal)
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
        try:
            for p in self.procs:
                p.start()
        finally:
            if self.on_main:  # (another thread of this process may still have run _on_signal meanwhile)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
            self.starting = False
        if self.signals:
            raise self._startup_interrupted(self.signals[0])

    def _collect(self) -> None:
        """Reads reports until every stage has finished; raises for a stage that failed, died or hung."""
        while not self.collector.complete:
            self._forward_stop()
            try:
                report = self.q.get(timeout=0.5)
            except queue.Empty:
                self._check_processes()
                continue
            if isinstance(report, Failed):
                self._raise_stage_error(_root_cause(report, self.q))
            self.collector.handle(report)

    def _check_processes(self) -> None:
        """With no report for a while: raises for a stage process that exited non-zero (its error
        report first, if it is still in the queue), was killed or hung."""
        dead = [(g, p.exitcode) for g, p in enumerate(self.procs) if p.exitcode not in (None, 0)]
        if dead:
            try:  # its error report may still be in the queue
                report = self.q.get(timeout=1.0)
                if isinstance(report, Failed):
                    self._raise_stage_error(_root_cause(report, self.q))
                self.collector.handle(report)
            except queue.Empty:
                pass
            g, code = dead[0]
            if code == _NO_GUARD_EXIT:
                raise ConfigError(_no_guard_message(getattr(sys.modules["__main__"], "__file__", "?")))
            raise PipelineFailure(self._culprit() or f"stage {_rank_name(self.job, g)} exited with code {code} "
                                  f"without a report; its last action was {self._last(g)}")
        found = self._culprit()
        if found:
            raise PipelineFailure(found)

    def _clean_up(self) -> None:
        """Restores the signal handlers and kills what still runs (after a failure: SIGTERM would only
        ask a stage to stop at a checkpoint)."""
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        started = [p for p in self.procs if p.pid is not None]  # a failed start leaves some never started
        for p in started:
            if p.is_alive():
                p.kill()
        for p in started:
            p.join(timeout=10)

    def _forward_stop(self) -> None:
        """Passes a stop on to each stage once it has installed its handlers (its heartbeat runs):
        a stage still starting ignores SIGINT/SIGTERM (inherited SIG_IGN), so it is told later."""
        for g, p in enumerate(self.procs):
            if self.signals and g not in self.forwarded and self.beats[g] > 0 and p.is_alive():
                os.kill(p.pid, self.signals[0])
                self.forwarded.add(g)

    @staticmethod
    def _startup_interrupted(signum: int) -> StartupInterrupted:
        return StartupInterrupted(f"{signal.Signals(signum).name} before the first step: every stage process "
                                  "was ended (nothing to save; the newest checkpoint, if any, is unchanged)")

    def _on_signal(self, signum, frame):
        if self.echo():
            return  # the same stop, delivered twice
        self.signals.append(signum)
        if self.starting:  # raising inside Process.start would cut a child's pickled input short
            return  # (its "EOFError: Ran out of input" traceback): raised once all have started
        if not self.collector.telemetry.step_losses:  # nothing done yet, so nothing to save
            raise self._startup_interrupted(signum)
        if len(self.signals) > 1:
            raise SecondSignal(signal.Signals(signum).name)
        log.warning("%s: the run stops at the next step boundary, after a checkpoint (send it again to stop at "
                    "once)", signal.Signals(signum).name)
        self._forward_stop()

    def _last(self, g: int) -> str:
        return self.last_actions[g].value.decode() or "none (still starting)"

    def _culprit(self) -> str | None:
        """[Note: failure handling]: a stage killed by a signal, or hung (stale heartbeat), is the
        cause; its neighbours' errors (closed connections, receive timeouts) are consequences."""
        for g, p in enumerate(self.procs):
            if p.exitcode is not None and p.exitcode < 0:
                return (f"stage {_rank_name(self.job, g)} was killed by {signal.Signals(-p.exitcode).name} without a "
                        f"report; its last action was {self._last(g)}")
        now = time.time()
        for g in range(self.world):
            if self.beats[g] > 0 and now - self.beats[g] > self.hang_s and self.procs[g].exitcode is None:
                self.procs[g].kill()  # a stopped process ignores SIGTERM
                return (f"stage {_rank_name(self.job, g)} stopped responding (no heartbeat for "
                        f"{now - self.beats[g]:.0f} s); its last action was {self._last(g)}")
        return None

    def _raise_stage_error(self, report: Failed) -> None:
        """Raises for a stage's :class:`Failed` report, naming the culprit instead when the report is a
        neighbour's reaction to it."""
        if any(mark in report.text for mark in _SECONDARY):
            found = self._culprit()
            if found:
                raise PipelineFailure(found)
        where = "" if "last action" in report.text else f"; its last action was {self._last(report.rank)}"
        raise PipelineFailure(f"stage {_rank_name(self.job, report.rank)} failed: {report.text}{where}")


def under_torchrun() -> bool:
    """True when this process was started by ``torchrun`` (RANK/WORLD_SIZE are set)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def run_torchrun(job: PipelineJob, replay: list[list[Action]] | None = None, listener: Listener | None = None,
                 timeout_s: float = 60.0, backend: str | None = None) -> RunResult | None:
    """Runs this process's pipeline rank when launched by ``torchrun``: WORLD_SIZE = D·R,
    global rank ``d·R + r`` ([Note: 2-D rank layout]; ``--nnodes D --nproc-per-node R`` puts
    one replica on each machine). NCCL on ``cuda:LOCAL_RANK`` when CUDA has a device per
    local process (LOCAL_WORLD_SIZE), else gloo.

    Reports are gathered on rank 0 at the end, which returns the :class:`RunResult`; other
    ranks return ``None``.

    Raises:
        ConfigError: WORLD_SIZE differs from dp × pipeline ranks.
    """
    world = int(os.environ["WORLD_SIZE"])
    n = job.schedule.n_ranks
    if world != job.dp * n:
        raise ConfigError(f"WORLD_SIZE={world} does not match dp × pipeline ranks = {job.dp} × {n} = {job.dp * n}: "
                          "launch one process per stage and replica (torchrun --nnodes … --nproc-per-node … with "
                          "nnodes × nproc-per-node = dp × stages)")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend = choose_backend(int(os.environ.get("LOCAL_WORLD_SIZE", "1")), backend)
    device, control = _init(backend, local_rank, timeout=timedelta(seconds=timeout_s))
    if job.compile_backend is None:  # [Note: eager stage processes without Dynamo]
        lazy_dynamo.defer()
    rank = dist.get_rank()
    messages: list[Report] = []
    cuts = job.cuts()
    install_stop_handlers(cuts)  # torchrun forwards SIGINT/SIGTERM to every worker
    run_stage(job, rank, messages.append, None if replay is None else replay[rank % n],
              recv_timeout_s=timeout_s, device=device, control_group=control, cuts=cuts)
    gathered = [None] * world if rank == 0 else None
    dist.gather_object(messages, gathered, dst=0, group=control)
    dist.destroy_process_group()
    if rank != 0:
        return None
    collector = _Collector(job, listener)
    for stage_msgs in gathered:  # every rank's records first
        for msg in stage_msgs:
            if isinstance(msg, Records):
                collector.handle(msg)
    for stage_msgs in gathered:
        for msg in stage_msgs:
            if not isinstance(msg, Records):
                collector.handle(msg)
    return collector.result()
