"""SGD's state pre-initialized for Megatron's distributed optimizer leaves its trajectory unchanged."""

from __future__ import annotations

import pytest
import torch

from megatron_diloco.compat.distopt_sgd import init_sgd_state


@pytest.mark.parametrize("momentum,nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_preinitialized_sgd_matches_lazy_sgd_bitwise(momentum, nesterov):
    torch.manual_seed(0)
    p0 = torch.randn(64, 16)
    grads = [torch.randn(64, 16) for _ in range(4)]
    trajectories = []
    for pre in (False, True):
        p = torch.nn.Parameter(p0.clone())
        opt = torch.optim.SGD([p], lr=0.1, momentum=momentum, nesterov=nesterov, weight_decay=0.01)
        if pre:
            init_sgd_state(opt)
            assert ("momentum_buffer" in opt.state[p]) == (momentum > 0)
        for g in grads:
            p.grad = g.clone()
            opt.step()
        trajectories.append(p.detach().clone())
    assert torch.equal(trajectories[0], trajectories[1])


def test_dampening_is_refused():
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="dampening"):
        init_sgd_state(torch.optim.SGD([p], lr=0.1, momentum=0.9, dampening=0.5))
