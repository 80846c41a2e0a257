"""Checkpoint/resume, stops and the non-finite guard, in the emulator, against independent
references: an uninterrupted run, a run where a micro-batch contributes nothing."""

import dataclasses
import functools
import math

import pytest
import torch
from torch import nn

from unbubble.errors import ConfigError, NonFiniteError
from unbubble.runtime.checkpoint import Checkpointing, complete_steps, load_stage, save_stage, stage_path
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import ActionKind, get_schedule
from unbubble.schedules.policy import CutPolicy, Cuts, resume_position
from unbubble.sim.costs import UniformCosts
from unbubble.sim.engine import run_policies
from helpers import tiny_gpt_config, tiny_gpt_job

torch.set_num_threads(1)

SCHEDULES = [("paci", 4, dict(a=2)), ("async-1f1b", 4, {}), ("1f1b-flush", 4, dict(m=2)), ("gpipe", 3, dict(m=3)),
             ("interleaved-1f1b", 2, dict(m=4, v=2)), ("looped-bfs", 2, dict(m=4, v=2)),
             ("interleaved-zb", 2, dict(m=4, v=2)), ("zb-h1", 4, dict(m=4)), ("zb-h2", 4, dict(m=4)),
             ("zbv", 2, dict(m=4)), ("dualpipev", 2, dict(m=4)), ("pipedream", 4, {}), ("pipedream-2bw", 4, dict(m=4)), ("pipemare", 4, {}), ("paci-stashed", 4, dict(a=2))]


def _equal_states(a, b) -> bool:
    return all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)


def _job(name, n, kw, directory, steps=12, **ck):
    return dataclasses.replace(tiny_gpt_job(get_schedule(name, n, steps, **kw)),
                               checkpoint=Checkpointing(str(directory), **ck))


# --- checkpoint and resume ---------------------------------------------------------------------
def test_resume_covers_every_registered_schedule():
    from unbubble.schedules.registry import SCHEDULES as REGISTERED

    assert sorted(s[0] for s in SCHEDULES) == sorted(REGISTERED)


@pytest.mark.parametrize("name,n,kw", SCHEDULES, ids=[s[0] for s in SCHEDULES])
def test_resumed_emulator_run_is_bit_identical(name, n, kw, tmp_path):
    job = _job(name, n, kw, tmp_path, every=4, keep=5)
    full = run_emulator(job)
    assert complete_steps(tmp_path, job.schedule.n_stages) == [4, 8, 12]
    for step in (4, 8):
        resumed = run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint,
                                                                                        resume_step=step)))
        assert _equal_states(resumed.final_states, full.final_states)
        assert resumed.step_losses == full.step_losses[step:]
        assert resumed.start_step == step
        # only the actions after the cut ran: every micro-batch id is ≥ step · mb_per_step
        assert min(r.action.mb for r in resumed.trace.records if r.action.mb is not None) == \
            step * job.schedule.mb_per_step


def test_cuts_drain_and_keep_the_drift_bound():
    """At a cut no forward after it starts before every backward before it has finished, and
    the drift bound ⌈(N−i)/a⌉ holds; the drain costs (N−1)(F+B) once per cut in the simulator."""
    sched = get_schedule("paci", 4, 12, a=2)
    cuts = Cuts(sched.mb_per_step, every=4)
    trace = run_policies(sched, UniformCosts(), policies=[CutPolicy(sched.policy(r), cuts) for r in range(4)])
    plain = run_policies(sched, UniformCosts())
    for step in (4, 8):
        k = step * sched.mb_per_step
        first_after = min(r.start for r in trace.records if r.action.kind is ActionKind.F and r.action.mb >= k)
        last_before = max(r.end for r in trace.records if r.action.mb is not None and r.action.mb < k)
        assert first_after >= last_before
    assert trace.max_drift() == [sched.drift_bound(s) for s in range(4)] == plain.max_drift()


