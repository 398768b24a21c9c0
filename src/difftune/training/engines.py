"""The engine a run trains with: one process, DDP, FSDP2 or DeepSpeed ZeRO, as `accelerate launch` chose it, and
what difftune sets on each so that the flags decide and the results do not depend on it.

- FSDP2: the unit of sharding is each trained model's own block class (diffusers' `_no_split_modules`), models
  that train nothing stay whole on every process (ignored by the sharding). accelerate turns an FSDP launch on
  processes without CUDA into DDP; `fsdp_on_cpu` switches it back, so the CPU (gloo) runs accelerate's own FSDP2
  code as a GPU run does. FSDP version 1 is refused.
- DeepSpeed: the micro-batch size and the gradient clipping come from the flags (--batch_size,
  --max_grad_norm); on processes without CUDA the process group is gloo (DeepSpeed's CPU accelerator).
- After `prepare`, the parameters to clip are the prepared ones (FSDP2 replaces every parameter by a sharded one).
- Checkpoints gather each trained parameter whole (`trained_state_dict`), one at a time.
- Validation renders on every process when the weights are sharded (their forward is collective).
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from ..errors import UserError
from ..util import first_line

ONE, DDP, FSDP, DEEPSPEED = "one process", "DDP", "FSDP2", "DeepSpeed"


def finish_distributed() -> None:
    """After a run's last save, on every process: wait for the others, then destroy the process group."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def exit_launched_process(code: int) -> None:
    """A training process started by `accelerate launch` (torchrun) ends here, without the interpreter's
    finalisation. FSDP2's device meshes keep the gloo process group alive past `destroy_process_group` (its worker
    threads still run), so it was torn down during finalisation, where a worker thread dropping a tensor needs the
    GIL of a dying interpreter: std::terminate, SIGABRT on a rank, now and then under load. Everything the run
    writes is written and closed by now (atomic files, trackers finished); the streams are flushed here."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def launched_with() -> str | None:
    """The sharded engine `accelerate launch` was configured for (its environment), before any Accelerator."""
    if _env_true("ACCELERATE_USE_DEEPSPEED"):
        return DEEPSPEED
    if _env_true("ACCELERATE_USE_FSDP"):
        return FSDP
    return None


def accelerator_arguments() -> dict:
    """What `Accelerator(...)` needs besides the run's settings for the launched engine to run here.

    Without CUDA, `Accelerator(cpu=True)` is what gives gloo DDP over several processes; a DeepSpeed launch needs
    cpu=False (cpu=True drops DeepSpeed for DDP) and the gloo backend named, or accelerate counts one process while
    DeepSpeed counts N."""
    from accelerate.utils import InitProcessGroupKwargs

    if launched_with() == DEEPSPEED:
        require_deepspeed()
    cuda = torch.cuda.is_available()
    if launched_with() == DEEPSPEED and not cuda:
        return {"cpu": False, "kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}
    return {"cpu": not cuda, "kwargs_handlers": []}


def require_deepspeed() -> None:
    """A DeepSpeed launch on a machine without deepspeed: one line naming it and the install extra (accelerate's
    ImportError traceback from inside `Accelerator(...)` before)."""
    import importlib

    try:
        importlib.import_module("deepspeed")
    except ImportError as e:
        raise UserError(f"the accelerate config launches DeepSpeed (ACCELERATE_USE_DEEPSPEED=true) and deepspeed is "
                        f"not installed here ({first_line(e)}): pip install 'difftune[deepspeed]', or launch with "
                        f"another accelerate config") from None


def after_accelerator(accelerator) -> None:
    """The engine the launcher asked for, checked and (on CPU processes) put in place."""
    fsdp_on_cpu(accelerator)
    if engine_of(accelerator) == FSDP:
        version = accelerator.state.fsdp_plugin.fsdp_version
        if version != 2:
            raise UserError(f"the accelerate config sets fsdp_version {version}: difftune trains with FSDP2 "
                            f"(fsdp_version: 2, as in examples/accelerate/fsdp.yaml)")
        try:  # the sharded training state's storage
            from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter  # noqa: F401
        except ImportError:
            raise UserError(f"FSDP2 training with torch {torch.__version__}: its torch.distributed.checkpoint has no "
                            f"safetensors storage (HuggingFaceStorageWriter), which the sharded training state needs; "
                            f"upgrade torch") from None


def fsdp_on_cpu(accelerator) -> bool:
    """Under an FSDP launch without CUDA, `Accelerator(cpu=True)` runs DDP (accelerate takes the FSDP branch for
    GPU-like processes only): switch the state to FSDP with the launcher's plugin. Everything after is
    accelerate's FSDP2 code (prepare, no_sync, clip_grad_norm_)."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if launched_with() != FSDP or torch.cuda.is_available():
        return False
    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False  # one process: nothing to shard over
    plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_* variables, as accelerate builds it
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    # every later AcceleratorState() copies PartialState's type over its own (as accelerate's own init ends)
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def engine_of(accelerator) -> str:
    from accelerate.utils import DistributedType

    kind = accelerator.state.distributed_type
    if kind == DistributedType.FSDP:
        return FSDP
    if kind == DistributedType.DEEPSPEED:
        return DEEPSPEED
    return DDP if accelerator.num_processes > 1 else ONE


