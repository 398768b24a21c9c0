"""Optimizer offload (`--enable_optimizer_cpu_offload`): the optimizer's state and its step live on the host.

The trainable parameters stay on the device for forward and backward, and their gradients accumulate there over
the micro-steps as usual (accumulation > 1 works: nothing moves until the step). At the step each gradient is copied
to a host copy of its parameter, the wrapped optimizer updates the host copies (its moments are host tensors), and
the updated values are copied back. The host copies are refreshed from the device before every step, so weights
loaded into the model (a resumed state) are what the step starts from. `state_dict` / `load_state_dict` are the
wrapped optimizer's, numbered in the same parameter order, so a training state saved with or without the offload
resumes either way.
"""

from __future__ import annotations

import torch


class HostOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer built over host copies of `params` (`make(host_params)`); steps on the host."""

    def __init__(self, params, make):
        self.device_params = [p for p in params]
        self.host_params = [torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=True)
                            for p in self.device_params]
        self.inner = make(self.host_params)
        # the scheduler and accelerate read these: the wrapped optimizer's own objects
        self.defaults = self.inner.defaults
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("--enable_optimizer_cpu_offload: a step closure is not supported")
        for dev, host in zip(self.device_params, self.host_params):
            host.data.copy_(dev.data)
            host.grad = None if dev.grad is None else dev.grad.detach().to("cpu", copy=True)
        self.inner.step()
        for dev, host in zip(self.device_params, self.host_params):
            if host.grad is not None:
                dev.data.copy_(host.data, non_blocking=True)
            host.grad = None
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.device_params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state_dict) -> None:
        self.inner.load_state_dict(state_dict)
        self.param_groups, self.state = self.inner.param_groups, self.inner.state

    def add_param_group(self, param_group) -> None:
        raise ValueError("--enable_optimizer_cpu_offload: parameter groups cannot be added after the start")

    def __repr__(self) -> str:
        return f"HostOptimizer({self.inner!r})"


def state_bytes(optimizer) -> int:
    """Bytes of tensors in an optimizer's state."""
    return sum(v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor))


__all__ = ["HostOptimizer", "state_bytes"]