@pytest.mark.parametrize("n,a", [(2, 1), (4, 2), (8, 4)])
def test_each_drain_costs_one_pipeline_fill(n, a):
    """Each cut costs (N−1)(F+B): the last stage waits for the refill (F=1, B=2 units)."""
    from unbubble.sim.result import simulate

    sched = get_schedule("paci", n, 12, a=a)
    plain = simulate(sched, UniformCosts()).trace.makespan
    drained = simulate(sched, UniformCosts(), checkpoint_every=4).trace.makespan  # cuts after updates 4 and 8
    assert drained - plain == 2 * (n - 1) * (1 + 2)


def test_resume_position_after_the_last_update_of_the_rank():
    sched = get_schedule("interleaved-1f1b", 2, 3, m=4, v=2)
    order = sched.static_order()
    pos = resume_position(order[0], [0, 2], 1)
    assert [a.kind for a in order[0][:pos]].count(ActionKind.U) == 2
    assert all(a.mb is None or a.mb >= 4 for a in order[0][pos:])
    with pytest.raises(ValueError, match="fewer than 4 updates"):
        resume_position(order[0], [0, 2], 4)


def test_stop_saves_at_the_next_boundary_and_resumes_like_a_run_with_that_cut(tmp_path):
    class StopAfter:
        def __init__(self, cuts, step):
            self.cuts, self.step = cuts, step

        def on_step(self, step, loss, info):
            if step == self.step:
                self.cuts.stop_requested = True

        def on_eval(self, version, loss):
            pass

    job = _job("paci", 4, dict(a=2), tmp_path / "a")
    cuts = job.cuts()
    stopped = run_emulator(job, listener=StopAfter(cuts, 5), cuts=cuts)
    t = stopped.stopped_at
    # the last stage reports step 5 while stage 0 is forwarding step 6's micro-batches
    assert t == 6 and len(stopped.step_losses) == t
    assert complete_steps(tmp_path / "a", 4) == [t]
    assert load_stage(tmp_path / "a", t, 0)["extra_cuts"] == [t]
    assert load_stage(tmp_path / "a", t, 0)["next_mb"] == t * 2
    reference = run_emulator(_job("paci", 4, dict(a=2), tmp_path / "b", extra_cuts=(t,)))
    resumed = run_emulator(_job("paci", 4, dict(a=2), tmp_path / "a", resume_step=t, extra_cuts=(t,)))
    assert _equal_states(resumed.final_states, reference.final_states)
    assert stopped.step_losses + resumed.step_losses == reference.step_losses


def test_checkpoint_files_are_atomic_and_pruned(tmp_path):
    for step in (1, 2, 3):
        for stage in (0, 1):
            save_stage(tmp_path, step, stage, {"x": torch.tensor([step])}, keep=2)
    assert complete_steps(tmp_path, 2) == [2, 3]
    assert not (tmp_path / "step-00000001").exists()
    assert not list(tmp_path.rglob(".*tmp*"))
    save_stage(tmp_path, 4, 0, {"x": torch.tensor([4])}, keep=2)  # stage 1 has not written step 4 yet
    assert complete_steps(tmp_path, 2) == [3]  # the newest complete checkpoint survives
    assert stage_path(tmp_path, 3, 0).exists() and not stage_path(tmp_path, 2, 0).exists()


def test_damaged_or_foreign_checkpoints_are_refused_before_running(tmp_path):
    job = _job("paci", 4, dict(a=2), tmp_path, every=4, keep=5)
    run_emulator(job)
    stage_path(tmp_path, 8, 2).write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be read"):
        run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume_step=8)))
    other_steps = _job("paci", 4, dict(a=4), tmp_path, every=4, resume_step=4)
    with pytest.raises(ConfigError, match="micro-batches per step=2 but this run has micro-batches per step=4"):
        run_emulator(other_steps)
    wider = dataclasses.replace(
        tiny_gpt_job(get_schedule("paci", 4, 12, a=2), config=dataclasses.replace(tiny_gpt_config(), n_embd=48)),
        checkpoint=Checkpointing(str(tmp_path), every=4, resume_step=4))
    with pytest.raises(ConfigError, match="another model"):
        run_emulator(wider)


