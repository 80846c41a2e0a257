"""The compiled kernel against the reference engine ([Note: engine fast paths] in docs/architecture.md,
[Note: compiled engine] in docs/architecture.md).

The simulator's semantics are written twice: ``_run_reference`` (the definition, and the path every run
takes without numba) and ``_kernel`` (flat arrays, numba). The kernel must give the reference's trace row
for row (every action's stage, kind, micro-batch, start and end seconds, versions), hence the same
makespan, busy time, drift histograms and memory peaks. ``_kernel`` runs compiled when numba is installed
and as plain Python (the same source) in every case.
"""

import random
import sys

import numpy as np
import pytest

from unbubble.schedules import SCHEDULES, get_schedule
from unbubble.schedules.policy import ListPolicy
from unbubble.schedules.registry import V_SHAPED, VIRTUAL
from unbubble.sim import PipelineCosts, StageCosts, Straggler, UniformCosts, kernel, run_policies
from unbubble.sim.memory import MemorySpec, peak_memory

try:
    import numba  # noqa: F401
    HAVE_NUMBA = True
except ImportError:
    HAVE_NUMBA = False

PATHS = ["interpreted"] + (["compiled"] if HAVE_NUMBA else [])


def _use(monkeypatch, path):
    """Routes the engine's kernel through ``path`` and returns a list that records, per kernel call,
    whether the kernel ran (so a test knows the engine did not fall back to the reference)."""
    monkeypatch.delenv("UNBUBBLE_SIM_NUMBA", raising=False)
    if path == "interpreted":
        monkeypatch.setattr(kernel, "compiled", lambda: kernel._kernel)
    else:
        assert kernel.compiled() is not None
    ran = []
    inner = kernel.run

    def run(*args):
        out = inner(*args)
        ran.append(out is not None)
        return out
    monkeypatch.setattr(kernel, "run", run)
    return ran


def _random_costs(rng: random.Random, n: int):
    """Unit-like costs with ties and zero-length actions, or random per-stage costs with latency, jitter
    and stragglers."""
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


def _random_schedule(rng: random.Random, name: str):
    """``name`` at a random N, steps and a or m (and v for the virtual schedules: 1 keeps one stage per
    rank, the kernel's case), redrawn until the registry accepts the combination."""
    for _ in range(100):
        n, x, steps = rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 4)
        kw = {"paci": dict(a=x), "paci-stashed": dict(a=x), "async-1f1b": {}, "pipedream": {},
              "pipemare": {}}.get(name, dict(m=x))
        if name in VIRTUAL:
            kw["v"] = rng.choice([1, 1, 2, 3])
        try:
            return get_schedule(name, n, steps=steps, **kw)
        except Exception:  # e.g. pipedream-2bw needs m ≥ N − 1, dualpipev m ≥ 2N
            continue
    raise AssertionError(f"no valid random shape of {name}")


def _random_memory(rng: random.Random, n: int) -> MemorySpec:
    act = tuple(rng.choice([1.0, 3.0, rng.uniform(0.5, 4.0)]) for _ in range(n))
    spec = MemorySpec(tuple(rng.uniform(0, 2) for _ in range(n)), (1.0,) * n, (2.0,) * n, act,
                      tuple(a * rng.choice([0.0, 0.5]) for a in act), tuple(rng.uniform(0.5, 2) for _ in range(n)))
    return spec.with_recompute(tuple(a / 4 for a in act)) if rng.random() < 0.4 else spec


def _summary(trace, spec, stashed):
    """Memory first (from the kernel's columns, before anything turns them into rows), then every row."""
    mem = peak_memory(trace, spec, stashed=stashed)
    return ([(m.activations, m.stash, m.peak, m.peak_in_flight, m.peak_versions) for m in mem], trace.makespan,
            trace.busy_per_rank(), trace.drift_histogram(), list(trace.rows()))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(SCHEDULES))
