"""The engine's fast paths against the reference on seeded random schedules, costs and replayed orders.

[Note: engine fast paths] in ``sim/engine.py`` and [Note: compiled engine] in ``sim/kernel.py``: the
pure-Python fast path, the kernel run as plain Python and the numba-compiled kernel (when numba is
installed) must give the reference engine's trace row for row, hence the same makespan, per-stage busy
time, peak memory and drift histograms.
"""

import random

import numpy as np
import pytest

from unbubble.schedules import SCHEDULES, get_schedule
from unbubble.schedules.policy import ListPolicy
from unbubble.sim import PipelineCosts, StageCosts, Straggler, UniformCosts, kernel, run_policies
from unbubble.sim.memory import MemorySpec, peak_memory

try:
    import numba  # noqa: F401
    HAVE_NUMBA = True
except ImportError:
    HAVE_NUMBA = False

PATHS = ["python", "kernel-interpreted"] + (["compiled"] if HAVE_NUMBA else [])


def _use(monkeypatch, path):
    """Routes the engine's fast path through ``path``."""
    if path == "python":
        monkeypatch.setenv("UNBUBBLE_SIM_NUMBA", "0")
    elif path == "kernel-interpreted":
        monkeypatch.setattr(kernel, "compiled", lambda: kernel._kernel)
    else:
        monkeypatch.delenv("UNBUBBLE_SIM_NUMBA", raising=False)
        assert kernel.compiled() is not None


def _random_costs(rng: random.Random, n: int):
    """Unit-like costs with ties and zero-length actions, or per-stage costs with jitter and stragglers."""
    def x():
        return rng.choice([0.0, 0.5, 1.0, 1.0, 2.0, round(rng.uniform(0.1, 3.0), 3)])
    if rng.random() < 0.4:
        return UniformCosts(f=x() or 1.0, b=x() or 2.0, u=x(), latency=rng.choice([0.0, 0.0, 0.1, 0.5]),
                            i=x(), w=x())
    stragglers = tuple(Straggler(rng.randrange(n), rng.choice([0.5, 2.0, 3.0]), rng.uniform(0, 5), rng.uniform(6, 20))
                       for _ in range(rng.choice([0, 0, 1, 2])))
    return PipelineCosts(tuple(StageCosts(rng.uniform(0.2, 2), rng.uniform(0.2, 3), rng.uniform(0.1, 1.5),
                                          rng.uniform(0.0, 1.5), rng.choice([0.0, rng.uniform(0, 0.3)]))
                               for _ in range(n)),
                         latency_s=rng.choice([0.0, 0.01, 0.3]), jitter=rng.choice([0.0, 0.1, 0.5]),
                         seed=rng.randrange(1000), stragglers=stragglers)


def _random_schedule(rng: random.Random):
    name = rng.choice([s for s in SCHEDULES if s != "interleaved-1f1b"])
    n, x, steps = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 4)
    if name == "pipedream-2bw":
        x = max(x, n - 1)
    if name == "dualpipev":
        x = max(x, 2 * n)
    kw = {"paci": dict(a=x), "paci-stashed": dict(a=x), "async-1f1b": {}, "pipedream": {},
          "pipemare": {}}.get(name, dict(m=x))
    return get_schedule(name, n, steps=steps, **kw)


def _summary(trace, spec, stashed):
    mem = peak_memory(trace, spec, stashed=stashed)
    return (list(trace.rows()), trace.makespan, trace.busy_per_rank(), trace.drift_histogram(),
            [(m.activations, m.stash, m.peak, m.peak_in_flight, m.peak_versions) for m in mem])


