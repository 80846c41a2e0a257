"""Gradient clipping over the pipeline ([Note: clip scopes], [Note: stale lag] in docs/architecture.md):
sync against torch's clip_grad_norm_ on the unsplit model, the three scopes against closed forms, the
stale lag against the schedules' causality and the simulator's timeline, non-finite skips, resume."""

import copy
import dataclasses
import functools
import json
import math

import pytest
import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.runtime.checkpoint import Checkpointing
from unbubble.runtime.clipping import causal_lag
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules import get_schedule
from unbubble.schedules.registry import ASYNC, SCHEDULES
from unbubble.sim.costs import PipelineCosts, StageCosts
from unbubble.sim.engine import run_policies
from unbubble.testing import assert_resume_is_bit_identical
from helpers import one_rank_world, tiny_gpt_job

torch.set_num_threads(1)

# -- an unsplit model and its stages (slices of the same layers) ------------------------------------------
D_IN, WIDTH = 5, 8


def mlp(seed: int = 0, layers: int = 8) -> nn.Sequential:
    """The unsplit model: ``layers`` Linear+Tanh blocks, then a Linear head to 3 outputs."""
    torch.manual_seed(seed)
    mods: list[nn.Module] = [nn.Linear(D_IN, WIDTH), nn.Tanh()]
    for _ in range(layers - 2):
        mods += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    mods.append(nn.Linear(WIDTH, 3))
    return nn.Sequential(*mods)


def mlp_stage(n_stages: int, stage: int) -> nn.Module:
    """Stage ``stage`` of ``n_stages``: a contiguous slice of the unsplit model's modules (its own weights)."""
    mods = list(mlp().children())
    cuts = [round(i * len(mods) / n_stages) for i in range(n_stages + 1)]
    return copy.deepcopy(nn.Sequential(*mods[cuts[stage]:cuts[stage + 1]]))


def mlp_batch(k: int, bad: int | None = None):
    g = torch.Generator().manual_seed(1000 + k)
    x = torch.randn(4, D_IN, generator=g) * 3
    if k == bad:
        x[0, 0] = math.inf
    return x, torch.randint(0, 3, (4,), generator=g)


def _sgd(params, stage):
    return torch.optim.SGD([p for _, p in params], lr=0.2, momentum=0.9)


def mlp_job(schedule, max_norm=None, scope="sync", bad=None, **kw) -> PipelineJob:
    return PipelineJob(stage_fn=functools.partial(mlp_stage, schedule.n_stages), loss_fn=nn.functional.cross_entropy,
                       batch_fn=functools.partial(mlp_batch, bad=bad), optimizer_fn=_sgd, schedule=schedule,
                       clip_grad_norm=max_norm, clip_scope=scope, **kw)