def test_kernel_equals_the_reference_over_the_registry(monkeypatch, path, name):
    """Every registered schedule at 8 random shapes (N 1–6, a or m 1–6, 1–4 steps, v 1–3), random stage
    costs (ties, zero-length actions, latency, jitter, stragglers) and memory sizes; 30 % of the cases
    replay, as static lists, the order another cost model produced. Exact equality of every row (start
    and end seconds included) and of the memory peaks. A rank that hosts several stages (v ≥ 2, the V
    shapes) is the reference's alone: there the engine must not run the kernel."""
    rng = random.Random(f"{name}-45")
    ran = _use(monkeypatch, path)
    on_kernel = 0
    for case in range(8):
        sched = _random_schedule(rng, name)
        n, costs = sched.n_stages, _random_costs(rng, sched.n_stages)
        pols = None
        if rng.random() < 0.3:
            order = run_policies(sched, _random_costs(rng, n), fast=False).order()
            pols = [ListPolicy(o) for o in order]
        stashed = sched.backward_weights == "stashed"
        spec = _random_memory(rng, n)
        ref = _summary(run_policies(sched, costs, policies=pols, fast=False), spec, stashed)
        del ran[:]
        got = _summary(run_policies(sched, costs, policies=pols and [ListPolicy(p.actions) for p in pols]),
                       spec, stashed)
        assert ran == ([True] if sched.n_ranks == n else []), (case, sched)
        on_kernel += bool(ran)
        where = (case, sched, costs)
        assert got[:4] == ref[:4], where  # memory peaks, makespan, busy per rank, drift histograms
        assert got[4] == ref[4], where  # every row: stage, kind, mb, start_s, end_s, versions
    assert on_kernel == 0 if name in V_SHAPED else on_kernel >= 2  # the virtual ones at v = 1


def test_compiled_and_interpreted_kernel_agree_with_the_reference_at_n8(monkeypatch):
    """A long jittered run (several sampler chunks per stream): reference, kernel as plain Python, and
    the compiled kernel when numba is installed."""
    sched = get_schedule("zb-h1", 8, steps=20, m=64)  # 1,280 actions of each kind per stage
    costs = PipelineCosts(tuple(StageCosts(1.0 + 0.01 * s, 2.0, 1.0, 1.0, 0.05) for s in range(8)),
                          latency_s=0.01, jitter=0.1, seed=3)
    ref = list(run_policies(sched, costs, fast=False).rows())
    for path in PATHS:
        ran = _use(monkeypatch, path)
        assert list(run_policies(sched, costs).rows()) == ref and ran == [True], path
        monkeypatch.undo()


def test_without_numba_every_run_takes_the_reference(monkeypatch):
    """The ``fast`` extra missing: ``import numba`` fails, the kernel reports itself off and the engine,
    ``simulate`` included, runs the reference (a row trace, no kernel columns) with the same result."""
    from unbubble.sim.result import simulate

    monkeypatch.delenv("UNBUBBLE_SIM_NUMBA", raising=False)
    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setattr(kernel, "_COMPILED", None)  # not built yet in this process
    assert kernel.compiled() is None
    sched = get_schedule("paci", 4, steps=3, a=2)
    costs = PipelineCosts(tuple(StageCosts(1.0, 2.0, 1.0, 1.0, 0.1) for _ in range(4)), jitter=0.2, seed=1)
    trace = run_policies(sched, costs)
    assert trace.columns() is None
    assert list(trace.rows()) == list(run_policies(sched, costs, fast=False).rows())
    spec = MemorySpec.uniform(4, weights=1.0, act=1.0)
    assert simulate(sched, costs, spec).summary() == simulate(sched, costs, spec).summary()
    assert kernel.run(4, 6, [], [[0.0] * 5] * 4, None, [0.0] * 4, [0.0] * 4, False) is None


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


@pytest.mark.parametrize("path", PATHS)
def test_kernel_is_skipped_for_foreign_noise_and_compound_actions(monkeypatch, path):
    """A cost model whose noise is not the built-in sampler (its draws cannot be taken ahead), and a list
    with a compound action (its two parts overlap: the reference scales them), run on the reference."""
    class Doubling(UniformCosts):
        def noise(self, n_stages):
            return lambda s, k, t: 2.0 * self.table(n_stages)[s][k]
    ran = _use(monkeypatch, path)
    sched = get_schedule("paci", 3, steps=2, a=2)
    costs = Doubling()
    assert kernel.prepare(3, 4, [], [], costs.table(3), costs.noise(3), [0.0] * 3, [0.0] * 3, False) is None
    assert list(run_policies(sched, costs).rows()) == list(run_policies(sched, costs, fast=False).rows())
    assert run_policies(sched, costs).makespan == 2 * run_policies(sched, UniformCosts()).makespan
    assert ran == [False, False, True]
    one = get_schedule("gpipe", 1, steps=1, m=2)
    acts = one.policy(0).actions  # F0 F1 B0 B1 U: F1 and B0 as one compound action
    overlapped = UniformCosts(f=1.0, b=2.0, overlap=1.0)
    trace = run_policies(one, overlapped, policies=[ListPolicy(acts, frozenset({1}))])
    assert trace.makespan == 1.0 + 2.0 + 2.0 < run_policies(one, overlapped).makespan  # F1 ∥ B0 saves F
    assert list(trace.rows()) == list(run_policies(one, overlapped, policies=[ListPolicy(acts, frozenset({1}))],
                                                   fast=False).rows())
