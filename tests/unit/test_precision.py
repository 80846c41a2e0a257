"""Precision modes and activation recomputation against explicit references (docs/architecture.md#precision-and-recomputation).

Which weights a backward uses is checked numerically against both possible answers; bytes are
counted independently of ``precision.SavedBytes`` (by the saved tensors' values); recomputation
is checked against a run that keeps its activations and against a delayed reference that
recomputes on v_B.
"""

import dataclasses

import pytest
import torch
from torch import nn

from unbubble.config import TrainConfig
from unbubble.errors import ConfigError
from unbubble.runtime.checkpoint import Checkpointing
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.executor import StageExecutor
from unbubble.runtime.job import PipelineJob
from unbubble.runtime.precision import check_modes, to_bf16
from unbubble.schedules import ActionKind, get_schedule
from unbubble.testing import assert_resume_is_bit_identical
from helpers import tiny_gpt_config, tiny_gpt_job

torch.set_num_threads(1)
BF16 = torch.bfloat16


def _job(name, n, steps, precision="fp32", recompute="none", **kw):
    sched = get_schedule(name, n, steps=steps, a=kw.pop("a", 4), m=kw.pop("m", 4))
    return dataclasses.replace(tiny_gpt_job(sched, **kw), precision=precision, recompute=recompute)


def _linear_executor(precision, lr=0.5):
    """Stage 1 of 3 made of one Linear(3, 2) without bias, SGD (the optimizer sees fp32 masters under bf16)."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 2, bias=False)
    masters = to_bf16(lin) if precision == "bf16" else None
    opt = torch.optim.SGD(masters or lin.parameters(), lr=lr)
    ex = StageExecutor(1, 3, lin, None, lambda k: (None, None), opt, 1.0, precision=precision, masters=masters)
    return ex, lin


# --- bf16: bf16 parameters, fp32 masters -----------------------------------------------------------
def test_bf16_paci_equals_fp32_paci_within_bf16_tolerance():
    """20 PACI updates (N=4, a=4, AdamW lr 1e-2). Tolerances: bf16 keeps 8 significant bits, so each
    weight and activation carries a relative rounding of ≤ 2⁻⁹ ≈ 2e-3 per operation; the step losses
    (≈ 4.2 nats) may differ by 1e-2 and the final weights by a quarter of the distance fp32 moved
    them (measured: 1.4e-3 and 0.10). A run that lost the masters' low bits, or summed the
    micro-batches' gradients in bf16, or used stale weights, fails the weight bound."""
    ref = run_emulator(_job("paci", 4, 20))
    got = run_emulator(_job("paci", 4, 20, precision="bf16"))
    assert got.max_drift() == ref.max_drift() == [1, 1, 1, 0]
    assert max(abs(a - b) for a, b in zip(got.step_losses, ref.step_losses)) < 1e-2
    init = [_job("paci", 4, 1).stage_fn(s).state_dict() for s in range(4)]
    moved = diff = 0.0
    for s in range(4):
        for name, w in ref.final_states[s].items():
            assert got.final_states[s][name].dtype == BF16
            moved += float((w - init[s][name]).norm() ** 2)
            diff += float((got.final_states[s][name].float() - w).norm() ** 2)
    assert (diff / moved) ** 0.5 < 0.25


def test_bf16_input_gradient_uses_the_new_bf16_weights_after_an_in_place_update():
    ex, lin = _linear_executor("bf16")
    act = torch.tensor([[1.0, 2.0, 3.0]], dtype=BF16)
    w_old = lin.weight.detach().float().clone()
    ex.forward(0, act)
    ex.masters[0].grad = torch.ones(2, 3)
    ex.update()  # master ← master − 0.5, bf16 weight ← round(master), in place
    w_new = lin.weight.detach().float()
    torch.testing.assert_close(w_new, (ex.masters[0].detach() - 0).to(BF16).float())
    assert (w_new - w_old).abs().min() > 0.4
    g = torch.tensor([[1.0, -2.0]])
    gx = ex.backward(0, g.to(BF16)).float()
    torch.testing.assert_close(gx, g @ w_new, rtol=8e-3, atol=1e-2)  # bf16 result: 8 significant bits
    assert (gx - g @ w_old).abs().max() > 0.5  # not the forward-time weights
    # weight gradient: forward-time input, accumulated in the fp32 master's .grad
    assert lin.weight.grad is None and ex.masters[0].grad.dtype == torch.float32
    torch.testing.assert_close(ex.masters[0].grad, g.T @ act.float())