# --- the non-finite guard ---------------------------------------------------------------------
D, BATCH, BAD = 5, 4, 7


def _stage(stage):
    torch.manual_seed(100 + stage)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh())


def _batch(bad, k):
    g = torch.Generator().manual_seed(k)
    x, y = torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)
    if k in bad:
        x[0, 0] = math.nan
    return x, y


def _weighted_mse(zero, out, y):
    """MSE; the micro-batch whose targets are marked with +1000 in [0, 0] counts zero."""
    loss = ((out - y) ** 2).mean()
    return loss * 0.0 if zero and y[0, 0] > 500 else loss


def _marked_batch(k):
    x, y = _batch((), k)
    if k == BAD:
        y[0, 0] = 1000.0
    return x, y


def _adam(params, stage):
    return torch.optim.Adam(params, lr=0.05)


def _mlp_job(schedule, batch_fn, loss_fn=functools.partial(_weighted_mse, False), **kw):
    return PipelineJob(stage_fn=_stage, loss_fn=loss_fn, batch_fn=batch_fn, optimizer_fn=_adam, schedule=schedule,
                       **kw)


@pytest.mark.parametrize("name,kw", [("paci", dict(a=2)), ("1f1b-flush", dict(m=3)), ("pipedream", {}),
                                     ("zb-h1", dict(m=3))])
def test_nan_micro_batch_contributes_nothing(name, kw):
    sched = get_schedule(name, 3, 8, **kw)
    guarded = run_emulator(_mlp_job(sched, functools.partial(_batch, {BAD})))
    reference = run_emulator(_mlp_job(sched, _marked_batch, loss_fn=functools.partial(_weighted_mse, True)))
    assert all(torch.isfinite(v).all() for st in guarded.final_states for v in st.values())
    for got, want in zip(guarded.final_states, reference.final_states):
        for k in got:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)
    # the last stage finds the NaN loss; every earlier stage drops the micro-batch in turn
    assert [(e["stage"], e["mb"], e["what"]) for e in guarded.events] == \
        [(2, BAD, "loss"), (1, BAD, "gradient from the next stage"), (0, BAD, "gradient from the next stage")]
    assert all(isinstance(e["version"], int) for e in guarded.events)


def test_guard_changes_nothing_on_a_clean_run():
    sched = get_schedule("paci", 3, 8, a=2)
    on = run_emulator(_mlp_job(sched, functools.partial(_batch, ())))
    off = run_emulator(_mlp_job(sched, functools.partial(_batch, ()), nan_policy="off"))
    assert _equal_states(on.final_states, off.final_states) and not on.events


def test_nan_policy_abort_names_stage_micro_batch_and_version():
    sched = get_schedule("paci", 3, 8, a=2)
    with pytest.raises(NonFiniteError, match=rf"stage 2: non-finite loss in micro-batch {BAD} at weight version 3"):
        run_emulator(_mlp_job(sched, functools.partial(_batch, {BAD}), nan_policy="abort"))


def test_nan_policy_lower_lr_scales_each_dropping_stage():
    sched = get_schedule("paci", 3, 8, a=2)
    job = _mlp_job(sched, functools.partial(_batch, {BAD, BAD + 3}), nan_policy="lower-lr", nan_lr_factor=0.25)
    result = run_emulator(job)
    assert [e["lr_factor"] for e in result.events if e["stage"] == 0] == [0.25, 0.0625]
    executors = [job.build_executor(s) for s in range(3)]
    assert executors[0].lr_factor == 1.0  # fresh executors are unaffected


