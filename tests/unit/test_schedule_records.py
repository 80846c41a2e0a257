"""Each schedule's record (``ScheduleInfo`` in schedules/registry.py) against what its policy does:
every fact is read back from the action lists the schedule actually generates (its static lists, or
a dry run of its asynchronous policy on the simulator's clock) or from a closed form of the papers,
never from the record itself. And the record is the one place a schedule is described: no list of
schedule names is written anywhere else in the library, and a new record is all a new schedule needs."""

import ast
import math
from pathlib import Path

import pytest

import unbubble
from unbubble.errors import ConfigError
from unbubble.schedules import static
from unbubble.schedules.actions import ActionKind
from unbubble.schedules.clip import CLIP_SCOPES, SIM_SCOPES, check_clip, check_scope
from unbubble.schedules.registry import REGISTRY, SCHEDULES, ScheduleInfo, get_schedule
from unbubble.sim.barrier import GlobalOp
from unbubble.sim.costs import UniformCosts
from unbubble.sim.engine import run_policies

F, B, I, W, U = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W, ActionKind.U
N = 4  # m = 8 or 12 satisfies every schedule's sizes at N = 4 (interleaved: N | m, dualpipev: m ≥ 2N, 2bw: m ≥ N − 1)
NAMES = list(REGISTRY)


def _orders(sched, order: str = "deterministic") -> list[list]:
    """Per-rank action lists: the synchronous schedule's own, or a dry run of the asynchronous policy."""
    if not sched.asynchronous:
        return sched.static_order()
    costs = UniformCosts(1.0, 2.0)
    return run_policies(sched, costs, policies=[sched.policy(r, order) for r in range(sched.n_ranks)]).order()


def _per_stage(orders) -> dict[int, list]:
    out: dict[int, list] = {}
    for acts in orders:
        for a in acts:
            out.setdefault(a.stage, []).append(a)
    return out


#: The kinds that complete a micro-batch's weight gradient: a whole backward, or the W of a split one.
DONE = {B, W}


@pytest.mark.parametrize("name", NAMES)
def test_asynchronous_means_some_update_runs_with_micro_batches_in_flight(name):
    """Flushed: at every U of a stage, every micro-batch it ran forward has its weight gradient. Never
    flushed: some U of a stage lands while a micro-batch it ran forward still awaits its backward."""
    sched = get_schedule(name, N, 6, a=2, m=8)
    in_flight_at_an_update = False
    for acts in _per_stage(_orders(sched)).values():
        started, finished = set(), set()
        for a in acts:
            if a.kind is F:
                started.add(a.mb)
            elif a.kind in DONE:
                finished.add(a.mb)
            elif a.kind is U and started - finished:
                in_flight_at_an_update = True
    assert in_flight_at_an_update == REGISTRY[name].asynchronous


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("a,m", [(2, 8), (3, 12)])
def test_micro_batches_per_update_are_the_backwards_between_its_updates(name, a, m):
    sched = get_schedule(name, N, 5, a=a, m=m)
    counts = set()
    for acts in _per_stage(_orders(sched)).values():
        run = 0
        for act in acts:
            if act.kind in DONE:
                run += 1
            elif act.kind is U:
                counts.add(run)
                run = 0
    expected = REGISTRY[name].mb_per_update(a, m)
    assert counts == {expected} and sched.mb_per_step == expected


def test_train_configs_micro_batches_per_step_is_the_records():
    from unbubble.config import TrainConfig

    for name in NAMES:
        cfg = TrainConfig(schedule=name, stages=N, a=3, m=12, v=2, steps=4)
        assert cfg.mb_per_step == REGISTRY[name].mb_per_update(3, 12), name


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("option,values", [("a", (2, 4)), ("m", (8, 12)), ("v", (2, 3))])
def test_an_option_changes_the_schedule_exactly_when_the_record_says_it_takes_it(name, option, values):
    runs = []
    for value in values:
        kw = {"a": 2, "m": 8, "v": 2, option: value}
        sched = get_schedule(name, N, 3, **kw)
        runs.append((sched.n_stages, sched.mb_per_step, _orders(sched)))
    assert (runs[0] != runs[1]) == (option in REGISTRY[name].takes)