def test_bf16_accumulates_micro_batch_gradients_and_sub_ulp_updates_in_fp32():
    """Four micro-batches' bf16 gradients are summed in fp32 (not rounded to bf16 after each add),
    and SGD updates of 0.3 bf16 ulp move the bf16 weight once the fp32 master has moved ≥ ½ ulp."""
    ex, lin = _linear_executor("bf16", lr=1.0)
    acts = [torch.full((1, 3), 1.0 + 2.0 ** -8 * k, dtype=BF16) for k in range(4)]
    g = torch.tensor([[1.0, 1.0]], dtype=BF16)
    for k, a in enumerate(acts):
        ex.forward(k, a)
        ex.backward(k, g)
    want = sum((g.T.float() @ a.float()).to(BF16).float() for a in acts)  # each product in bf16, sum in fp32
    assert torch.equal(ex.masters[0].grad, want)
    bf16_sum = torch.zeros(2, 3, dtype=BF16)
    for a in acts:
        bf16_sum += (g.T.float() @ a.float()).to(BF16)
    assert not torch.equal(bf16_sum.float(), want)  # the check tells fp32 from bf16 accumulation
    ex.optimizer.zero_grad(set_to_none=True)
    w0 = ex.masters[0].detach().clone()
    ulp = torch.finfo(BF16).eps * w0.abs().to(BF16).float()  # spacing of bf16 numbers around each weight
    for step in range(10):
        ex.masters[0].grad = -0.3 * ulp / 1.0  # SGD lr 1: the master moves by 0.3 ulp per step
        ex.update()
    torch.testing.assert_close(ex.masters[0].detach(), w0 + 3.0 * ulp)
    assert torch.equal(lin.weight.detach(), ex.masters[0].detach().to(BF16))


# --- bf16-autocast: per-forward bf16 copies ---------------------------------------------------------
def test_autocast_input_gradient_uses_the_forward_time_bf16_weights():
    """Autocast saves its own bf16 cast of the weight in each forward: after an in-place update the
    input gradient of the in-flight micro-batch still uses the forward-time weights (Δ_eff = 0)."""
    ex, lin = _linear_executor("bf16-autocast")
    act = torch.tensor([[1.0, 2.0, 3.0]])
    w_old = lin.weight.detach().clone()
    ex.forward(0, act)
    lin.weight.grad = torch.ones(2, 3)
    ex.update()
    w_new = lin.weight.detach().clone()
    g = torch.tensor([[1.0, -2.0]])
    gx = ex.backward(0, g).float()
    torch.testing.assert_close(gx, g.to(BF16).float() @ w_old.to(BF16).float(), rtol=8e-3, atol=1e-2)
    assert (gx - g @ w_new).abs().max() > 0.5
    torch.testing.assert_close(lin.weight.grad, g.T @ act, rtol=8e-3, atol=1e-2)  # fp32 .grad of the fp32 weight
    assert lin.weight.grad.dtype == torch.float32


def _weight_copies(module, run):
    """Bytes of saved tensors that are not a parameter's storage but equal (by value) a parameter
    cast to their dtype, possibly transposed: counted independently of ``SavedBytes``."""
    params = list(module.parameters())
    own = {p.untyped_storage().data_ptr() for p in params}
    seen, total = set(), 0

    def pack(t):
        nonlocal total
        ptr = t.untyped_storage().data_ptr()
        if ptr in own or ptr in seen or not t.is_floating_point():
            return t
        for p in params:
            for cand in (p, p.t()) if p.dim() == 2 else (p,):
                if cand.shape == t.shape and torch.equal(cand.detach().to(t.dtype), t.detach()):
                    seen.add(ptr)
                    total += t.untyped_storage().nbytes()
                    return t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total