def unsplit_reference(steps: int, m: int, max_norm: float, bad: int | None = None):
    """The unsplit model's own loop: m micro-batches per step (mean loss), torch's clip_grad_norm_
    over all its parameters, one SGD; a step whose norm is non-finite is skipped.

    Returns:
        ``(model, norms, skipped steps)``.
    """
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    norms, skipped = [], []
    for t in range(steps):
        for k in range(t * m, (t + 1) * m):
            x, y = mlp_batch(k, bad)
            (nn.functional.cross_entropy(model(x), y) * (1 / m)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        norms.append(float(norm))
        if torch.isfinite(norm):
            opt.step()
        else:
            skipped.append(t)
        opt.zero_grad(set_to_none=True)
    return model, norms, skipped


def _unsplit_state(model: nn.Sequential, n_stages: int) -> list[list[torch.Tensor]]:
    mods = list(model.children())
    cuts = [round(i * len(mods) / n_stages) for i in range(n_stages + 1)]
    return [list(nn.Sequential(*mods[cuts[s]:cuts[s + 1]]).state_dict().values()) for s in range(n_stages)]


@pytest.mark.parametrize("name,n,kw", [("1f1b-flush", 2, {"m": 4}), ("1f1b-flush", 4, {"m": 4}),
                                       ("gpipe", 3, {"m": 3}), ("zb-h1", 4, {"m": 4})])
def test_sync_equals_torch_clip_grad_norm_on_the_unsplit_model_bit_for_bit(name, n, kw):
    steps, max_norm = 5, 0.15
    model, norms, _ = unsplit_reference(steps, kw["m"], max_norm)
    assert all(x > max_norm for x in norms)  # the clip is active on every step
    result = run_emulator(mlp_job(get_schedule(name, n, steps, **kw), max_norm))
    for got, want in zip(result.final_states, _unsplit_state(model, n)):
        assert all(torch.equal(g, w) for g, w in zip(got.values(), want))  # exactly: max difference 0
    assert result.clip == {"scope": "sync", "max_norm": max_norm, "lag": None, "clipped": [steps] * n,
                           "skipped": [0] * n}


@pytest.mark.parametrize("name,kw", [("zbv", {"m": 4}), ("interleaved-1f1b", {"m": 4, "v": 2})])
def test_sync_with_two_stages_per_rank_equals_the_unsplit_model(name, kw):
    """Two stages per rank contribute together at the rank's first update of a step: still exactly
    torch's clip_grad_norm_ over the unsplit model (max difference 0)."""
    steps, max_norm = 4, 0.15
    sched = get_schedule(name, 2, steps, **kw)
    model, _, _ = unsplit_reference(steps, kw["m"], max_norm)
    result = run_emulator(mlp_job(sched, max_norm))
    for got, want in zip(result.final_states, _unsplit_state(model, sched.n_stages)):
        assert all(torch.equal(g, w) for g, w in zip(got.values(), want))
    assert result.clip["clipped"] == [steps] * sched.n_stages


def test_sync_on_the_gpt_equals_torch_clip_over_the_composed_stages():
    """The tiny GPT on 4 stages, SGD and AdamW: equal to one clip_grad_norm_ over all its parameters."""
    for optimizer in ("sgd", "adamw"):
        job = dataclasses.replace(tiny_gpt_job(get_schedule("1f1b-flush", 4, 3, m=4), optimizer=optimizer, lr=0.1),
                                  clip_grad_norm=0.5)
        stages = [job.stage_fn(s) for s in range(4)]
        opts = [job.optimizer_fn([p for p in m.parameters()], s) for s, m in enumerate(stages)]
        model = nn.Sequential(*stages)
        for t in range(3):
            for k in range(4 * t, 4 * t + 4):
                x, y = job.batch_fn(k)
                (job.loss_fn(model(x), y) * 0.25).backward()
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5) > 0.5
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
        result = run_emulator(job)
        for got, m in zip(result.final_states, stages):
            assert all(torch.equal(got[k], v) for k, v in m.state_dict().items()), optimizer


# -- closed forms: gradients that do not depend on the weights -----------------------------------------
DIM, ALPHA = 3, (1.0, 2.0, 0.5, 3.0)  # stage i's gradient is ALPHA[i] · (mean of its update's c_k)
NORMS = [3.0, 0.2, 5.0, 0.1, 4.0, 0.3, 6.0, 0.05, 2.0, 0.4]  # ‖mean c_k‖ of update t (a = 2)


class Shift(nn.Module):
    """out = x + α·b: the gradient of b is α times the gradient of the output, whatever b is."""

    def __init__(self, alpha: float):
        super().__init__()
        self.alpha = alpha
        self.b = nn.Parameter(torch.zeros(DIM))

    def forward(self, x):
        return x + self.alpha * self.b


def shift_stage(stage: int) -> nn.Module:
    return Shift(ALPHA[stage])


def direction(t: int) -> torch.Tensor:
    v = torch.tensor([1.0, -2.0, 0.5]) if t % 2 else torch.tensor([0.3, 0.4, -1.0])
    return v / v.norm()


def shift_batch(k: int):
    """c_k: the update's two micro-batches average to NORMS[t] · direction(t) (a = 2)."""
    t = k // 2
    c = NORMS[t] * direction(t) * (1.5 if k % 2 else 0.5)
    return torch.zeros(DIM), c


def linear_loss(out, c):
    return (out * c).sum()


def _plain_sgd(params, stage):
    return torch.optim.SGD([p for _, p in params], lr=1.0)


