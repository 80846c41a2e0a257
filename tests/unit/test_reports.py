"""Stage reports (runtime/reports.py): typed, picklable, still unpacking as (kind, stage, payload); the
launcher's collector, fed by a real run_stage in this process, gives the emulator's result bit for bit."""

import pickle

import pytest
import torch

from unbubble.runtime import reports as rp
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.launch import _Collector
from unbubble.runtime.worker import run_stage
from unbubble.schedules import get_schedule
from helpers import one_rank_world, tiny_gpt_job

torch.set_num_threads(1)


def test_every_report_pickles_and_unpacks_as_the_legacy_triple():
    cases = [(rp.Started(12.5), ("start", 0, 12.5)),
             (rp.Records(1, [("1F0", 0.0, 0.1, 0, 0)]), ("records", 1, [("1F0", 0.0, 0.1, 0, 0)])),
             (rp.StepLoss(3, 2.25), ("step_loss", 3, 2.25)),
             (rp.Snapshot(2, 4, b"w"), ("snapshot", 2, (4, b"w"))),
             (rp.Final(0, b"s", 1.5, {"state_bytes": 8}, {"param_bytes": 4}, {"clipped": 1}),
              ("final", 0, (b"s", 1.5, {"state_bytes": 8}, {"param_bytes": 4}, {"clipped": 1}))),
             (rp.Done(1, 2.0), ("done", 1, 2.0)),
             (rp.Event(2, {"mb": 7}), ("event", 2, {"mb": 7})),
             (rp.Stopped(0, 6), ("stopped", 0, 6)),
             (rp.Failed(3, "ValueError: x"), ("error", 3, "ValueError: x"))]
    for report, triple in cases:
        assert pickle.loads(pickle.dumps(report)) == report  # through the queue
        kind, stage, payload = report
        assert (kind, stage, payload) == triple


def test_the_collector_fed_by_run_stage_gives_the_emulators_result_bit_for_bit():
    """Two stages on one rank (interleaved, v = 2) in this process: every kind of report a primary
    rank sends reaches the collector, which dispatches on its type."""
    job = tiny_gpt_job(get_schedule("interleaved-1f1b", 1, 3, m=2, v=2), lr=0.05)
    reports: list = []
    with one_rank_world():
        assert run_stage(job, 0, reports.append) is None
    assert {type(r) for r in reports} == {rp.Started, rp.Records, rp.StepLoss, rp.Final}
    collector = _Collector(job, None)
    for report in reports:
        collector.handle(report)
    assert collector.complete
    got, emu = collector.result(), run_emulator(job)
    assert got.step_losses == emu.step_losses and len(got.step_losses) == 3
    for mine, theirs in zip(got.final_states, emu.final_states):
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert sorted(str(r.action) for r in got.trace.records) == sorted(str(r.action) for r in emu.trace.records)
    assert [m["param_bytes"] for m in got.memory] == [m["param_bytes"] for m in emu.memory]


def test_the_collector_refuses_what_is_not_a_report():
    with pytest.raises(TypeError, match=r"^a stage report of type tuple is not one of runtime/reports.py's$"):
        _Collector(tiny_gpt_job(get_schedule("1f1b-flush", 2, 1, m=2)), None).handle(("step_loss", 1, 2.0))