@pytest.mark.parametrize("precision", ["fp32", "bf16", "bf16-autocast"])
def test_weight_copies_held_per_micro_batch_in_flight(precision):
    """bf16-autocast holds in-flight × (2 bytes × the stage's Linear weight elements): one bf16
    copy of every matrix per micro-batch (LayerNorm and the embedding stay fp32 and are saved by
    reference; Linear biases are not saved). fp32 and bf16 hold no copy whatever the count."""
    job = _job("paci", 2, 1, precision=precision)
    ex = job.build_executor(0)
    linear = sum(m.weight.numel() for m in ex.module.modules() if isinstance(m, nn.Linear))
    per_mb = 2 * linear if precision == "bf16-autocast" else 0
    for q in range(1, 4):
        counted = _weight_copies(ex.module, lambda: ex.forward(q - 1))
        assert counted == per_mb  # this micro-batch's copies, by value
        assert ex.held_bytes[1] == q * per_mb  # the executor's measurement, all in flight
    assert ex.memory_bytes()["weight_copy_bytes"] == 3 * per_mb
    assert linear > 0


# --- recomputation ------------------------------------------------------------------------------
def test_recompute_with_flush_equals_keeping_activations_and_replays_dropout():
    """fp32 1F1B-flush with dropout 0.1: recomputing every forward (with the saved RNG state)
    gives the run that keeps its activations, to rtol 1e-6 (bit-identical in practice)."""
    cfg = dataclasses.replace(tiny_gpt_config(), dropout=0.1)
    stage = _job("1f1b-flush", 2, 1, config=cfg).stage_fn(1)
    x = torch.randn(2, 16, cfg.n_embd)
    assert not torch.equal(stage(x), stage(x))  # dropout is active: a different mask would show
    runs = [run_emulator(_job("1f1b-flush", 2, 3, recompute=r, config=cfg)) for r in ("none", "full")]
    assert runs[1].step_losses == pytest.approx(runs[0].step_losses, rel=1e-6)
    for got, want in zip(runs[1].final_states, runs[0].final_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=0)


def test_recompute_under_stashing_recomputes_on_the_stashed_version():
    """PipeDream with recomputation equals PipeDream keeping activations: both the recomputed
    forward and the backward use the stashed forward version v_F."""
    runs = [run_emulator(_job("pipedream", 4, 8, recompute=r)) for r in ("none", "full")]
    assert max(runs[0].sim_trace.delays().values()) >= 1
    for got, want in zip(runs[1].final_states, runs[0].final_states):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=0)


D, BATCH = 5, 3


def _mlp_stage(stage):
    torch.manual_seed(2000 + stage)
    return nn.Sequential(nn.Linear(D, D), nn.Tanh())


def _mlp_batch(k):
    g = torch.Generator().manual_seed(k)
    return torch.randn(BATCH, D, generator=g), torch.randn(BATCH, D, generator=g)


def _mse(out, y):
    return ((out - y) ** 2).mean()


def _sgd(params, stage):
    return torch.optim.SGD(params, lr=0.3)