def test_nan_guard_state_survives_a_checkpoint(tmp_path):
    sched = get_schedule("paci", 3, 8, a=2)
    job = _mlp_job(sched, functools.partial(_batch, {BAD}), nan_policy="lower-lr",
                   checkpoint=Checkpointing(str(tmp_path), every=4, keep=5))
    full = run_emulator(job)
    resumed = run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume_step=4)))
    assert load_stage(tmp_path, 4, 0)["executor"]["lr_factor"] == 0.5
    assert _equal_states(resumed.final_states, full.final_states)


def test_world_size_mismatch_under_torchrun_is_refused(monkeypatch):
    from unbubble.runtime.launch import run_torchrun

    monkeypatch.setenv("WORLD_SIZE", "3")
    job = tiny_gpt_job(get_schedule("paci", 4, 2, a=1))
    with pytest.raises(ConfigError, match=r"WORLD_SIZE=3 does not match dp × pipeline ranks = 1 × 4 = 4"):
        run_torchrun(job)


def test_guard_gives_up_when_every_micro_batch_is_non_finite():
    from unbubble.runtime.executor import MAX_DROPPED_UPDATES

    sched = get_schedule("paci", 3, 30, a=2)
    everything = set(range(sched.total_mb))
    with pytest.raises(NonFiniteError, match=rf"stage 2: every micro-batch of the last {MAX_DROPPED_UPDATES} "
                                             rf"updates had a non-finite loss or gradient \(weight version 9\)"):
        run_emulator(_mlp_job(sched, functools.partial(_batch, everything)))


def test_perplexity_of_a_diverged_run_is_reported_not_an_overflow():
    from unbubble.loggers import perplexity

    assert perplexity(math.log(20.0)) == pytest.approx(20.0)
    assert perplexity(1000.0) == perplexity(math.inf) == math.exp(50.0)  # was OverflowError in the CLI summary


def _dropout_stage(stage):
    torch.manual_seed(100 + stage)  # like many users' stage_fn: seeds the global RNG
    return nn.Sequential(nn.Linear(D, D), nn.Dropout(0.2), nn.Tanh())


def _val_batches():
    return [_batch((), k) for k in (10_000, 10_001)]


def test_resume_keeps_the_rng_stream_even_with_evaluations(tmp_path):
    """With dropout a resumed run is bit-identical: building the evaluation modules (whose
    stage_fn seeds the global RNG) does not touch the training RNG stream (regression)."""
    job = PipelineJob(stage_fn=_dropout_stage, loss_fn=functools.partial(_weighted_mse, False),
                      batch_fn=functools.partial(_batch, ()), optimizer_fn=_adam,
                      schedule=get_schedule("paci", 3, 12, a=2), val_fn=_val_batches, eval_interval=8,
                      checkpoint=Checkpointing(str(tmp_path), every=4, keep=5))
    full = run_emulator(job)
    resumed = run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume_step=4)))
    assert _equal_states(resumed.final_states, full.final_states)
    assert resumed.val_losses == [v for v in full.val_losses if v[0] > 4]


def test_the_training_rng_is_seeded_by_the_job(tmp_path):
    """Dropout masks depend on the job's seed only, not on what the process did before."""
    job = PipelineJob(stage_fn=_dropout_stage, loss_fn=functools.partial(_weighted_mse, False),
                      batch_fn=functools.partial(_batch, ()), optimizer_fn=_adam,
                      schedule=get_schedule("paci", 3, 6, a=2), seed=3)
    a = run_emulator(job)
    torch.rand(100)  # unrelated use of the global RNG in between
    b = run_emulator(job)
    c = run_emulator(dataclasses.replace(job, seed=4))
    assert _equal_states(a.final_states, b.final_states) and not _equal_states(a.final_states, c.final_states)


