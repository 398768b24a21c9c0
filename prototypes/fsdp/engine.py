"""Prototype (issue 26, phase 1): the sharding engine around difftune's training module.

What src/difftune/training would gain (see prototypes/fsdp/README.md for where each piece goes):
- `fsdp_on_cpu`: accelerate turns an FSDP launch into DDP when the processes run on the CPU; put FSDP back so the
  CPU tests run accelerate's own FSDP2 code (prepare, get_state_dict, no_sync) as a GPU run does.
- `configure_fsdp`: the wrap unit is the trained denoiser's block class(es), read from the model itself
  (diffusers' `_no_split_modules`), and the frozen models that train nothing stay unsharded (ignored).
- `engine_line`: the log line naming the engine and the sharding.
- `trainable_after_prepare`: FSDP2 replaces every parameter by a sharded one, so a list taken before `prepare`
  (the loop's `params`, given to clip_grad_norm_) no longer is the model's.
"""

from __future__ import annotations

import os

import torch


def is_fsdp2(accelerator) -> bool:
    return bool(getattr(accelerator, "is_fsdp2", False))


def fsdp_on_cpu(accelerator) -> bool:
    """Under `accelerate launch` with an FSDP config and no CUDA, `Accelerator(cpu=True)` runs DDP (its state only
    takes the FSDP branch for GPU-like process types) and `Accelerator(cpu=False)` runs N separate single processes.
    Switch the state to FSDP with the launcher's plugin; everything after is accelerate's FSDP2 code."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true" or torch.cuda.is_available():
        return False
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate builds it
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # every later AcceleratorState() copies PartialState's type over its own, as accelerate's own init ends
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def deepspeed_on_cpu() -> None:
    """`Accelerator(cpu=True)` drops DeepSpeed (DDP instead) and `cpu=False` without CUDA counts one process while
    DeepSpeed's communication has N; naming the gloo backend, without cpu=True, gives accelerate's DeepSpeed
    engine over N CPU processes. (Integration: make_accelerator passes these arguments itself.)"""
    import accelerate
    from accelerate.utils import InitProcessGroupKwargs

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true" or torch.cuda.is_available():
        return
    original = accelerate.Accelerator

    class CpuDeepSpeedAccelerator(original):
        def __init__(self, *args, cpu=False, kwargs_handlers=None, **kwargs):
            handlers = [h for h in (kwargs_handlers or []) if not isinstance(h, InitProcessGroupKwargs)]
            super().__init__(*args, cpu=False, kwargs_handlers=[*handlers, InitProcessGroupKwargs(backend="gloo")],
                             **kwargs)

    accelerate.Accelerator = CpuDeepSpeedAccelerator


def block_classes(model: torch.nn.Module) -> list[str]:
    """The repeated block classes of a diffusers denoiser: the FSDP unit (QwenImageTransformerBlock;
    FluxTransformerBlock + FluxSingleTransformerBlock; WanTransformerBlock)."""
    return list(getattr(model, "_no_split_modules", None) or getattr(model, "_repeated_blocks", None) or [])


def configure_fsdp(accelerator, module) -> dict:
    """Before `prepare`: one FSDP unit per block of each model that trains something; models that train nothing
    (one-stage training's text encoder and VAE) are left out of the sharding. Returns what was chosen."""
    plugin = accelerator.state.fsdp_plugin
    models = dict(module.pipe.loaded_models())
    trained = {n: m for n, m in models.items() if any(p.requires_grad for p in m.parameters())}
    frozen = [m for n, m in models.items() if n not in trained]
    classes = []
    for model in trained.values():
        classes += [c for c in block_classes(model) if c not in classes]
    given = plugin.transformer_cls_names_to_wrap
    if classes and (not given or not all(_has_class(module, c) for c in given)):
        from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

        plugin.auto_wrap_policy = transformer_auto_wrap_policy  # the config may say NO_WRAP or name another family
        plugin.transformer_cls_names_to_wrap = classes
    plugin.ignored_modules = frozen or None
    units = sum(1 for m in module.modules() if type(m).__name__ in (plugin.transformer_cls_names_to_wrap or []))
    return {"trained": sorted(trained), "unsharded": sorted(n for n in models if n not in trained),
            "units": units, "classes": list(plugin.transformer_cls_names_to_wrap or [])}


def _has_class(module, name: str) -> bool:
    return any(type(m).__name__ == name for m in module.modules())


def engine_line(accelerator, chosen: dict | None = None) -> str:
    """One log line: which engine, over how many processes, and how the model is sharded."""
    from accelerate.utils import DistributedType

    kind, n = accelerator.state.distributed_type, accelerator.num_processes
    if kind == DistributedType.FSDP:
        plugin = accelerator.state.fsdp_plugin
        reshard = "FULL_SHARD" if plugin.reshard_after_forward else "SHARD_GRAD_OP"
        line = f"engine: FSDP{plugin.fsdp_version} over {n} process(es) ({accelerator.device.type}), {reshard}"
        if chosen:
            line += (f", one unit per {'/'.join(chosen['classes'])} ({chosen['units']} units) in "
                     f"{', '.join(chosen['trained'])}")
            if chosen["unsharded"]:
                line += f"; not sharded (frozen): {', '.join(chosen['unsharded'])}"
        return line
    if kind == DistributedType.DEEPSPEED:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        off = [f"{k.split('_')[1]} on {v.get('device')}" for k, v in zero.items()
               if k.startswith("offload_") and isinstance(v, dict) and v.get("device") not in (None, "none")]
        return f"engine: DeepSpeed ZeRO-{zero.get('stage')} over {n} process(es)" + (f", {', '.join(off)}" if off else "")
    if n > 1:
        return f"engine: DDP over {n} process(es) ({accelerator.device.type}), every process holds the whole model"
    return f"engine: one process ({accelerator.device.type})"


def trainable_after_prepare(module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def local_bytes(tensors) -> int:
    """Bytes this process holds for these tensors (a DTensor's local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def state_bytes(module, optimizer) -> dict:
    """This process's trainable parameters and optimizer state, in bytes (what sharding divides)."""
    params = trainable_after_prepare(module)
    opt = getattr(optimizer, "optimizer", optimizer)
    moments = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": local_bytes(params), "optimizer": local_bytes(moments)}