def zero_stage(accelerator) -> int | None:
    if engine_of(accelerator) != DEEPSPEED:
        return None
    return int(accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))


def shards_weights(accelerator) -> bool:
    """Whether a forward of the trained model is a collective call (every process must make it)."""
    return engine_of(accelerator) == FSDP or zero_stage(accelerator) == 3


# -- before prepare -----------------------------------------------------------------------------------------------

def block_classes(model: torch.nn.Module) -> list[str]:
    """A model's repeated block classes, as it declares them (diffusers' / transformers' `_no_split_modules`)."""
    return list(getattr(model, "_no_split_modules", None) or [])


def before_prepare(accelerator, module, batch_size: int, max_grad_norm: float | None) -> dict:
    """Set the engine up for this module (before `accelerator.prepare`); returns what was chosen, for the log."""
    engine = engine_of(accelerator)
    if engine == FSDP:
        return configure_fsdp(accelerator, module)
    if engine == DEEPSPEED:
        return configure_deepspeed(accelerator, batch_size, max_grad_norm)
    return {}


def configure_fsdp(accelerator, module) -> dict:
    """One FSDP unit per block of each model that trains something; models that train nothing are left whole.

    A config that names its own layer classes (fsdp_transformer_layer_cls_to_wrap) or another policy (NO_WRAP,
    SIZE_BASED_WRAP) keeps them; a named class the trained models do not have is refused here, in one line."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = accelerator.state.fsdp_plugin
    if not hasattr(plugin, "_difftune_asked"):  # what the config said, before prepare() turned it into a partial
        plugin._difftune_asked = (plugin.auto_wrap_policy, plugin.transformer_cls_names_to_wrap)
    policy, named = plugin._difftune_asked
    models = dict(module.pipe.loaded_models()) if hasattr(module, "pipe") else {"model": module}
    trained = {n: m for n, m in models.items() if any(p.requires_grad for p in m.parameters())}
    frozen = [m for n, m in models.items() if n not in trained]
    chosen = {"trained": sorted(trained), "whole": sorted(n for n in models if n not in trained), "classes": []}
    if policy is transformer_auto_wrap_policy:
        present = {type(m).__name__ for model in trained.values() for m in model.modules()}
        if named:
            missing = [c for c in named if c not in present]
            if missing:
                ours = sorted({c for model in trained.values() for c in block_classes(model)})
                raise UserError(f"the accelerate config's fsdp_transformer_layer_cls_to_wrap names {missing[0]}, "
                                f"which the trained models ({', '.join(sorted(trained))}) do not have (their blocks: "
                                f"{', '.join(ours) or 'none declared'}); remove it and difftune wraps their blocks")
            classes = list(named)
        else:
            classes = []
            for model in trained.values():
                classes += [c for c in block_classes(model) if c not in classes and c in present]
        plugin.auto_wrap_policy = transformer_auto_wrap_policy
        plugin.transformer_cls_names_to_wrap = classes
        chosen["classes"] = classes
        chosen["units"] = sum(1 for m in module.modules() if type(m).__name__ in classes)
    else:
        plugin.auto_wrap_policy = policy
        chosen["policy"] = "NO_WRAP" if policy is None else getattr(policy, "__name__", str(policy))
    plugin.ignored_modules = frozen or None
    return chosen


def configure_deepspeed(accelerator, batch_size: int, max_grad_norm: float | None) -> dict:
    """No DataLoader goes through prepare(), so DeepSpeed cannot read the micro-batch size from one; its gradient
    clipping is --max_grad_norm (accelerate would fill an `auto` with 1.0, and the loop's clip does nothing under
    DeepSpeed). A config that sets another clipping value is refused, as for the accumulation steps."""
    plugin = accelerator.state.deepspeed_plugin
    config = plugin.deepspeed_config
    if plugin.is_auto("train_micro_batch_size_per_gpu"):
        config["train_micro_batch_size_per_gpu"] = batch_size
    wanted = float(max_grad_norm or 0.0)
    given = config.get("gradient_clipping", "auto")
    if given == "auto" or given is None:
        config["gradient_clipping"] = wanted
    elif float(given) != wanted:
        flag = f"is {max_grad_norm:g}" if max_grad_norm else "is not given (no clipping)"
        raise UserError(f"the DeepSpeed config sets gradient_clipping to {given} but --max_grad_norm {flag}: "
                        f"remove it from the config or pass --max_grad_norm {given} (the flag decides)")
    return {"clipping": wanted}


# -- after prepare ------------------------------------------------------------------------------------------------

def trainable_parameters(module) -> list[torch.nn.Parameter]:
    """The prepared module's trainable parameters (FSDP2 has replaced each by a sharded one)."""
    return [p for p in module.parameters() if p.requires_grad]