def expected_shift(scope: str, lag: int, steps: int, max_norm: float) -> tuple[list[torch.Tensor], list[int]]:
    """Hand computation: b_i = −Σ_t coef_{i,t} · α_i · NORMS[t] · direction(t), in float64."""
    n = len(ALPHA)
    alpha = torch.tensor(ALPHA, dtype=torch.float64)
    share = [math.sqrt(1 / n)] * n  # every stage has DIM parameters
    global_norm = [NORMS[t] * float(alpha.norm()) for t in range(steps)]
    out, clipped = [torch.zeros(DIM, dtype=torch.float64) for _ in range(n)], [0] * n
    for t in range(steps):
        for i in range(n):
            local = ALPHA[i] * NORMS[t]
            if scope == "sync":
                norm, thr = global_norm[t], max_norm
            elif scope == "stage" or t < lag:
                norm, thr = local, max_norm * share[i]
            else:
                norm, thr = global_norm[t - lag], max_norm
            coef = min(1.0, thr / (norm + 1e-6))
            clipped[i] += thr / (norm + 1e-6) < 1
            out[i] -= coef * ALPHA[i] * NORMS[t] * direction(t).double()
    return out, clipped


@pytest.mark.parametrize("scope", ["sync", "stale", "stage"])
def test_each_scope_clips_paci_by_the_norm_its_definition_names(scope):
    """PACI, N = 4, a = 2: s = ⌈4/2⌉ = 2, so update t ≥ 2 is clipped by the global norm of update
    t − 2 and updates 0, 1 by each stage's own norm against X·√(P_i/P) = X/2. The alternating norms
    make the lag visible: a lag of 1 or 3 would give other weights."""
    steps, max_norm = len(NORMS), 1.0
    sched = get_schedule("paci", 4, steps, a=2)
    assert sched.stale_lag == 2
    job = PipelineJob(stage_fn=shift_stage, loss_fn=linear_loss, batch_fn=shift_batch, optimizer_fn=_plain_sgd,
                      schedule=sched, clip_grad_norm=max_norm, clip_scope=scope)
    result = run_emulator(job)
    want, clipped = expected_shift(scope, 2, steps, max_norm)
    for s in range(4):
        got = result.final_states[s]["b"].double()
        assert torch.allclose(got, want[s], rtol=1e-6, atol=1e-6), (s, got, want[s])
        if scope == "stale":
            for other in (1, 3):
                assert not torch.allclose(got, expected_shift(scope, other, steps, max_norm)[0][s], atol=1e-2)
    assert result.clip["clipped"] == clipped and result.clip["skipped"] == [0] * 4
    assert result.clip["lag"] == (2 if scope == "stale" else None)
    if scope == "stale":
        assert result.clip["local"] == [2] * 4


# -- the lag: causality of the real orders, and the simulator's timeline ----------------------------------
def _async(name: str, n: int, a: int, steps: int = 12):
    if name in ("paci", "paci-stashed"):
        return get_schedule(name, n, steps, a=a)
    if name == "pipedream-2bw":
        return get_schedule(name, n, steps, m=a) if a >= n - 1 else None
    return get_schedule(name, n, steps) if a == 1 else None