def _recomputing_reference(job, records):
    """Replays the recorded actions with hand-written tanh(x Wᵀ + b): a forward only passes
    y = tanh(x W_vFᵀ + b_vF) on and keeps x; the backward recomputes y' = tanh(x W_vBᵀ + b_vB) with
    the current version and uses it for both gradients (∂W = gzᵀx, gx = gz W_vB, gz = gy ⊙ (1 − y'²))."""
    n = job.schedule.n_stages
    versions = [[(m[0].weight.detach().clone(), m[0].bias.detach().clone())] for m in map(_mlp_stage, range(n))]
    grads = [[torch.zeros(D, D), torch.zeros(D)] for _ in range(n)]
    kept, msgs = {}, {}
    for rec in records:
        a, s = rec.action, rec.action.stage
        if a.kind is ActionKind.F:
            x = _mlp_batch(a.mb)[0] if s == 0 else msgs.pop(("act", s, a.mb))
            w, b = versions[s][rec.version]
            kept[(s, a.mb)] = x
            if s < n - 1:
                msgs[("act", s + 1, a.mb)] = torch.tanh(x @ w.T + b)
        elif a.kind is ActionKind.B:
            x = kept.pop((s, a.mb))
            w, b = versions[s][-1]
            y = torch.tanh(x @ w.T + b)
            gy = 2 * (y - _mlp_batch(a.mb)[1]) / y.numel() * job.schedule.loss_scale if s == n - 1 else \
                msgs.pop(("grad", s, a.mb))
            gz = gy * (1 - y * y)
            grads[s][0] += gz.T @ x
            grads[s][1] += gz.sum(0)
            if s > 0:
                msgs[("grad", s - 1, a.mb)] = gz @ w
        else:
            w, b = versions[s][-1]
            versions[s].append((w - 0.3 * grads[s][0], b - 0.3 * grads[s][1]))
            grads[s] = [torch.zeros(D, D), torch.zeros(D)]
    return versions


@pytest.mark.parametrize("a", [1, 2])
def test_paci_recompute_equals_a_delayed_reference_that_recomputes_with_v_B(a):
    job = PipelineJob(_mlp_stage, _mse, _mlp_batch, _sgd, get_schedule("paci", 4, steps=10, a=a), recompute="full")
    result = run_emulator(job)
    assert max(result.max_drift()) >= 1  # backwards ran on newer weights than their forwards
    versions = _recomputing_reference(job, result.sim_trace.records)
    kept = run_emulator(dataclasses.replace(job, recompute="none"))
    for s in range(3):  # the last stage has Δ = 0: recomputing there changes nothing
        w, b = versions[s][-1]
        torch.testing.assert_close(result.final_states[s]["0.weight"], w, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(result.final_states[s]["0.bias"], b, rtol=1e-5, atol=1e-6)
        assert (kept.final_states[s]["0.weight"] - w).abs().max() > 1e-4  # v_F activations give another answer


def test_recompute_stores_only_the_stage_input():
    """Stored bytes per stage = (most micro-batches in flight) × (the input's bytes): token ids
    (int64; ``random_tokens`` returns a (B, T) view of a (B, T + 1) tensor, whose storage stays
    alive) on stage 0, the fp32 activation (B, T, C) on stage 1; keeping activations stores ≥ 10×."""
    cfg = tiny_gpt_config()
    b, t = 2, cfg.block_size
    inputs = [b * (t + 1) * 8, b * t * cfg.n_embd * 4]
    runs = {r: run_emulator(_job("1f1b-flush", 2, 2, recompute=r, m=4)) for r in ("none", "full")}
    trace = runs["full"].sim_trace
    for s in range(2):
        q = in_flight = 0
        for rec in trace.records:
            if rec.action.stage == s and rec.action.kind in (ActionKind.F, ActionKind.B):
                q += 1 if rec.action.kind is ActionKind.F else -1
                in_flight = max(in_flight, q)
        full, none = runs["full"].memory[s], runs["none"].memory[s]
        assert in_flight == 2 - s
        assert full["stored_activation_bytes"] == in_flight * inputs[s]
        assert full["per_micro_batch"]["input"] == inputs[s]
        assert none["stored_activation_bytes"] >= 10 * full["stored_activation_bytes"]
        # during a backward the recomputed micro-batch's activations are alive too: what one forward
        # saves, its input (saved by the first op, already kept) counted once
        assert full["per_micro_batch"]["recomputed"] == none["per_micro_batch"]["forward"] - inputs[s]
        assert full["activation_bytes"] == (in_flight - 1) * inputs[s] + none["per_micro_batch"]["forward"]


# --- checkpoints, bad input ---------------------------------------------------------------------------
@pytest.mark.parametrize("precision,recompute", [("bf16", "full"), ("bf16-autocast", "none")])
def test_resume_is_bit_identical(precision, recompute, tmp_path):
    job = dataclasses.replace(_job("paci", 4, 8, precision, recompute, a=2),
                              checkpoint=Checkpointing(str(tmp_path), every=4, keep=3))
    assert_resume_is_bit_identical(job, 4)


@pytest.mark.parametrize("kw,message", [
    (dict(precision="fp16"), "precision='fp16' is invalid (did you mean 'bf16'?): must be one of fp32, bf16-autocast, bf16 (set --precision)"),
    (dict(recompute="selective"), "recompute='selective' is invalid: must be one of none, full (set --recompute)"),
])
def test_bad_modes_are_refused_in_one_line(kw, message):
    with pytest.raises(ConfigError) as exc:
        TrainConfig(**kw)
    assert str(exc.value) == message
    with pytest.raises(ConfigError, match="is invalid"):
        check_modes(kw.get("precision", "fp32"), kw.get("recompute", "none"))


X86_FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw{}\nbugs\t\t: spectre_v1\n"


@pytest.mark.parametrize("cpuinfo,native", [
    (X86_FLAGS.format(""), False),                         # AVX-512 without BF16: emulated
    (X86_FLAGS.format(" avx512_bf16"), True),
    (X86_FLAGS.format(" amx_tile amx_bf16"), True),
    ("processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n", True),  # Arm FEAT_BF16 (Graviton 3)
    ("processor\t: 0\nFeatures\t: fp asimd crc32\n", False),
    ("bugs\t\t: avx512_bf16\n", False),                   # only the flags line counts
])
def test_native_bf16_is_read_from_the_cpu_flags(cpuinfo, native):
    from unbubble.runtime.precision import cpu_has_native_bf16

    assert cpu_has_native_bf16(cpuinfo) is native


def test_native_bf16_trusts_pytorch_first(monkeypatch):
    from unbubble.runtime.precision import cpu_has_native_bf16

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True, raising=False)
    assert cpu_has_native_bf16() is True