def _cases():
    rng = random.Random(20)
    for case in range(80):
        sched = _random_schedule(rng)
        costs = _random_costs(rng, sched.n_stages)
        replay = rng.random() < 0.3  # replay the order another cost model produced (any valid order)
        yield pytest.param(case, sched, costs, replay, id=f"{case}-{sched.name}-N{sched.n_stages}")


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case,sched,costs,replay", list(_cases()))
def test_fast_paths_equal_the_reference_on_random_cases(monkeypatch, path, case, sched, costs, replay):
    n = sched.n_stages
    pols = None
    if replay:
        order = run_policies(sched, _random_costs(random.Random(case), n), fast=False).order()
        pols = [ListPolicy(o) for o in order]
    stashed = sched.backward_weights == "stashed"
    rng = random.Random(case)
    spec = MemorySpec.uniform(n, weights=1.0, act=rng.choice([1.0, 3.0]), act_w=0.5)
    if rng.random() < 0.5:
        spec = spec.with_recompute((0.25,) * n)
    ref = _summary(run_policies(sched, costs, policies=pols, fast=False), spec, stashed)
    _use(monkeypatch, path)
    if pols is not None:
        pols = [ListPolicy(p.actions) for p in pols]
    got = _summary(run_policies(sched, costs, policies=pols), spec, stashed)
    assert got[1:] == ref[1:]  # makespan, busy per stage, drift histograms, peak memory
    assert got[0] == ref[0]  # and the whole trace


def test_compiled_and_interpreted_kernel_agree_at_n32(monkeypatch):
    """A long jittered run (several sampler chunks per stream) through both forms of the kernel."""
    sched = get_schedule("zb-h1", 8, steps=20, m=64)  # 1,280 actions of each kind per stage
    costs = PipelineCosts(tuple(StageCosts(1.0 + 0.01 * s, 2.0, 1.0, 1.0, 0.05) for s in range(8)),
                          latency_s=0.01, jitter=0.1, seed=3)
    monkeypatch.setenv("UNBUBBLE_SIM_NUMBA", "0")
    python = list(run_policies(sched, costs).rows())
    monkeypatch.delenv("UNBUBBLE_SIM_NUMBA")
    monkeypatch.setattr(kernel, "compiled", lambda: kernel._kernel)
    interpreted = list(run_policies(sched, costs).rows())
    assert interpreted == python
    if HAVE_NUMBA:
        monkeypatch.undo()
        monkeypatch.delenv("UNBUBBLE_SIM_NUMBA", raising=False)
        assert list(run_policies(sched, costs).rows()) == python


def test_sampler_draws_equal_the_factors_drawn_one_by_one():
    costs = PipelineCosts(tuple(StageCosts(1.0, 2.0, 1.0, 1.0, 0.5) for _ in range(3)), jitter=0.2, seed=5)
    counts = np.array([[1025, 3, 0, 0, 2], [0, 0, 0, 0, 0], [7, 2048, 1, 1, 1]])
    factors, off = costs.noise(3).draws(counts)
    one = costs.noise(3)
    for s in range(3):
        for k in range(5):
            got = factors[off[5 * s + k]:off[5 * s + k] + counts[s, k]].tolist()
            assert [one(s, k, 0.0) for _ in range(counts[s, k])] == [one.table[s][k] * f for f in got]
    used = costs.noise(3)
    used(0, 0, 0.0)
    with pytest.raises(RuntimeError, match="fresh sampler"):
        used.draws(counts)


def test_kernel_is_skipped_for_foreign_noise(monkeypatch):
    """A cost model whose noise is not the built-in sampler runs on the pure-Python fast path."""
    class Doubling(UniformCosts):
        def noise(self, n_stages):
            return lambda s, k, t: 2.0 * self.table(n_stages)[s][k]
    sched = get_schedule("paci", 3, steps=2, a=2)
    costs = Doubling()
    assert kernel.prepare(3, 4, [], [], costs.table(3), costs.noise(3), [0.0] * 3, [0.0] * 3, False) is None
    assert list(run_policies(sched, costs).rows()) == list(run_policies(sched, costs, fast=False).rows())
    assert run_policies(sched, costs).makespan == 2 * run_policies(sched, UniformCosts()).makespan