@pytest.mark.parametrize("name", ASYNC)
def test_stale_lag_is_the_smallest_lag_the_orders_guarantee(name):
    """Vector clocks over each rank's action order: the smallest lag whose all-gather every rank
    has entered, whatever the timing, equals ⌈N/a⌉, for both orders."""
    for n in (2, 3, 4, 5, 8):
        for a in (1, 2, 3, 4, 8):
            sched = _async(name, n, a)
            if sched is None:
                continue
            for order in ("deterministic", "dynamic"):
                orders = run_policies(sched, PipelineCosts(tuple(StageCosts(1, 2, 1, 1) for _ in range(n))),
                                      policies=[sched.policy(r, order) for r in range(n)]).order()
                assert causal_lag(sched, orders) == sched.stale_lag == -(-n // a), (name, n, a, order)


def test_flushed_schedules_need_a_lag_of_one():
    for name in SCHEDULES:
        if name in ASYNC:
            continue
        kw = {"m": 8, "v": 2} if name in ("interleaved-1f1b", "looped-bfs", "interleaved-zb") else {"m": 8}
        sched = get_schedule(name, 4, 4, **kw)
        assert causal_lag(sched, sched.static_order()) == sched.stale_lag == 1, name


@pytest.mark.parametrize("n,a", [(4, 1), (4, 2), (8, 3), (8, 2), (5, 2)])
def test_on_the_simulators_jittered_timeline_no_update_waits_for_its_stale_norm(n, a):
    """Every stage's update t starts after every stage's update t − s started (its all-gather is in
    flight), with log-normal jitter, unequal stages and link latency. (That s − 1 is not guaranteed is
    the causal test above: on a given timeline a smaller lag may happen not to wait.)"""
    sched = get_schedule("paci", n, 40, a=a)
    s = sched.stale_lag
    for seed in range(3):
        costs = PipelineCosts(tuple(StageCosts(1.0 + 0.3 * (i % 3), 2.0 + 0.5 * (i % 2), 1, 1, 0.1) for i in range(n)),
                              latency_s=0.05, jitter=0.3, seed=seed)
        trace = run_policies(sched, costs, policies=[sched.policy(r, "deterministic") for r in range(n)])
        starts: dict[tuple[int, int], float] = {}
        for r in trace.records:
            if r.action.kind.value == "U":
                starts[(r.action.stage, r.version)] = r.start
        assert len(starts) == 40 * n
        for (i, t), start in starts.items():
            if t >= s:
                assert all(starts[(j, t - s)] <= start for j in range(n)), (i, t)


# -- the barrier never deadlocks, on every schedule ------------------------------------------------------
def test_sync_runs_every_schedule_to_the_end_on_the_emulator():
    for name in SCHEDULES:
        if name in ASYNC:
            sched = get_schedule(name, 3, 4, a=2) if name.startswith("paci") else \
                get_schedule(name, 3, 4, m=2) if name == "pipedream-2bw" else get_schedule(name, 3, 4)
        else:
            kw = {"m": 6, "v": 2} if name in ("interleaved-1f1b", "looped-bfs", "interleaved-zb") else {"m": 6}
            sched = get_schedule(name, 3, 2, **kw)
        layers = max(8, sched.n_stages + 1)
        job = dataclasses.replace(mlp_job(sched, 0.5), stage_fn=functools.partial(_deep_stage, sched.n_stages, layers),
                                  clip_grad_norm=0.01)
        result = run_emulator(job)
        assert result.clip["clipped"] == [sched.steps] * sched.n_stages, name


def _deep_stage(n_stages: int, layers: int, stage: int) -> nn.Module:
    mods = list(mlp(layers=layers).children())
    cuts = [round(i * len(mods) / n_stages) for i in range(n_stages + 1)]
    return copy.deepcopy(nn.Sequential(*mods[cuts[stage]:cuts[stage + 1]]))


# -- non-finite norms -----------------------------------------------------------------------------------
def test_a_non_finite_global_norm_skips_that_update_on_every_stage():
    """An inf in micro-batch 5 (update 1 of m = 4) with the guard off: every stage skips update 1,
    as the unsplit loop that skips a non-finite clip_grad_norm_; the other updates are exact."""
    steps, max_norm = 4, 0.15
    model, norms, skipped = unsplit_reference(steps, 4, max_norm, bad=5)
    assert skipped == [1] and not math.isfinite(norms[1])
    result = run_emulator(mlp_job(get_schedule("1f1b-flush", 4, steps, m=4), max_norm, bad=5, nan_policy="off"))
    for got, want in zip(result.final_states, _unsplit_state(model, 4)):
        assert all(torch.equal(g, w) for g, w in zip(got.values(), want))
    assert result.clip["skipped"] == [1] * 4 and result.clip["clipped"] == [3] * 4
    assert sorted((e["stage"], e["version"]) for e in result.events) == [(s, 1) for s in range(4)]


def test_stale_skips_at_once_locally_then_everywhere_when_the_global_norm_arrives():
    """PACI N = 4, a = 2 (s = 2), an inf in an input of micro-batch 4 (update 2): only stage 0's
    gradient is non-finite (tanh keeps the activations it sends finite). Stage 0 finds its own norm
    of update 2 non-finite and skips update 2 at once; the others apply theirs; the global norm of
    update 2 arrives non-finite at update 4, which every stage skips. The same with the guard on (it
    finds the accumulated gradient at the update and says so)."""
    sched = get_schedule("paci", 4, 7, a=2)
    for policy in ("off", "skip"):
        result = run_emulator(mlp_job(sched, 0.5, scope="stale", bad=4, nan_policy=policy))
        assert result.clip["skipped"] == [2, 1, 1, 1], policy
        skips = sorted((e["stage"], e["version"], e["what"].split(" (")[0]) for e in result.events
                       if e.get("policy") == "clip-stale")
        assert skips == [(0, 2, "its own gradient norm")] + [
            (s, 4, "the global gradient norm of update 2") for s in range(4)], policy
        assert all(torch.isfinite(v).all() for st in result.final_states for v in st.values())
        guard = [(e["stage"], e["version"]) for e in result.events if e.get("policy") == policy]
        assert guard == ([] if policy == "off" else [(0, 2)])


def test_the_guards_update_time_finding_becomes_a_global_skip_under_sync(monkeypatch):
    """A non-finite weight gradient that the guard (nan_policy skip) finds at stage 1's update 1
    skips that update on every stage, not only on the stage that found it."""
    from unbubble.runtime.executor import StageExecutor

    prepare = StageExecutor.prepare_update

    def poisoned(self):
        if self.stage == 1 and self.version == 1 and self._prepared != 1:
            self.grad_params[0].grad[0, 0] = math.inf
        prepare(self)

    monkeypatch.setattr(StageExecutor, "prepare_update", poisoned)
    result = run_emulator(mlp_job(get_schedule("1f1b-flush", 3, 3, m=2), 0.5))
    assert result.clip["skipped"] == [1, 1, 1]
    found = [e for e in result.events if e["what"].startswith("accumulated weight gradient")]
    assert [(e["stage"], e["version"]) for e in found] == [(1, 1)]
    assert sorted((e["stage"], e["version"]) for e in result.events if e not in found) == [(0, 1), (1, 1), (2, 1)]
    assert all(torch.isfinite(v).all() for st in result.final_states for v in st.values())


# -- resume ---------------------------------------------------------------------------------------------
def test_stale_resume_is_bit_identical_and_a_checkpoint_without_stale_norms_is_refused(tmp_path):
    """The pending norms of the last s updates are each stage's own and go into its checkpoint; the
    resumed run contributes them again before its first update."""
    sched = get_schedule("paci", 4, 8, a=2)
    job = dataclasses.replace(mlp_job(sched, 0.3, scope="stale"),
                              checkpoint=Checkpointing(str(tmp_path / "stale"), every=3, keep=10))
    assert_resume_is_bit_identical(job, 3)
    full = run_emulator(job)
    resumed = run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(job.checkpoint, resume_step=6)))
    assert resumed.clip["clipped"] == full.clip["clipped"]  # counted across the resume
    sync = dataclasses.replace(job, clip_scope="sync", checkpoint=Checkpointing(str(tmp_path / "sync"), every=3, keep=10))
    assert_resume_is_bit_identical(sync, 3)
    with pytest.raises(ConfigError, match=r"holds no gradient norms of updates 1–2, which clip_scope='stale' \(lag 2\)"):
        run_emulator(dataclasses.replace(job, checkpoint=dataclasses.replace(sync.checkpoint, resume_step=3)))