def engine_line(accelerator, chosen: dict | None = None) -> str:
    """One log line: which engine, over how many processes, and how the model is sharded."""
    engine, n, device = engine_of(accelerator), accelerator.num_processes, accelerator.device.type
    chosen = chosen or {}
    if engine == FSDP:
        plugin = accelerator.state.fsdp_plugin
        line = (f"engine: FSDP2 over {n} processes ({device}), "
                f"{'FULL_SHARD' if plugin.reshard_after_forward else 'SHARD_GRAD_OP'}")
        if chosen.get("classes"):
            line += (f", one unit per {'/'.join(chosen['classes'])} ({chosen['units']} units) in "
                     f"{', '.join(chosen['trained'])}")
        elif "policy" in chosen or "classes" in chosen:
            line += f", {chosen.get('policy', 'no block class declared')}: one unit per trained model"
        if chosen.get("whole"):
            line += f"; whole on every process (frozen): {', '.join(chosen['whole'])}"
        return line + "; training state sharded"
    if engine == DEEPSPEED:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        off = [f"{what} on {zero[key]['device']}" for key, what in (("offload_optimizer", "optimizer"),
                                                                   ("offload_param", "parameters"))
               if isinstance(zero.get(key), dict) and zero[key].get("device") not in (None, "none")
               and (what == "optimizer" or zero.get("stage") == 3)]  # parameters are offloaded by ZeRO-3 only
        clip = chosen.get("clipping")
        return (f"engine: DeepSpeed ZeRO-{zero.get('stage')} over {n} process{'es' if n > 1 else ''} ({device})"
                + (f", {', '.join(off)}" if off else "")
                + (f", gradient clipping {clip:g}" if clip else ", no gradient clipping" if clip is not None else ""))
    if engine == DDP:
        return f"engine: DDP over {n} processes ({device}), every process holds the whole model"
    return f"engine: one process ({device})"


@contextmanager
def whole_weights(module):
    """The module's FSDP2-managed weights whole on every process for a call outside its own forward (validation
    renders through the denoiser): the root's parameters are gathered here, each block gathers its own."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()


def trained_state_dict(accelerator, module) -> dict[str, torch.Tensor]:
    """Every trained parameter whole, by name, on the main process (other processes: empty). Under FSDP2 and
    DeepSpeed each is gathered in turn (a collective call every process makes), so the main process holds the
    trained weights once and no frozen weights; DeepSpeed gives its fp32 master weights."""
    from torch.distributed.tensor import DTensor

    engine = engine_of(accelerator)
    inner = accelerator.unwrap_model(module)
    main = accelerator.is_main_process
    out = {}
    if engine == DEEPSPEED:
        from deepspeed.utils import safe_get_full_fp32_param

        for name, p in inner.named_parameters():
            if p.requires_grad:
                full = safe_get_full_fp32_param(p)
                if main:
                    out[name] = (full if full is not None else p).detach().cpu().clone()
        return out
    for name, p in inner.named_parameters():
        if not p.requires_grad:
            continue
        full = p.full_tensor() if isinstance(p, DTensor) else p
        if main:
            out[name] = full.detach().cpu().clone() if isinstance(p, DTensor) else full.detach()
    return out


def local_bytes(tensors) -> int:
    """Bytes this process holds for these tensors (a DTensor's local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


__all__ = ["DDP", "DEEPSPEED", "FSDP", "ONE", "accelerator_arguments", "after_accelerator", "before_prepare",
           "block_classes", "configure_deepspeed", "configure_fsdp", "engine_line", "engine_of", "fsdp_on_cpu",
           "launched_with", "local_bytes", "shards_weights", "trainable_parameters", "trained_state_dict",
           "whole_weights", "zero_stage"]
