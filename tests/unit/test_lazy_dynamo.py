"""[Note: eager stage processes without Dynamo] (runtime/lazy_dynamo.py): a fresh interpreter trains a
stage with every optimizer on the stand-in and must get the same weights as this process, which has
the real torch._dynamo; anything beyond the stand-in loads the real package, whose submodules are
executed once, and ``importlib.util.find_spec`` finds it meanwhile (regression: the stand-in had no
``__spec__``, so find_spec raised ValueError)."""

import json
import subprocess
import sys

import torch

OPTIMIZERS = ("muon", "adamw", "basis-rotation", "nesterov", "nadam")

# Builds a stage and steps each optimizer (state_dict round trip and zero_grad included); the same
# source runs in the fresh interpreter (on the stand-in) and in this process (on the real package).
TRAIN = r"""
def train(name):
    import torch
    from unbubble.models.registry import make_config
    from unbubble.optim import build_optimizer
    from unbubble.train import gpt_stage

    torch.manual_seed(0)
    stage = gpt_stage(make_config("tiny", 257), 4, 0, 128, 1)
    opt = build_optimizer(name, list(stage.named_parameters()), 1, 4, 1, 1e-2, (0.9, 0.95), 0.1,
                          br_stage_delays=[1, 1, 1, 0], br_freq=2)
    x = torch.randn(2, 16, 128)
    for _ in range(3):
        stage(x).backward(torch.randn(2, 16, 128))
        opt.step()
        opt.zero_grad()
    opt.load_state_dict(opt.state_dict())
    return [p.detach().flatten().tolist() for p in stage.parameters()]
"""

# Trains with each optimizer on the stand-in and prints the weights and whether the stand-in survived;
# then uses what only the real package has.
SCRIPT = r"""
import json, sys
import torch
torch.set_num_threads(1)
from unbubble.runtime import lazy_dynamo
assert lazy_dynamo.defer()
""" + TRAIN + r"""
out = {name: train(name) for name in sys.argv[1:]}
out["deferred"] = lazy_dynamo.is_deferred() and "torch._dynamo.config" not in sys.modules
out["dynamo_submodules"] = sorted(m for m in sys.modules if m.startswith("torch._dynamo."))
import importlib.util
out["spec_while_deferred"] = importlib.util.find_spec("torch._dynamo").name == "torch._dynamo" \
    and lazy_dynamo.is_deferred()
import torch._dynamo.config  # a submodule: the real package comes first, and executes it once
out["limit"] = torch._dynamo.config.cache_size_limit
out["one_config"] = sys.modules["torch._dynamo.config"] is torch._dynamo.config \
    and torch._dynamo.config.__spec__.origin.endswith("config.py")
import torch._dynamo.profiler  # one the package does not import itself: bound on the real package
out["profiler"] = torch._dynamo.profiler is sys.modules["torch._dynamo.profiler"]
out["real_after"] = not lazy_dynamo.is_deferred() and torch._dynamo.disable.__module__ == "torch._dynamo.decorators"
out["compiled"] = torch.compile(lambda t: t * 2, backend="eager")(torch.ones(2)).tolist()
print(json.dumps(out))
"""


def _train_here(name):
    namespace: dict = {}
    exec(TRAIN, namespace)  # noqa: S102 - the test's own source, shared with the fresh interpreter
    return namespace["train"](name)


def test_a_stage_trains_on_the_stand_in_exactly_as_with_dynamo_and_never_imports_it():
    import torch._dynamo  # noqa: F401 - this process has the real package

    proc = subprocess.run([sys.executable, "-c", SCRIPT, *OPTIMIZERS], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["deferred"] and got["dynamo_submodules"] == []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same reductions as the fresh interpreter's
    try:
        for name in OPTIMIZERS:
            assert got[name] == _train_here(name), name  # bit for bit
    finally:
        torch.set_num_threads(threads)
    assert got["spec_while_deferred"] and got["one_config"] and got["profiler"]
    assert isinstance(got["limit"], int) and got["real_after"]
    assert got["compiled"] == [2.0, 2.0]
