"""Real gloo processes, one per stage, against the emulator and a non-pipelined reference.

Each run spawns N processes (≈ 7 s to start on a 2-core machine), so runs are grouped:
one module, few spawns, each checked against an independent result.
"""

import dataclasses
import functools
import time

import pytest
import torch

from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.launch import PipelineFailure, run_processes
from unbubble.schedules import ActionKind, get_schedule
from unbubble.testing import train_without_pipeline
from helpers import tiny_gpt_config, tiny_gpt_job

pytestmark = pytest.mark.multiproc
torch.set_num_threads(1)  # as in each stage process, so the emulator's arithmetic matches bit for bit


@pytest.mark.parametrize("n", [2, 4])
def test_flush_processes_equal_non_pipelined_reference(n):
    job = tiny_gpt_job(get_schedule("1f1b-flush", n, steps=3, m=4))
    result = run_processes(job)
    ref_states, ref_losses = train_without_pipeline(job)
    for got, want in zip(result.final_states, ref_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)
    assert result.max_drift() == [0] * n


def test_paci_replay_is_bit_identical_to_emulator_and_live_run_respects_bound():
    n, a = 4, 2
    job = tiny_gpt_job(get_schedule("paci", n, steps=20, a=a))
    emu = run_emulator(job)
    replayed = run_processes(job, replay=emu.trace.order())
    for s, (e, p) in enumerate(zip(emu.final_states, replayed.final_states)):
        for name in e:
            assert torch.equal(e[name], p[name]), f"stage {s} {name} differs"
    assert replayed.step_losses == emu.step_losses
    assert replayed.trace.order() == emu.trace.order()
    assert replayed.max_drift() == emu.max_drift() == [2, 1, 1, 0]


def test_compiled_paci_processes_replay_the_eager_emulator_bit_identically():
    """--compile with the process engine: each stage process compiles its own stage (aot_eager runs
    the same aten ops), and a replay of the eager emulator's order gives its weights bit for bit."""
    import dataclasses

    job = tiny_gpt_job(get_schedule("paci", 2, steps=6, a=2))
    emu = run_emulator(job)
    replayed = run_processes(dataclasses.replace(job, compile_backend="aot_eager"), replay=emu.trace.order())
    for e, p in zip(emu.final_states, replayed.final_states):
        assert all(torch.equal(e[name], p[name]) for name in e)
    assert replayed.step_losses == emu.step_losses


def test_paci_default_order_is_reproducible_and_equals_the_emulator():
    """[Note: deterministic order]: two live runs (no replay) give the same losses and weights,
    bit for bit, and both equal the emulator's run; with dropout 0.1 too, since every forward draws
    from a stream seeded by its stage and micro-batch ([Note: random numbers per micro-batch])."""
    n, a = 4, 2
    config = dataclasses.replace(tiny_gpt_config(), dropout=0.1)
    job = tiny_gpt_job(get_schedule("paci", n, steps=12, a=a), config=config)
    assert job.order == "deterministic"
    emu = run_emulator(job)
    without = run_emulator(tiny_gpt_job(get_schedule("paci", n, steps=12, a=a)))
    assert min(abs(x - y) for x, y in zip(emu.step_losses, without.step_losses)) > 1e-4  # dropout acts
    first, second = run_processes(job), run_processes(job)
    for live in (first, second):
        assert live.step_losses == emu.step_losses
        assert live.trace.order() == emu.trace.order()
        for s, (e, p) in enumerate(zip(emu.final_states, live.final_states)):
            for name in e:
                assert torch.equal(e[name], p[name]), f"stage {s} {name} differs"
        assert live.max_drift() == [get_schedule("paci", n, 1, a=a).drift_bound(s) for s in range(n)] == [2, 1, 1, 0]
    assert len(first.step_losses) == 12


def test_live_paci_processes_in_dynamic_order_attain_drift_bound():
    n, a = 4, 1
    sched = get_schedule("paci", n, steps=16, a=a)
    live = run_processes(dataclasses.replace(tiny_gpt_job(sched), order="dynamic"))
    # ⌈(N−i)/a⌉ from the telemetry of real arrivals: never exceeded, and attained
    assert live.max_drift() == [sched.drift_bound(s) for s in range(n)] == [3, 2, 1, 0]
    assert len(live.step_losses) == 16


def _boom(params, stage):
    if stage == 1:
        raise ValueError("optimizer for stage 1 cannot be built")
    return torch.optim.SGD(params, lr=0.1)


def test_a_failing_stage_stops_the_run_with_its_message():
    job = tiny_gpt_job(get_schedule("paci", 2, steps=2, a=1))
    job.optimizer_fn = _boom
    with pytest.raises(PipelineFailure, match="stage 1 failed: ValueError: optimizer for stage 1 cannot be built"):
        run_processes(job, timeout_s=30)


@pytest.mark.parametrize("name,kw", [("gpipe", {}), ("interleaved-1f1b", {"v": 2}), ("zb-h1", {}), ("zb-h2", {}),
                                     ("zbv", {}), ("dualpipev", {})])