# -- configuration --------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,message", [
    ({"max_norm": 1.0, "scope": "post-validate"},
     "clip_scope='post-validate' is refused: under PACI later micro-batches' forwards already ran on the eagerly "
     "stepped weights"),
    ({"max_norm": 1.0, "scope": "global"}, "clip_scope='global' is invalid: must be one of sync, stale, stage"),
    ({"max_norm": 0.0}, "clip_grad_norm=0.0 is invalid: must be a finite number > 0 or unset"),
    ({"max_norm": math.nan}, "clip_grad_norm=nan is invalid"),
])
def test_bad_clip_settings_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")) as info:
        mlp_job(get_schedule("paci", 2, 2, a=2), **kw)
    assert "\n" not in str(info.value)


def test_summary_records_the_scope_and_counts(tmp_path):
    from unbubble.config import TrainConfig
    from unbubble.train import train

    cfg = TrainConfig(engine="emulator", steps=3, stages=2, a=2, eval_interval=0, eval_batches=1, clip_grad_norm=1e-3,
                      clip_scope="stale", run_dir=str(tmp_path / "run"), cache_dir=str(tmp_path / "cache"),
                      tensorboard=False, checkpoints=False)
    train(cfg)
    clip = json.loads((tmp_path / "run" / "summary.json").read_text())["clip"]
    assert clip == {"scope": "stale", "max_norm": 1e-3, "lag": 1, "clipped": [3, 3], "skipped": [0, 0],
                    "local": [1, 1]}  # update 0 has no global norm yet (s = ⌈2/2⌉ = 1)