@pytest.mark.parametrize("precision", ["bf16", "bf16-autocast"])
@pytest.mark.parametrize("engine", ["emulator", "processes"])
def test_bf16_on_a_cpu_that_emulates_it_warns_once_with_the_fix(precision, engine, monkeypatch):
    """The decision with both answers of the (monkeypatched) CPU check, and where the stages run."""
    import logging
    import types

    from unbubble import train as train_mod

    warning = (f"precision={precision!r} on a CPU without native bf16 (no avx512_bf16/amx_bf16/bf16 flag): expect "
               "4–7× fewer tokens/s than fp32 (emulated bf16); use --precision fp32 here, or bf16 on a GPU")

    class Lines(logging.Handler):  # on the train logger itself: whatever handlers other tests left upstream
        def __init__(self):
            super().__init__(logging.WARNING)
            self.lines = []

        def emit(self, record):
            self.lines.append(record.getMessage())

    def warnings(*calls):
        handler, logger = Lines(), logging.getLogger("unbubble.train")
        logger.addHandler(handler)
        try:
            for c, j in calls:
                train_mod.warn_if_bf16_is_emulated(c, j)
        finally:
            logger.removeHandler(handler)
        return handler.lines

    cfg = TrainConfig(precision=precision, engine=engine)
    job = types.SimpleNamespace(dp=1, schedule=types.SimpleNamespace(n_ranks=cfg.stages))
    monkeypatch.setattr(train_mod, "choose_backend", lambda local: "gloo")  # no GPU per process
    for native in (False, True):
        monkeypatch.setattr(train_mod, "cpu_has_native_bf16", lambda native=native: native)
        assert warnings((cfg, job)) == ([] if native else [warning])
    # fp32 never warns; processes on one GPU each (NCCL) never warn, whatever the CPU
    monkeypatch.setattr(train_mod, "cpu_has_native_bf16", lambda: False)
    assert warnings((dataclasses.replace(cfg, precision="fp32"), job)) == []
    monkeypatch.setattr(train_mod, "choose_backend", lambda local: "nccl")
    assert warnings((cfg, job)) == ([] if engine == "processes" else [warning])