def test_a_stage_file_from_another_step_is_refused(tmp_path):
    import shutil

    job = _job("paci", 4, dict(a=2), tmp_path, every=4, keep=5)
    run_emulator(job)
    shutil.copy(stage_path(tmp_path, 4, 1), stage_path(tmp_path, 8, 1))
    with pytest.raises(ConfigError, match="stage-001.pt holds weight version 4, not 8: it belongs to another step"):
        run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume_step=8)))


class _NanGradOnce(torch.autograd.Function):
    """Identity whose backward returns NaN on its ``calls``-th call (counted per process)."""

    calls, bad = 0, 5

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _NanGradOnce.calls += 1
        return g * math.nan if _NanGradOnce.calls == _NanGradOnce.bad else g


class _NanGradLayer(nn.Module):
    def forward(self, x):
        return _NanGradOnce.apply(x)


def _nan_grad_stage(bad_stage, stage):
    torch.manual_seed(100 + stage)
    layers = [nn.Linear(D, D), nn.Tanh()]
    return nn.Sequential(*(layers + [_NanGradLayer()] if stage == bad_stage else layers))


@pytest.mark.parametrize("bad_stage,events", [
    (1, [(1, 4, "input gradient (this stage's update is dropped)"), (0, 4, "gradient from the next stage")]),
    (0, [(0, None, "accumulated weight gradient (this stage's update is dropped)")]),
])
def test_a_gradient_gone_bad_inside_a_stage_drops_that_stage_update(bad_stage, events):
    """A stage makes a NaN gradient for one micro-batch (its 5th backward): that stage's update
    becomes a zero gradient, earlier stages drop the micro-batch, later ones keep it; every
    weight stays finite. Stage 0 has no input gradient: its check is the update's."""
    _NanGradOnce.calls = 0
    job = PipelineJob(stage_fn=functools.partial(_nan_grad_stage, bad_stage),
                      loss_fn=functools.partial(_weighted_mse, False), batch_fn=functools.partial(_batch, ()),
                      optimizer_fn=_adam, schedule=get_schedule("paci", 3, 8, a=2))
    result = run_emulator(job)
    assert [(e["stage"], e["mb"], e["what"]) for e in result.events] == events
    assert all(torch.isfinite(v).all() for st in result.final_states for v in st.values())


@pytest.mark.parametrize("outer", ["a sweep's", "python's default"])
@pytest.mark.parametrize("when", ["at the last step", "in the final evaluation"])
def test_a_stop_that_cuts_nothing_short_reaches_the_callers_handler(outer, when):
    """Regression: a Ctrl-C at a run's last step, or during its final evaluation (after its last
    step boundary), stopped nothing and was swallowed by the run's handlers, so a sweep started its
    next run. It is now handed to the handler installed before the run; Python's default one is
    not called (the finished run keeps its results instead of ending in KeyboardInterrupt)."""
    import os
    import signal

    from unbubble.runtime.launch import install_stop_handlers
    from unbubble.train import run_job

    class Flag:
        stop_requested = False

    class Stop:
        def on_step(self, step, loss, info):
            if when == "at the last step" and step == 3:
                os.kill(os.getpid(), signal.SIGINT)

        def on_eval(self, version, loss):
            if when == "in the final evaluation" and version == 3:
                os.kill(os.getpid(), signal.SIGINT)

    job = tiny_gpt_job(get_schedule("paci", 2, steps=3, a=2))
    job = dataclasses.replace(job, val_fn=functools.partial(lambda b: [b(10_000)], job.batch_fn), eval_interval=3)
    flag, before = Flag(), signal.getsignal(signal.SIGINT)
    try:
        if outer == "a sweep's":
            install_stop_handlers(flag, announce=False)
        else:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        result = run_job(job, "emulator", Stop())
    finally:
        signal.signal(signal.SIGINT, before)
    assert result.stopped_at in (None, 3) and len(result.step_losses) == 3  # placed at the end, or after it
    assert flag.stop_requested == (outer == "a sweep's")