@pytest.mark.parametrize("name", NAMES)
def test_placement_and_chunks_are_the_stages_each_rank_runs(name):
    sched = get_schedule(name, N, 2, a=2, m=8, v=3)
    info = REGISTRY[name]
    held = [sorted({a.stage for a in acts}) for acts in _orders(sched)]
    assert len(held) == N
    if info.placement == "v":
        assert held == [sorted((r, 2 * N - 1 - r)) for r in range(N)]
    else:
        assert held == [list(range(r, N * info.chunks(3), N)) for r in range(N)]
    assert {len(h) for h in held} == {info.chunks(3)}


@pytest.mark.parametrize("name", NAMES)
def test_split_backward_is_input_and_weight_gradients_in_the_lists(name):
    kinds = {a.kind for acts in _orders(get_schedule(name, N, 2, a=2, m=8)) for a in acts}
    assert ({I, W} <= kinds) == REGISTRY[name].split_backward  # DualPipeV also runs whole B's
    assert not kinds & {I, W} or {I, W} <= kinds


def _delays(sched, order: str = "deterministic") -> dict[int, int]:
    """Stage -> the most updates it applied between a micro-batch's forward and its backward (τ)."""
    out = {}
    for stage, acts in _per_stage(_orders(sched, order)).items():
        version, at_forward, worst = 0, {}, 0
        for a in acts:
            if a.kind is U:
                version += 1
            elif a.kind is F:
                at_forward[a.mb] = version
            elif a.kind in (B, I):
                worst = max(worst, version - at_forward[a.mb])
        out[stage] = worst
    return out