def test_slow_bf16_warning_decision():
    from unbubble.runtime.precision import slow_bf16_warning

    assert slow_bf16_warning("bf16", "cpu", False).startswith("precision='bf16' on a CPU without native bf16")
    assert slow_bf16_warning("bf16", "cpu", True) is None
    assert slow_bf16_warning("bf16", "cpu", None) is None  # unknown CPU: no guess
    assert slow_bf16_warning("bf16", "cuda", False) is None
    assert slow_bf16_warning("fp32", "cpu", False) is None


def test_bf16_executor_needs_its_masters():
    lin = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="needs fp32 master copies"):
        StageExecutor(0, 1, lin, None, lambda k: (None, None), torch.optim.SGD(lin.parameters(), lr=0.1), 1.0,
                      precision="bf16")


# --- CLI and run folder ---------------------------------------------------------------------------
def test_cli_records_the_modes_and_measured_bytes_per_stage(tmp_path):
    """``unbubble train --precision bf16 --recompute full``: summary.json gives each stage's measured
    bytes (bf16 parameters: 2 bytes each, fp32 masters: 4, AdamW moments: 8; the stored activations
    are the stage's input: int64 token ids on stage 0), and actions.jsonl records per backward the
    version its forward was recomputed on (v_B)."""
    import json

    from click.testing import CliRunner

    from unbubble.cli import cli
    from unbubble.models.registry import make_config

    run = tmp_path / "run"
    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--steps", "3", "--stages", "2", "--a", "2",
                                   "--optimizer", "adamw",
                                   "--precision", "bf16", "--recompute", "full", "--eval-interval", "0",
                                   "--eval-batches", "1", "--run-dir", str(run), "--cache-dir", str(tmp_path / "c")])
    assert res.exit_code == 0, res.output
    summary = json.loads((run / "summary.json").read_text())
    cfg = TrainConfig()
    assert (summary["precision"], summary["recompute"]) == ("bf16", "full")
    for s, mem in enumerate(summary["memory"]):
        n = mem["param_bytes"] // 2
        assert mem["master_bytes"] == 4 * n and mem["grad_bytes"] == 4 * n
        assert 8 * n < mem["optimizer_state_bytes"] <= 8 * n + 4 * 64  # exp_avg, exp_avg_sq; a 4-byte step per tensor
        assert mem["weight_copy_bytes"] == 0
    b, t = cfg.micro_batch_size, cfg.seq_len
    n_embd = make_config(cfg.model, 257).n_embd
    assert summary["memory"][0]["per_micro_batch"]["input"] == b * t * 8  # int64 token ids (B, T)
    assert summary["memory"][1]["per_micro_batch"]["input"] == b * t * n_embd * 2  # bf16 activation (B, T, C)
    actions = [json.loads(line) for line in (run / "actions.jsonl").read_text().splitlines()]
    backs = [a for a in actions if a["kind"] == "B"]
    assert backs and all(a["recomputed_v"] == a["v_B"] for a in backs)
    assert any(a["drift"] == 1 for a in backs)  # PACI: some recomputed on a newer version than the forward's


@pytest.mark.parametrize("args,message", [
    (["--precision", "fp16"], "error: precision='fp16' is invalid (did you mean 'bf16'?): must be one of fp32, bf16-autocast, bf16 "
                              "(set --precision)"),
    (["--recompute", "selective"], "error: recompute='selective' is invalid: must be one of none, full "
                                   "(set --recompute)"),
])
def test_cli_refuses_bad_modes_in_one_line(args, message, tmp_path):
    from click.testing import CliRunner

    from unbubble.cli import cli

    res = CliRunner().invoke(cli, ["-q", "train", "--engine", "emulator", "--run-dir", str(tmp_path / "r"), *args])
    assert res.exit_code == 2
    assert res.stderr.strip() == message
    assert not (tmp_path / "r").exists()