def test_train_config_defaults_to_stale_or_sync_by_schedule_and_refuses_a_scope_without_a_threshold(tmp_path):
    from unbubble.config import TrainConfig

    assert TrainConfig(clip_grad_norm=1.0).clip_scope == "stale"  # paci: clip-study found stale free of loss
    assert TrainConfig(clip_grad_norm=1.0, schedule="1f1b-flush").clip_scope == "sync"
    from unbubble.config import config_to_yaml, load_config

    path = tmp_path / "c.yaml"  # the default is written auto and follows another --schedule
    path.write_text(config_to_yaml(TrainConfig(clip_grad_norm=1.0)))
    assert "clip_scope: auto" in path.read_text()
    assert load_config(path, overrides={"schedule": "zb-h2"}).clip_scope == "sync"
    assert TrainConfig().clip_scope is None
    with pytest.raises(ConfigError, match=r"^clip_scope='stale' has no effect without clip_grad_norm: set "
                                          r"--clip-grad-norm X, or drop --clip-scope$"):
        TrainConfig(clip_scope="stale")
    with pytest.raises(ConfigError, match=r"^clip_scope='post-validate' is refused"):
        TrainConfig(clip_grad_norm=1.0, clip_scope="post-validate")


# -- PipelineClip: the same scopes for a loop over torch's PipelineStage ----------------------------------
@pytest.fixture
def world_of_one():
    with one_rank_world():
        yield


def test_pipeline_clip_stale_lags_by_s_and_resumes_from_its_state(world_of_one):
    """A world of one, lag 2 given: update 0 and 1 clip by their own norm (share 1), update t ≥ 2 by
    the norm of update t − 2; a fresh object loaded from the state after update 3 continues exactly."""
    from unbubble.runtime.clipping import PipelineClip

    norms = [3.0, 0.5, 0.2, 4.0, 0.1, 2.0]
    params = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(2))]

    def run(clip, ts):
        out = []
        for t in ts:
            direction = torch.tensor([1.0, 2.0, 2.0, 0.0, 0.0]) / 3
            params[0].grad, params[1].grad = (norms[t] * direction[:3]).clone(), (norms[t] * direction[3:]).clone()
            got = clip(params)
            out.append((float(got), float(torch.cat([p.grad for p in params]).norm())))
        return out

    whole = run(PipelineClip(1.0, "stale", lag=2), range(6))
    for t, (by, after) in enumerate(whole):
        want_by = norms[t] if t < 2 else norms[t - 2]
        assert by == pytest.approx(want_by, rel=1e-6)
        assert after == pytest.approx(norms[t] * min(1.0, 1.0 / (want_by + 1e-6)), rel=1e-5)
    first = PipelineClip(1.0, "stale", lag=2)
    run(first, range(4))
    resumed = PipelineClip(1.0, "stale", lag=2)
    resumed.load_state_dict(first.state_dict(), params)
    assert run(resumed, range(4, 6)) == whole[4:]
    resumed.drain()
    first.drain()
    with pytest.raises(ConfigError, match="holds no gradient norms of updates 2–3"):
        PipelineClip(1.0, "stale", lag=2).load_state_dict({"step": 4, "recent": {}}, params)
    with pytest.raises(ConfigError, match=r"^clip_scope='post-validate' is refused"):
        PipelineClip(1.0, "post-validate", a=2)