@pytest.mark.parametrize("name", NAMES)
def test_the_stale_lag_is_ceil_n_over_a_and_covers_the_delay_the_policy_attains(name):
    """The policy's delay on 0-based stage i attains ⌈(N − 1 − i)/a⌉ (a = micro-batches per update; 0
    when flushed); the record's stale lag is ⌈N/a⌉ (1 when flushed), at most that delay bound + 1 and
    what the simulator's stale clip uses."""
    info = REGISTRY[name]
    for n, a in ((2, 1), (4, 1), (4, 2), (5, 2), (6, 4), (8, 3)):
        m = max(a, n - 1) if info.asynchronous else 2 * n  # pipedream-2bw: m ≥ N − 1; 2N fits every flushed one
        sched = get_schedule(name, n, 6 * n, a=a, m=m)
        mb = sched.mb_per_step
        lag = -(-sched.n_stages // mb) if info.asynchronous else 1  # ⌈N/a⌉, or 1 when flushed
        assert GlobalOp("stale").lag_for(sched) == lag == sched.stale_lag
        if not info.asynchronous:
            assert lag == 1 and set(_delays(sched).values()) == {0}, (n, a)
            continue
        bound = {i: math.ceil((n - 1 - i) / mb) for i in range(n)}
        assert _delays(sched) == bound, (n, a)
        assert lag == math.ceil(n / mb) and bound[0] <= lag <= bound[0] + 1, (n, a)


@pytest.mark.parametrize("name", [n for n in NAMES if REGISTRY[n].asynchronous])
def test_the_default_clip_scope_of_an_asynchronous_schedule_never_stalls_a_stage(name):
    """stale, the asynchronous default: on the simulator's clock no rank idles for the norm it clips by."""
    info = REGISTRY[name]
    assert info.default_clip_scope == "stale"
    sched = get_schedule(name, N, 24, a=2, m=4)
    trace = run_policies(sched, UniformCosts(1.0, 2.0), policies=[sched.policy(r, "deterministic") for r in range(N)],
                         global_op=GlobalOp(info.default_clip_scope))
    plain = run_policies(sched, UniformCosts(1.0, 2.0), policies=[sched.policy(r, "deterministic") for r in range(N)])
    assert max(trace.global_op_log.waits().values()) == 0.0
    assert trace.makespan == pytest.approx(plain.makespan)


def test_the_remedies_apply_where_updates_are_delayed_and_the_backward_weights_say_so():
    """Error feedback wherever the policy delays an update (τ > 0 on some stage); prediction only where the
    backward runs on the current weights, as the semantics line says ("current weights")."""
    for name, info in REGISTRY.items():
        delayed = max(_delays(get_schedule(name, N, 8, a=2, m=8)).values()) > 0
        assert info.error_feedback == delayed, name
        assert info.default_error_feedback == (1.0 if delayed else 0.0), name
        if delayed:
            words = {"current": "current weights", "stashed": "its F's version", "corrected": "corrected"}
            assert words[info.backward_weights] in info.semantics, name
        assert info.predicts == (delayed and info.backward_weights == "current"), name
        assert (info.delay_lr is not None) == ("lr rescheduling" in info.semantics), name  # PipeMare's T1


def test_the_clip_vocabulary_is_one_for_the_runtime_and_the_simulator():
    from unbubble.sim import barrier

    assert set(SIM_SCOPES) == {"none", *CLIP_SCOPES} and barrier.SCOPES is SIM_SCOPES
    for valid in (CLIP_SCOPES, SIM_SCOPES):
        with pytest.raises(ConfigError, match=r"^clip_scope='glob' is invalid: must be one of .*\(set --clip-scope\)$"):
            check_scope("glob", valid)
    with pytest.raises(ConfigError, match="post-validate' is refused"):
        check_clip(1.0, "post-validate")
    with pytest.raises(ConfigError, match=r"^clip_grad_norm=0 is invalid"):
        check_clip(0, "sync")


# -- one place ------------------------------------------------------------------------------------------------
#: Name lists that are an analysis's choice, not a fact of the schedules: the Zero Bubble paper's table
#: columns and short names, and the synchronous schedules the published break-even tables compare
#: (sim/extrapolate.py); the studies' methods (experiments/) and spelling aliases (errors.py) are skipped.
ANALYSES = {("sim/extrapolate.py", "COLUMNS"), ("sim/extrapolate.py", "SYNCHRONOUS"), ("sim/extrapolate.py", "_label")}


def test_no_module_writes_a_list_of_schedule_names_the_registry_could_answer():
    src = Path(unbubble.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if rel.startswith("experiments/") or rel in ("schedules/registry.py", "errors.py"):
            continue
        tree = ast.parse(path.read_text())
        owners = [n for n in ast.walk(tree) if (isinstance(n, ast.FunctionDef) and (rel, n.name) in ANALYSES)
                  or (isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and (rel, t.id) in ANALYSES
                                                        for t in n.targets))]
        allowed = {id(x) for n in owners for x in ast.walk(n)}
        for node in ast.walk(tree):
            items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else \
                node.keys if isinstance(node, ast.Dict) else None
            if not items or len(items) < 2 or id(node) in allowed:
                continue
            if all(isinstance(x, ast.Constant) and x.value in REGISTRY for x in items):
                found.append(f"{rel}:{node.lineno}")
    assert found == []


def test_a_new_schedule_is_one_record(monkeypatch):
    """Two records added at run time (a synchronous list and an asynchronous policy) are taken by
    the configuration, its defaults and checks, the simulator's labels and the lists of names."""
    from unbubble import config
    from unbubble.cli.simulate import _schedule
    from unbubble.sim.result import simulate

    sync = ScheduleInfo("gpipe-twin", "gpipe again", False, ("m",),
                        order=lambda r, v, m, steps: static.gpipe(r, m, steps))
    lazy = ScheduleInfo("paci-twin", "paci again (B on current weights)", True, ("a",))
    for info in (sync, lazy):
        monkeypatch.setitem(REGISTRY, info.name, info)
        monkeypatch.setitem(SCHEDULES, info.name, info.semantics)
    cfg = config.TrainConfig(schedule="PACI-twin", stages=N, a=3, steps=4, clip_grad_norm=1.0)
    assert (cfg.schedule, cfg.mb_per_step, cfg.error_feedback, cfg.clip_scope) == ("paci-twin", 3, 1.0, "stale")
    cfg = config.TrainConfig(schedule="gpipe-twin", stages=N, m=6, steps=4, clip_grad_norm=1.0)
    assert (cfg.mb_per_step, cfg.error_feedback, cfg.clip_scope) == (6, 0.0, "sync")
    with pytest.raises(ConfigError, match=r"whose micro-batches per step are --m: only paci, paci-stashed, paci-twin"):
        config.check_schedule_options(["gpipe-twin"], {"a": 2})
    with pytest.raises(ConfigError, match=r"error_feedback=1 is for asynchronous schedules \(.*, paci-twin\)"):
        config.TrainConfig(schedule="gpipe-twin", error_feedback=1)
    twin, reference = get_schedule("gpipe-twin", N, 2, m=6), get_schedule("gpipe", N, 2, m=6)
    assert twin.static_order() == reference.static_order()
    assert simulate(_schedule("paci-twin", N, 12, 3, 6, 2), UniformCosts()).label == "paci-twin (a=3)"
    assert simulate(twin, UniformCosts()).label == "gpipe-twin (m=6)"
    assert _delays(get_schedule("paci-twin", N, 12, a=1)) == _delays(get_schedule("async-1f1b", N, 12))


def test_the_old_name_lists_missed_schedules_now_answered_by_their_records(tmp_path):
    """Regressions of the hand-written lists: ``unbubble simulate --schedule paci-stashed`` and the Zero
    Bubble table's runner asked paci-stashed for --m (``a=None is invalid``); the simulator labelled it
    ``m=`` though it takes --a; ``unbubble report`` showed a looped-bfs run (missing from its list of
    synchronous schedules) with ``a=``."""
    from unbubble.cli.report import ReportRun, _describe
    from unbubble.cli.simulate import _schedule
    from unbubble.sim.result import simulate

    from unbubble.sim.extrapolate import _run
    from unbubble.sim.hardware import HARDWARE

    assert _run("paci-stashed", "zb-1.5b", 24, HARDWARE["a100-80g"], False).schedule.mb_per_step == 24
    sched = _schedule("paci-stashed", N, 12, 3, 8, 2)
    assert (sched.mb_per_step, sched.steps, sched.backward_weights) == (3, 4, "stashed")
    assert simulate(sched, UniformCosts()).label == "paci-stashed (a=3)"
    run = ReportRun(tmp_path, "run", {"schedule": "looped-bfs", "model": "tiny"},
                    {"schedule": "looped-bfs", "stages": N, "mb_per_step": 8}, [], [], None)
    assert _describe(run) == "tiny, looped-bfs, N=4, m=8"


def test_a_schedule_under_an_unregistered_name_is_refused_when_built():
    """Every reader of a Schedule looks its record up by name: a hand-built one with another name
    failed later with a bare KeyError (activation_bound, a job's per-stage lr)."""
    from unbubble.schedules.registry import Schedule
    from unbubble.sim.validate import activation_bound

    with pytest.raises(ConfigError, match=r"^Schedule\(name='custom'\) is not a registered schedule: valid names are "
                                          r"gpipe, .*\(build one with get_schedule\)$"):
        Schedule("custom", 2, 1, 2, True)
    built = Schedule("paci", 4, 2, 3, True)  # a registered name may be built by hand: PACI's bound q_i < N + 1 − i
    assert [activation_bound(built, s) for s in range(4)] == [4, 3, 2, 1]
