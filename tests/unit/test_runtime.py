"""Executor and emulator against independent references (docs/architecture.md#testing, layers 2 and 3)."""


import pytest
import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.executor import StageExecutor
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.versions import SavedByReference
from unbubble.schedules import ActionKind, get_schedule
from unbubble.testing import train_without_pipeline
from helpers import tiny_gpt_job

torch.set_num_threads(1)


def _assert_states_close(got, want, rtol=1e-5, atol=1e-7):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for name in g:
            torch.testing.assert_close(g[name], w[name], rtol=rtol, atol=atol, msg=name)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_flush_equals_non_pipelined_reference(n, optimizer):
    job = tiny_gpt_job(get_schedule("1f1b-flush", n, steps=3, m=4), optimizer=optimizer)
    result = run_emulator(job)
    ref_states, ref_losses = train_without_pipeline(job)
    _assert_states_close(result.final_states, ref_states)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)
    assert result.max_drift() == [0] * n


# --- PACI against a sequential delayed reference written with explicit math -------------
D, BATCH = 6, 3


def _mlp_stage(stage):
    torch.manual_seed(1000 + stage)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh())


def _mlp_batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _sgd(params, stage):
    return torch.optim.SGD(params, lr=0.2)


def _delayed_reference(job, records, gamma=0.9):
    """Replays recorded actions with hand-written forward/backward of tanh(x Wᵀ + b).

    Forward of (s, k) uses the weights of version v_F. The backward's input gradient uses
    the current version (PACI), the forward's version (stashed: PipeDream, 2BW) or the current
    version moved back by Δ·δ (PipeMare T2, δ the EMA of weight changes); the weight gradient
    uses the forward-time activations (x, y). PipeMare's SGD learning rate is scaled by T1:
    τ^−(1 − min((u+1)/K, 1)) for update u + 1. Every version is kept, so the check does not depend on in-place tricks.
    """
    n = job.schedule.n_stages
    mode = job.schedule.backward_weights
    anneal = max(job.schedule.steps // 10, 1)
    versions = [[(m[0].weight.detach().clone(), m[0].bias.detach().clone())] for m in map(_mlp_stage, range(n))]
    velocity = [(torch.zeros(D, D), torch.zeros(D)) for _ in range(n)]
    grads = [[torch.zeros(D, D), torch.zeros(D)] for _ in range(n)]
    saved, msgs, vf = {}, {}, {}
    for rec in records:
        a, s = rec.action, rec.action.stage
        if a.kind is ActionKind.F:
            x = _mlp_batch(a.mb)[0] if s == 0 else msgs.pop(("act", s, a.mb))
            w, b = versions[s][rec.version]
            y = torch.tanh(x @ w.T + b)
            saved[(s, a.mb)] = (x, y)
            vf[(s, a.mb)] = rec.version
            if s < n - 1:
                msgs[("act", s + 1, a.mb)] = y
        elif a.kind is ActionKind.B:
            x, y = saved.pop((s, a.mb))
            if s == n - 1:
                gy = 2 * (y - _mlp_batch(a.mb)[1]) / y.numel() * job.schedule.loss_scale
            else:
                gy = msgs.pop(("grad", s, a.mb))
            drift = len(versions[s]) - 1 - vf[(s, a.mb)]
            w_now = versions[s][vf[(s, a.mb)] if mode == "stashed" else -1][0]
            if mode == "corrected":
                w_now = w_now - drift * velocity[s][0]
            gz = gy * (1 - y * y)
            grads[s][0] += gz.T @ x
            grads[s][1] += gz.sum(0)
            if s > 0:
                msgs[("grad", s - 1, a.mb)] = gz @ w_now
        else:
            w, b = versions[s][-1]
            lr = 0.2
            if mode == "corrected":
                tau, u = n - 1 - s, len(versions[s]) - 1
                lr *= 1.0 if tau <= 1 else tau ** -(1 - min((u + 1) / anneal, 1.0))
            new = (w - lr * grads[s][0], b - lr * grads[s][1])
            velocity[s] = tuple(gamma * v + (1 - gamma) * (nw - ow) for v, nw, ow in zip(velocity[s], new, (w, b)))
            versions[s].append(new)
            grads[s] = [torch.zeros(D, D), torch.zeros(D)]
    return versions


@pytest.mark.parametrize("name,a", [("paci", 1), ("paci", 2), ("paci", 4), ("paci-stashed", 2), ("pipedream", None),
                                    ("pipedream-2bw", None), ("pipemare", None)])
def test_async_schedules_equal_delayed_reference(name, a):
    n = 4
    job = PipelineJob(_mlp_stage, _mse, _mlp_batch, _sgd, get_schedule(name, n, steps=12, a=a, m=4))
    result = run_emulator(job)
    assert max(result.sim_trace.delays().values()) >= 1  # the check distinguishes weight versions
    versions = _delayed_reference(job, result.sim_trace.records)
    for s in range(n):
        w, b = versions[s][-1]
        torch.testing.assert_close(result.final_states[s]["0.weight"], w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result.final_states[s]["0.bias"], b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("a", [1, 2, 4])
def test_paci_drift_bound_attained_with_real_executors(a):
    n = 4
    job = tiny_gpt_job(get_schedule("paci", n, steps=6, a=a))
    result = run_emulator(job)
    bound = [-(-(n - 1 - s) // a) for s in range(n)]
    assert result.max_drift() == bound
    assert result.sim_trace.max_drift() == bound


def test_backward_uses_current_weights_and_forward_time_activations():
    lin = nn.Linear(3, 2, bias=False)
    ex = StageExecutor(1, 3, lin, None, lambda k: (None, None), torch.optim.SGD(lin.parameters(), lr=0.5), 1.0)
    act = torch.tensor([[1.0, 2.0, 3.0]])
    w_old = lin.weight.detach().clone()
    ex.forward(0, act)
    lin.weight.grad = torch.ones(2, 3)
    ex.update()  # in place: W ← W − 0.5
    w_new = lin.weight.detach().clone()
    assert torch.equal(w_new, w_old - 0.5)
    g = torch.tensor([[1.0, -2.0]])
    gx = ex.backward(0, g)
    torch.testing.assert_close(gx, g @ w_new)  # input gradient: current weights
    assert not torch.allclose(gx, g @ w_old)
    torch.testing.assert_close(lin.weight.grad, g.T @ act)  # weight gradient: forward-time input
    assert ex.version == 1


def test_stock_pytorch_refuses_without_the_saved_tensor_hooks():
    """[Note: backward on current weights]: stock autograd refuses a backward after an in-place update of a saved
    weight; under SavedByReference it runs on the current weights, and a saved activation modified in place is
    still refused at its backward. Hooks already active outside still run (a counter sees every saved tensor)."""
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    out = lin(x).sum()
    with torch.no_grad():
        lin.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()
    hooks = SavedByReference(lin.parameters())
    with hooks():
        out = lin(x).sum()
    with torch.no_grad():
        lin.weight.add_(1.0)
    out.backward()  # the current weights: the input gradient is W_new summed over outputs
    assert torch.equal(x.grad, lin.weight.detach().sum(0).expand(2, 3))
    a = torch.randn(3, requires_grad=True)
    with hooks():
        e = a.exp()
        w = (e * e).sum()
    with torch.no_grad():
        e.add_(1.0)
    with pytest.raises(RuntimeError, match=r"^a tensor of shape \(3,\) saved by the stage's forward was modified in place "
                                           r"before its backward \(version 0 → 1\); only the stage's parameters may "
                                           r"change between a forward and its backward$"):
        w.backward()
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t), hooks():
        out = lin(x).sum()
    with torch.no_grad():
        lin.weight.add_(1.0)
    out.backward()
    assert any(t.untyped_storage().data_ptr() == lin.weight.untyped_storage().data_ptr() for t in seen)


def test_no_weight_copies_in_saved_activations():
    """Every saved tensor that looks like a parameter *is* the parameter (same storage)."""
    job = tiny_gpt_job(get_schedule("paci", 2, steps=2, a=2))
    ex = job.build_executor(0)
    params = {p.untyped_storage().data_ptr(): p for p in ex.module.parameters()}
    param_bytes = sum(p.numel() * p.element_size() for p in ex.module.parameters())
    copies, shared = [], 0

    def pack(t):
        nonlocal shared
        if t.untyped_storage().data_ptr() in params:
            shared += 1
        elif any(t.shape == p.shape and torch.equal(t, p) for p in params.values()):
            copies.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for k in range(3):
            ex.forward(k)
    assert copies == []
    assert shared > 0
    # in-flight forwards hold activations only: the stage's parameter bytes are unchanged
    assert sum(p.numel() * p.element_size() for p in ex.module.parameters()) == param_bytes
    assert len(list(ex.module.parameters())) == len(params)


def test_emulator_is_deterministic():
    job = tiny_gpt_job(get_schedule("paci", 3, steps=4, a=2))
    r1, r2 = run_emulator(job), run_emulator(job)
    for s1, s2 in zip(r1.final_states, r2.final_states):
        assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert r1.trace.order() == r2.trace.order()


SYNC = [("gpipe", {}), ("interleaved-1f1b", {"v": 2}), ("looped-bfs", {"v": 2}), ("interleaved-zb", {"v": 2}),
        ("zb-h1", {}), ("zb-h2", {}), ("zbv", {}), ("dualpipev", {})]
# 4 ranks × 2 chunks would need 8 layers; the tiny model has 4: schedules with v chunks (and the V-shaped
# zbv and dualpipev, 2 chunks) run on 2 ranks.
# looped-bfs runs each stage's backwards in reverse micro-batch order (as torch), so its gradients are
# summed in another order than the reference's: AdamW turns that rounding (≈ 1e-10) on gradients that are
# zero in theory (attention key biases) into differences above rtol, SGD does not. With AdamW it equals,
# bit for bit, the reference summed in its order (test_schedules_torch.py).
SYNC_CASES = [(name, kw, n, "sgd" if name == "looped-bfs" else "adamw") for name, kw in SYNC
              for n in ([2] if "v" in kw or name in ("zbv", "dualpipev") else [2, 4])]


@pytest.mark.parametrize("name,kw,n,optimizer", SYNC_CASES)
def test_synchronous_schedules_equal_non_pipelined_reference(name, kw, n, optimizer):
    job = tiny_gpt_job(get_schedule(name, n, steps=3, m=4, **kw), optimizer=optimizer)
    result = run_emulator(job)
    ref_states, ref_losses = train_without_pipeline(job)
    _assert_states_close(result.final_states, ref_states)
    assert result.step_losses == pytest.approx(ref_losses, rel=1e-5)


@pytest.mark.parametrize("name,bound", [("pipedream", lambda n, s: n - s), ("pipedream-2bw", lambda n, s: 2),
                                        ("paci-stashed", lambda n, s: -(-(n - 1 - s) // 2) + 1)])
def test_stashed_weight_versions_are_counted_and_bounded(name, bound, monkeypatch):
    n = 4
    peak: dict[int, int] = {}
    forward = StageExecutor.forward

    def counting_forward(self, k, activation=None):
        out = forward(self, k, activation)
        peak[self.stage] = max(peak.get(self.stage, 0), self.live_versions)
        return out

    monkeypatch.setattr(StageExecutor, "forward", counting_forward)
    result = run_emulator(tiny_gpt_job(get_schedule(name, n, steps=8, m=4, a=2)))
    assert result.max_drift() == [0] * n  # every backward on its forward's version
    # τ_i = N−i (PipeDream), 1 (2BW), ⌈(N−i)/a⌉ with a = 2 (PACI's schedule with stashing)
    assert result.trace.max_delay() == {"pipedream": [3, 2, 1, 0], "pipedream-2bw": [1, 1, 1, 0],
                                        "paci-stashed": [2, 1, 1, 0]}[name]
    assert all(peak[s] <= bound(n, s) for s in range(n))
    assert peak[0] == bound(n, 0)  # the bound is reached


def test_process_start_and_memory_against_independent_readings():
    """``process_start_epoch`` of a child lies between its launch and its own clock reading;
    ``process_memory``'s Rss equals /proc/self/status's VmRSS (another kernel counter) within 10 %,
    and its peak grows by a 256 MiB tensor written in full."""
    import subprocess
    import sys
    import time

    from unbubble.runtime.telemetry import process_memory

    before = time.time()
    out = subprocess.run([sys.executable, "-c", "import time; from unbubble.runtime.telemetry import "
                          "process_start_epoch as p; print(p(), time.time())"], capture_output=True, text=True,
                         check=True).stdout.split()
    started, now = float(out[0]), float(out[1])
    assert before - 0.02 <= started <= now
    mem = process_memory()
    with open("/proc/self/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    # ru_maxrss and Rss are kept apart by the kernel and may differ by a few pages
    assert mem["rss_bytes"] == pytest.approx(vmrss, rel=0.1) and mem["peak_rss_bytes"] >= 0.98 * mem["rss_bytes"]
    big = torch.ones(64 * 2**20)  # 256 MiB, every page touched
    assert process_memory()["peak_rss_bytes"] >= mem["rss_bytes"] + 250 * 2**20
    del big


def test_dropout_draws_depend_on_stage_and_micro_batch_only(tmp_path):
    """[Note: random numbers per micro-batch]: a forward's stream is fixed by (seed, stage, k),
    whatever ran before it; so a resumed PACI run with dropout 0.1 equals the uninterrupted one bit
    for bit without restoring any RNG state (the engines' equality is in tests/multiproc)."""
    import dataclasses

    from unbubble.runtime.checkpoint import Checkpointing
    from unbubble.runtime.executor import seed_forward
    from unbubble.testing import assert_resume_is_bit_identical
    from helpers import tiny_gpt_config

    def draw(seed, stage, k, noise):
        torch.rand(noise)  # what other micro-batches consumed before
        seed_forward(seed, stage, k, "cpu")
        return torch.rand(16)

    assert torch.equal(draw(7, 1, 5, 3), draw(7, 1, 5, 100))
    assert not torch.equal(draw(7, 1, 5, 0), draw(7, 1, 6, 0))
    assert not torch.equal(draw(7, 1, 5, 0), draw(7, 2, 5, 0))
    assert not torch.equal(draw(7, 1, 5, 0), draw(8, 1, 5, 0))
    config = dataclasses.replace(tiny_gpt_config(), dropout=0.1)
    job = dataclasses.replace(tiny_gpt_job(get_schedule("paci", 2, steps=8, a=2), config=config),
                              checkpoint=Checkpointing(str(tmp_path), every=4, keep=3))
    assert_resume_is_bit_identical(job, 4)


def test_the_emulator_runs_on_the_threads_it_is_given_and_restores_the_callers():
    job = tiny_gpt_job(get_schedule("paci", 2, steps=1, a=1))
    torch.set_num_threads(2)
    seen = []

    class Probe:
        def on_step(self, step, loss, info):
            seen.append(torch.get_num_threads())

        def on_eval(self, version, loss):
            pass

    try:
        run_emulator(job, listener=Probe())
        run_emulator(job, listener=Probe(), threads=None)
        assert seen == [1, 2] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    with pytest.raises(ConfigError, match=r"^threads=0 is invalid: must be an integer ≥ 1 \(the emulator's torch "
                                          r"threads; None keeps torch's setting\)$"):
        run_emulator(job, threads=0)