def test_synchronous_schedules_across_processes_equal_reference(name, kw):
    job = tiny_gpt_job(get_schedule(name, 2, steps=2, m=4, **kw))
    result = run_processes(job)
    ref_states, ref_losses = train_without_pipeline(job)
    for got, want in zip(result.final_states, ref_states):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7, msg=key)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)


def test_stashing_and_pipemare_processes_replay_bit_identically():
    for name in ("pipedream", "pipemare"):
        job = tiny_gpt_job(get_schedule(name, 3, steps=6))
        emu = run_emulator(job)
        proc = run_processes(job, replay=emu.trace.order())
        for e, p in zip(emu.final_states, proc.final_states):
            assert all(torch.equal(e[k], p[k]) for k in e), name
        assert proc.max_drift() == emu.max_drift()
        assert proc.trace.max_delay() == [2, 1, 0]


def _concatenated(batch_fn, dp, k):
    """Micro-batch k of one replica with dp times the batch: data ids k·dp … k·dp + dp − 1."""
    parts = [batch_fn(k * dp + d) for d in range(dp)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def test_two_replicas_of_two_stages_equal_one_replica_with_twice_the_batch():
    # 2 × 2 processes: replicas all-reduce their gradients at each U, replica d reads data
    # ids k·2 + d. SGD, because AdamW normalises gradients that are exactly zero in theory
    # (attention key biases) and rounding noise in practice, so a batched reference differs
    # by more than rtol there; the gradients themselves agree.
    sched = get_schedule("1f1b-flush", 2, steps=3, m=4)
    job = tiny_gpt_job(sched, optimizer="sgd", lr=0.1)
    job.dp = 2
    result = run_processes(job)
    ref = tiny_gpt_job(sched, optimizer="sgd", lr=0.1)
    ref.batch_fn = functools.partial(_concatenated, job.batch_fn, 2)
    ref_states, ref_losses = train_without_pipeline(ref)
    for got, want in zip(result.final_states, ref_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)
    assert result.tokens == 2 * sched.total_mb  # samples of both replicas (tokens_per_mb unset)
    assert len(result.trace) == sum(len(acts) for acts in sched.static_order())  # replica 0's actions


def _varying_tokens(vocab_size: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch k with its own shape: sequence lengths 2, 3, … 16 (growing), then 15, 14, …
    (shrinking), and batch size 2 or 3."""
    seq_len = 2 + k if k < 15 else max(31 - k, 1)
    g = torch.Generator().manual_seed(k)
    t = torch.randint(0, vocab_size, (2 + k % 2, seq_len + 1), generator=g)
    return t[:, :-1], t[:, 1:]


def test_micro_batches_of_growing_and_shrinking_shapes_equal_the_emulator_bit_for_bit():
    # [Note: shapes travel with each frame]: the channels' capacities grow (announced), then
    # payloads shrink inside them
    job = tiny_gpt_job(get_schedule("paci", 3, steps=12, a=2))
    job.batch_fn = functools.partial(_varying_tokens, 64)
    emu = run_emulator(job)
    proc = run_processes(job, replay=emu.trace.order())
    for s, (e, p) in enumerate(zip(emu.final_states, proc.final_states)):
        for name in e:
            assert torch.equal(e[name], p[name]), f"stage {s} {name} differs"
    assert proc.step_losses == emu.step_losses and len(proc.step_losses) == 12


class _StepInfo:
    def __init__(self):
        self.last = None
        self.seen_at = None

    def on_step(self, step, loss, info):
        self.last, self.seen_at = info, time.time()

    def on_eval(self, version, loss):
        pass


def test_the_step_lines_tokens_per_s_excludes_start_up_and_counts_the_steps_done():
    # with the start-up counted (≈ 5 s of spawning before ≈ 2 s of training) the step line's figure
    # was 3× the run's. Checked on clocks that cannot race: the step line's elapsed time starts at the
    # stages' shared training start (the run's own t0: its first step's end less that step's
    # recorded end), not at the call, and its tokens/s is the steps done over that time
    job = tiny_gpt_job(get_schedule("paci", 2, steps=30, a=4))
    job.tokens_per_mb = 2 * 16
    steps = _StepInfo()
    called = time.time()
    result = run_processes(job, listener=steps)
    first_u = max(min(r.end for r in result.trace.records if r.action.kind is ActionKind.U and r.action.stage == s)
                  for s in (0, 1))
    t0 = result.first_step_end - first_u
    assert t0 > called
    # event order, no tolerance on a duration: the telemetry read the clock (elapsed = then − its
    # start) before the listener did (seen_at), so seen_at − elapsed ≥ its start, which must be the
    # stages' t0; a start taken at the call (seconds of spawning earlier) fails this
    assert steps.seen_at - steps.last["elapsed_s"] >= t0 - 1e-3
    assert steps.last["tok_per_s"] == pytest.approx(30 * 4 * 2 * 16 / steps.last["elapsed_s"], rel=1e-12)
