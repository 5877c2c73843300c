"""The demo trainer's optimizer: SGD with momentum, as ``torch.optim.SGD(params, lr, momentum)`` computes it.

``feedline train`` starts again and again (preemption, SIGTERM, a crash restarted by its supervisor), and every
start is time the GPUs wait: ``torch.optim``'s first call imports ``torch._dynamo``, about 1.1 s of the demo's
3.9 s start here, a compiler this loop never uses. The update (no dampening, no weight decay, the first buffer
the gradient itself) and the state dict (a ``momentum_buffer`` per parameter index, ``param_groups``) are
torch's, so a checkpoint written with either loads into the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class MomentumSGD:
    """``torch.optim.SGD(params, lr=lr, momentum=momentum)``'s update and state, without ``torch.optim``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float, momentum: float):
        self.params = list(params)
        self.lr = lr
        self.momentum = momentum
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            buf = self.buffers[i]
            if buf is None:
                buf = self.buffers[i] = p.grad.detach().clone()
            else:
                buf.mul_(self.momentum).add_(p.grad)
            p.add_(buf, alpha=-self.lr)

    def state_dict(self) -> dict[str, Any]:
        group = {"lr": self.lr, "momentum": self.momentum, "dampening": 0, "weight_decay": 0, "nesterov": False,
                 "maximize": False, "foreach": None, "differentiable": False, "fused": None,
                 "params": list(range(len(self.params)))}
        return {"state": {i: {"momentum_buffer": b} for i, b in enumerate(self.buffers) if b is not None},
                "param_groups": [group]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        (group,) = state["param_groups"]
        if len(group["params"]) != len(self.params):
            raise ValueError(f"the optimizer state holds {len(group['params'])} parameters, the model "
                             f"{len(self.params)}: a checkpoint of another model")
        self.lr, self.momentum = float(group["lr"]), float(group["momentum"])
        self.buffers = [None] * len(self.params)
        for i, entry in state["state"].items():
            p = self.params[int(i)]
            self.buffers[int(i)] = entry["momentum_buffer"].to(device=p.device, dtype=p.dtype).clone()
