"""Basis Rotation on 3-D expert tensors (E, m, n): E independent matrices refreshed together."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from unbubble.optim import keys as K
from unbubble.optim.basis_rotation import BasisRotation, rotation_extra_numel
from unbubble.optim.memory import optimizer_state_bytes

E, M, N = 3, 5, 4


def _grads(steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(E, M, N, generator=g)  # a persistent direction per expert, so the bases mean something
    return [base + 0.5 * torch.randn(E, M, N, generator=g) for _ in range(steps)]


def _run(params: list[torch.nn.Parameter], grads: list[list[torch.Tensor]], **kw) -> BasisRotation:
    opt = BasisRotation(params, lr=1e-2, **kw)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        opt.step()
    return opt


@pytest.mark.parametrize("source,geometry,freq", list(itertools.product(("2nd", "1st"), ("bilateral", "unilateral"),
                                                                        (2, 3))))
def test_expert_tensor_equals_each_expert_run_alone(source, geometry, freq):
    init = torch.randn(E, M, N, generator=torch.Generator().manual_seed(1))
    grads = _grads(10)
    batched = torch.nn.Parameter(init.clone())
    opt = _run([batched], [[g] for g in grads], source=source, geometry=geometry, update_freq=freq)
    state = opt.state[batched]
    assert state[K.REFRESHES] == len(range(1, 11, freq))
    for e in range(E):
        alone = torch.nn.Parameter(init[e].clone())
        ref = _run([alone], [[g[e]] for g in grads], source=source, geometry=geometry, update_freq=freq)
        torch.testing.assert_close(batched.detach()[e], alone.detach(), rtol=1e-6, atol=1e-7)
        for key in (K.BASIS_LEFT, K.BASIS_RIGHT, K.EXP_AVG, K.EXP_AVG_SQ, K.FACTOR_LEFT, K.FACTOR_RIGHT):
            assert (key in state) == (key in ref.state[alone]), key
            if key in state:
                torch.testing.assert_close(state[key][e], ref.state[alone][key], rtol=1e-5, atol=1e-6, msg=key)


def test_identity_bases_give_adamw_exactly_on_expert_tensors():
    init = torch.randn(E, M, N, generator=torch.Generator().manual_seed(2))
    grads = _grads(5, seed=3)
    br_p, adam_p = torch.nn.Parameter(init.clone()), torch.nn.Parameter(init.clone())
    _run([br_p], [[g] for g in grads], start_step=100)  # the cold start never comes: identity bases
    adam = torch.optim.AdamW([adam_p], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.01, foreach=False)
    for g in grads:
        adam_p.grad = g.clone()
        adam.step()
    assert torch.equal(br_p, adam_p)


def test_extra_state_of_an_expert_tensor_is_e_times_one_matrix():
    for source, geometry in itertools.product(("2nd", "1st"), ("bilateral", "unilateral")):
        one = rotation_extra_numel((M, N), source, geometry)
        assert rotation_extra_numel((E, M, N), source, geometry) == E * one
        p = torch.nn.Parameter(torch.zeros(E, M, N))
        opt = _run([p], [[g] for g in _grads(1)], source=source, geometry=geometry)
        assert optimizer_state_bytes(opt)["extra_bytes"] == 4 * E * one
    assert rotation_extra_numel((E, M, N), "2nd", "bilateral") == E * 2 * (M * M + N * N)


def test_state_dict_round_trip_continues_identically():
    init = torch.randn(E, M, N, generator=torch.Generator().manual_seed(4))
    grads = _grads(8, seed=5)
    p = torch.nn.Parameter(init.clone())
    opt = _run([p], [[g] for g in grads[:4]], update_freq=3)
    q = torch.nn.Parameter(p.detach().clone())
    clone = BasisRotation([q], lr=1e-2, update_freq=3)
    clone.load_state_dict(copy.deepcopy(opt.state_dict()))  # as after torch.save / torch.load
    for g in grads[4:]:
        for param, o in ((p, opt), (q, clone)):
            param.grad = g.clone()
            o.step()
    assert torch.equal(p, q)