# --- the non-finite guard ---------------------------------------------------------------------------
def _nan_batch(bad, k):
    x, y = _mlp_batch(k)
    if k in bad:
        x[0, 0] = float("nan")
    return x, y


def _marked(k):
    x, y = _mlp_batch(k)
    if k == 7:
        y[0, 0] = 1000.0
    return x, y


def _zeroing_mse(out, y):
    """MSE; the micro-batch marked with 1000 in y[0, 0] counts zero (what dropping it must give)."""
    loss = _mse(out.float(), y)
    return loss * 0.0 if y[0, 0] > 500 else loss


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name,kw", [("paci", dict(a=2)), ("zb-h1", dict(m=3))])
def test_nan_guard_drops_the_micro_batch_under_recompute(name, kw, precision):
    """A NaN in micro-batch 7's input: with recomputation it is found in the (recomputed) loss on
    the last stage and dropped on every stage; the weights equal a run in which that micro-batch's
    loss counts zero."""
    sched = get_schedule(name, 3, steps=6, **kw)
    adam = lambda params, stage: torch.optim.Adam(params, lr=0.05)  # noqa: E731
    guarded = run_emulator(PipelineJob(_mlp_stage, _mse, lambda k: _nan_batch({7}, k), adam, sched,
                                       precision=precision, recompute="full"))
    reference = run_emulator(PipelineJob(_mlp_stage, _zeroing_mse, _marked, adam, sched, precision=precision,
                                         recompute="full"))
    assert [(e["stage"], e["mb"], e["what"]) for e in guarded.events] == \
        [(2, 7, "loss"), (1, 7, "gradient from the next stage"), (0, 7, "gradient from the next stage")]
    for got, want in zip(guarded.final_states, reference.final_states):
        for k in got:
            assert torch.isfinite(got[k]).all()
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


_SAME_WEIGHTS = {"gpipe": dict(m=4), "1f1b-flush": dict(m=4), "interleaved-1f1b": dict(m=4, v=2),
                 "zb-h1": dict(m=4), "zb-h2": dict(m=4), "pipedream": {}, "pipedream-2bw": dict(m=4),
                 "paci-stashed": dict(a=2)}


@pytest.mark.parametrize("name", sorted(_SAME_WEIGHTS))
def test_recompute_changes_nothing_where_the_backward_uses_the_forward_weights(name):
    """Synchronous and weight-stashing schedules: the recomputed forward runs on v_F, so
    recomputation gives the weights of keeping activations (fp32, rtol 1e-6)."""
    sched = get_schedule(name, 2, steps=3, **_SAME_WEIGHTS[name])
    kept, rec = (run_emulator(dataclasses.replace(tiny_gpt_job(sched), recompute=r)) for r in ("none", "full"))
    assert rec.step_losses == pytest.approx(kept.step_losses, rel=1e-6)
    for got, want in zip(rec.final_states, kept.final_states):
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", ["async-1f1b", "pipemare"])
def test_recompute_with_current_weight_schedules_keeps_the_drift_bound_and_changes_the_result(name):
    """Schedules whose backward uses newer weights: recomputation runs the whole backward on v_B,
    so the weights differ from keeping activations; the schedule (and Δ ≤ N − i) is unchanged."""
    sched = get_schedule(name, 3, steps=6)
    kept, rec = (run_emulator(dataclasses.replace(tiny_gpt_job(sched), recompute=r)) for r in ("none", "full"))
    assert rec.max_drift() == kept.max_drift() == [sched.drift_bound(s) for s in range(3)]
    assert max(float((rec.final_states[0][k] - kept.final_states[0][k]).abs().max()) for k in kept.final_states[0]) > 0
