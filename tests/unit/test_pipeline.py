"""Bring your own model: nn.Sequential cut at named points, trained with any schedule; the digits example."""

import functools
import importlib.util
import pickle
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from unbubble.errors import ConfigError
from unbubble.pipeline import StageBuilder, merge_state_dicts, split_sequential, torch_optimizer
from unbubble.runtime.emulator import run_emulator
from unbubble.runtime.job import PipelineJob
from unbubble.schedules.registry import get_schedule
from unbubble.testing import train_without_pipeline

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "digits_mlp.py"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    yield
    torch.set_num_threads(threads)


def named_mlp() -> nn.Sequential:
    return nn.Sequential(OrderedDict(fc1=nn.Linear(8, 16), act1=nn.Tanh(), fc2=nn.Linear(16, 16), act2=nn.Tanh(),
                                     fc3=nn.Linear(16, 16), act3=nn.Tanh(), head=nn.Linear(16, 3)))


def teacher_batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic but learnable: 3 classes given by a fixed random linear teacher."""
    g = torch.Generator().manual_seed(1000 + k)
    x = torch.randn(16, 8, generator=g)
    w = torch.randn(8, 3, generator=torch.Generator().manual_seed(7))
    return x, (x @ w).argmax(-1)


def test_split_keeps_names_and_computes_the_same():
    seq = named_mlp()
    stages = split_sequential(seq, ["fc2", "head"])
    assert [list(dict(s.named_children())) for s in stages] == [["fc1", "act1"], ["fc2", "act2", "fc3", "act3"],
                                                                 ["head"]]
    x = torch.randn(4, 8)
    torch.testing.assert_close(nn.Sequential(*stages)(x), seq(x), rtol=0, atol=0)
    assert merge_state_dicts([s.state_dict() for s in stages]).keys() == seq.state_dict().keys()
    assert stages[0].fc1 is seq.fc1  # shared, not copied
    plain = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    assert [len(s) for s in split_sequential(plain, [2])] == [2, 1]
    assert [len(s) for s in split_sequential(seq, [])] == [7]


@pytest.mark.parametrize("cuts, message", [
    (["fc9"], "cut point 'fc9' is not a child of the model: valid cut points are act1, fc2, act2"),
    (["fc1"], "cut point 'fc1' is the first child: stage 0 would be empty"),
    (["fc3", "fc2"], "cut point 'fc2' is before 'fc3': cut points must be distinct and in model order"),
    (["fc2", "fc2"], "cut point 'fc2' is repeated"),
    ([99], "cut point 99 is not a child"),
])
def test_bad_cut_points_one_line(cuts, message):
    with pytest.raises(ConfigError) as exc:
        split_sequential(named_mlp(), cuts)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_stage_builder_is_deterministic_and_picklable():
    builder = StageBuilder(named_mlp, cut_points=["fc2", "fc3", "head"], seed=3)
    assert builder.n_stages == 4
    torch.manual_seed(123)
    state = builder(1).state_dict()
    clone = pickle.loads(pickle.dumps(builder))
    torch.manual_seed(456)
    for key, value in clone(1).state_dict().items():
        assert torch.equal(value, state[key])
    before = torch.random.get_rng_state()
    builder(0)
    assert torch.equal(torch.random.get_rng_state(), before)  # global random state untouched
    with pytest.raises(ConfigError, match="stage=4 is invalid: the model has 4 stages"):
        builder(4)
    listed = StageBuilder(functools.partial(split_sequential, named_mlp(), ["head"]))
    assert listed.n_stages == 2


def _job(schedule, lr=3e-3):
    builder = StageBuilder(named_mlp, cut_points=["fc2", "fc3", "head"], seed=0)
    return PipelineJob(builder, nn.functional.cross_entropy, teacher_batch,
                       torch_optimizer(torch.optim.AdamW, lr=lr), schedule,
                       val_fn=lambda: [teacher_batch(-1 - i) for i in range(4)])


def test_flush_equals_non_pipelined_reference():
    job = _job(get_schedule("1f1b-flush", 4, steps=6, m=4))
    result = run_emulator(job)
    ref_states, ref_losses = train_without_pipeline(job)
    for got, want in zip(result.final_states, ref_states):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(result.step_losses, ref_losses, rtol=1e-5, atol=1e-7)


def test_paci_trains_a_sequential_model():
    result = run_emulator(_job(get_schedule("paci", 4, steps=40, a=4), lr=1e-2))
    (_, first), (_, last) = result.val_losses[0], result.val_losses[-1]
    assert last < 0.4 * first  # ln 3 ≈ 1.1 untrained
    assert result.max_drift() == [1, 1, 1, 0]


@pytest.fixture(scope="module")
def example():
    pytest.importorskip("sklearn", reason="the digits example needs the 'examples' extra")
    spec = importlib.util.spec_from_file_location("digits_mlp", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digits_example_trains_with_paci(example):
    job, builder = example.make_job("paci", stages=4, steps=60, a=4, eval_interval=60)
    result = run_emulator(job)
    (_, first), (_, last) = result.val_losses
    assert first == pytest.approx(2.30, abs=0.1)  # ln 10: untrained
    assert last < 0.4  # a real margin: most digits recognised
    assert example.accuracy(builder, result.final_states) > 0.9


def test_digits_example_flush_equals_reference_with_basis_rotation(example):
    job, _ = example.make_job("1f1b-flush", stages=3, steps=8, m=4, optimizer="basis-rotation", eval_interval=0)
    result = run_emulator(job)
    ref_states, _ = train_without_pipeline(job)
    for got, want in zip(result.final_states, ref_states):
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-7)


def test_digits_example_script(example, capsys):
    example.main(["--schedule", "gpipe", "--stages", "2", "--m", "2", "--steps", "12", "--check-reference"])
    out = capsys.readouterr().out
    assert "largest weight difference to the non-pipelined reference: 0.00e+00" in out


@pytest.mark.parametrize("args, message", [(["--stages", "5"], "stages=5 is invalid for this 4-block MLP"),
                                           (["--optimizer", "sgdx"], "optimizer='sgdx' is invalid"),
                                           (["--schedule", "interleaved-1f1b"],
                                            "(interleaved-1f1b runs 2 chunks per rank: give --stages 2 or fewer)")])
def test_digits_example_bad_options_one_line(example, capsys, args, message):
    with pytest.raises(SystemExit) as exc:
        example.main(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err
