"""Model offload (`--enable_model_cpu_offload`, `--blocks_to_swap N`): the frozen weights of a denoiser's repeated
blocks live in one host arena and are copied to the target device unit by unit, just before the unit runs.

- The blocks are found generically: the model's largest `nn.ModuleList` (by frozen bytes). `--blocks_to_swap N`
  offloads its last N blocks; the others stay resident. `--cpu_offload_split_threshold MB` splits a block larger
  than that into its children (recursively), each a unit of its own; a split module's non-layer children (norms)
  stay in its own unit, since a forward may read their weights without calling them.
- A UNet's blocks sit in lists of mixed classes (diffusers' `down_blocks` = [CrossAttnDownBlock2D, ..., DownBlock2D],
  `up_blocks`, and a `mid_block` beside them), and its gradient checkpointing wraps the modules inside them one by
  one (each ResnetBlock2D and each BasicTransformerBlock), not the down / up blocks: a recompute calls only those, so
  they are the blocks here (the innermost modules of the classes the model declares). The rest of a down / up block
  (down- and upsamplers, a Transformer2DModel's norm and projections) runs outside the checkpoints and stays
  resident. Registration order is not execution order there (diffusers registers `up_blocks` before `mid_block`,
  a block's attentions before its resnets), so the first forward pass records the order, and the first backward
  pass settles it: the units are sorted as they ran, and with `--blocks_to_swap N` the blocks before the last N to
  run go to the device then (until then, every block streams). A block the model runs with gradients outside its
  checkpoints (diffusers' mid block runs its first resnet so) saves its weights for backward, so streaming it
  frees nothing: it is kept on the device from its first such run.
- Only frozen parameters move; trainable ones (LoRA) stay resident. Plain weights go through the arena; quantised
  tensor-subclass weights (torchao) are kept on the host as they are and onloaded on the compute stream.
- Between uses a weight is an EMPTY placeholder on the device, so a use that missed its onload raises (a shape
  error) instead of computing with stale values.
- Copies are host-to-device only (frozen weights never change): offloading drops the device copy. With CUDA the
  arena is pinned and the next unit is prefetched on a side stream while the current one computes.
- Gradient checkpointing is required (the blocks save nothing for backward, so dropping a unit's weights after its
  forward frees them). In backward, the recompute's forward pre-hook onloads the unit again; it stays until the
  unit after next (in backward order) is onloaded, and every unit is dropped when the backward pass ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import UserError

BACKWARD_LAG = 1  # units kept after their recompute in backward (a block's last backward nodes may run late)


@dataclass(eq=False)  # compared by identity
class Unit:
    """Weights onloaded together: a block (or part of one), its frozen plain parameters and their arena views."""

    name: str
    module: nn.Module
    block: int  # index of the block it belongs to
    params: list[nn.Parameter] = field(default_factory=list)
    host: list[torch.Tensor] = field(default_factory=list)
    subs: list = field(default_factory=list)  # (module, name, host tensor) of tensor-subclass weights
    onloaded: bool = False
    event: object = None  # CUDA: the copy's event on the side stream
    resident: bool = False  # taken out of streaming (a UNet's block before the last N, or one run unchecked)
    unchecked: bool = False  # the model ran it with gradients outside its checkpoints

    @property
    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host) + sum(_bytes(t) for _, _, t in self.subs)


def _bytes(t: torch.Tensor) -> int:
    """A tensor's bytes; a tensor subclass's are its inner tensors' (a quantised weight's data and scales)."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return t.numel() * t.element_size()
    return sum(_bytes(getattr(t, name)) for name in t.__tensor_flatten__()[0])


def find_blocks(model: nn.Module) -> list[tuple[str, nn.ModuleList]]:
    """The model's repeated blocks: its nn.ModuleLists of one composite module class (the classes the model declares
    as its blocks, diffusers' `_repeated_blocks` / `_no_split_modules`, where it declares any) holding at least a
    quarter of the frozen bytes of the largest such list, in the order the model registers them (FLUX: the
    double-stream, then the single-stream blocks); a list inside a chosen one is part of it."""
    declared = {*(getattr(model, "_repeated_blocks", None) or ()), *(getattr(model, "_no_split_modules", None) or ())}
    lists = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m) or len({type(c) for c in m}) != 1:
            continue
        if next(iter(m[0].children()), None) is None:  # a list of plain layers, not of blocks
            continue
        size = sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)
        if size:
            lists.append((name, m, size, type(m[0]).__name__ in declared))
    if any(own for *_, own in lists):
        lists = [entry for entry in lists if entry[3]]
    if not lists:
        return []
    largest = max(size for _, _, size, _ in lists)
    chosen = []
    for name, m, size, _ in lists:
        if size * 4 >= largest and not any(name.startswith(f"{c}.") for c, _ in chosen):
            chosen.append((name, m))
    return chosen


def _composite(m: nn.Module) -> bool:
    return next(iter(m.children()), None) is not None


def _frozen_bytes(m: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)


def find_nested_blocks(model: nn.Module, found=None) -> list[tuple[str, nn.Module]]:
    """A UNet's blocks, where `found` (find_blocks') lies inside, or the model has, nn.ModuleLists of composite modules
    of more than one class: the innermost modules of the classes the model declares (UNet2DConditionModel: each
    ResnetBlock2D and BasicTransformerBlock; else the elements of its innermost one-class block lists) that hold
    frozen weights, in registration order. [] for a model whose blocks are one-class lists (a DiT)."""
    found = find_blocks(model) if found is None else found
    mixed = [name for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len({type(c) for c in m}) > 1
             and all(_composite(c) for c in m)]
    if not mixed or (found and not any(n.startswith(f"{p}.") for n, _ in found for p in mixed)):
        return []
    declared = {*(getattr(model, "_repeated_blocks", None) or ()), *(getattr(model, "_no_split_modules", None) or ())}
    if declared:
        candidates = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in declared]
    else:
        candidates = [(f"{n}.{i}", c) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)
                      and len({type(c) for c in m}) == 1 and _composite(m[0]) for i, c in enumerate(m)]
    return [(n, m) for n, m in candidates if _frozen_bytes(m) and not any(o.startswith(f"{n}.") for o, _ in candidates)]


def _describe_nested(names: list[str], modules: list[nn.Module]) -> str:
    """'ResnetBlock2D, BasicTransformerBlock in down_blocks, mid_block, up_blocks' (in the order given)."""
    classes = dict.fromkeys(type(m).__name__ for m in modules)
    tops = dict.fromkeys(n.split(".")[0] for n in names)
    return f"{', '.join(classes)} in {', '.join(tops)}"


def _movable(p: nn.Parameter) -> bool:
    return not p.requires_grad and type(p.data) is torch.Tensor and p.numel() > 0


def _subclass(p) -> bool:
    return p is not None and not p.requires_grad and type(p.data) is not torch.Tensor and p.numel() > 0


def _layer(m: nn.Module) -> bool:
    """A layer whose weights only its own forward reads (a Linear, a convolution, their quantised / fp8 forms)."""
    return isinstance(m, (nn.Linear, nn.modules.conv._ConvNd))


def _split(name: str, module: nn.Module, threshold: int | None) -> list[tuple[str, nn.Module, list[nn.Module] | None]]:
    """(name, module, owners) units covering `module`'s frozen weights: the module whole (owners None) when under
    `threshold` bytes (or no threshold), else a unit of its own direct weights and those of its children that are
    not layers (norms, embeddings: a forward may read them without calling them, as Z-Image's attention reads its
    norms' weights), plus its other children's units. A list is never a unit: nobody calls it, so its hooks would
    never run (diffusers' Attention calls `to_out[0]`)."""
    size = sum(_bytes(p.data) for p in module.parameters() if _movable(p) or _subclass(p))
    children = list(module.named_children())
    container = isinstance(module, (nn.ModuleList, nn.ModuleDict))
    if (threshold is None or size <= threshold or not children) and not container:
        return [(name, module, None)]
    held = [] if container else [c for _, c in children if not _composite(c) and not _layer(c)]
    owners = [module, *held]
    out = [(name, module, owners)] if any(_movable(p) or _subclass(p) for m in owners
                                          for p in m.parameters(recurse=False)) else []
    for child_name, child in children:
        if not any(child is h for h in held):
            out += _split(f"{name}.{child_name}", child, threshold)
    return out


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _checkpointed() -> bool:
    """Whether saved tensors are being intercepted (a non-reentrant checkpoint or its recompute is running)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


class ModelOffloader:
    """Installs the hooks on `model` (loaded anywhere; its weights outside the offloaded units end on `device`)."""

    def __init__(self, model: nn.Module, device, blocks_to_swap: int | None = None,
                 split_threshold_mb: float | None = None, pin: bool | None = None, prefetch: bool = True,
                 label: str = "model", log=None):
        found = find_blocks(model)
        nested = find_nested_blocks(model, found)
        if not found and not nested:
            trained = any(isinstance(m, nn.ModuleList) and len(m) and all(p.requires_grad for p in m.parameters())
                          and any(True for _ in m.parameters()) for m in model.modules())
            raise UserError(f"model offload: every weight of {type(model).__name__}'s blocks is trained, and only "
                            f"frozen weights are offloaded" if trained else
                            f"model offload: {type(model).__name__} has no list of repeated blocks to offload")
        self.model, self.device = model, torch.device(device)
        self.label, self._log = label, log
        if nested:
            blocks = nested
            self.blocks_name = _describe_nested([n for n, _ in blocks], [m for _, m in blocks])
        else:
            self.blocks_name = ", ".join(name for name, _ in found)
            blocks = [(f"{name}.{i}", block) for name, blocks in found for i, block in enumerate(blocks)]
        self.nested = bool(nested)
        self._block_names = [name for name, _ in blocks]
        self.num_blocks = len(blocks)
        n = self.num_blocks if blocks_to_swap is None else int(blocks_to_swap)
        if not 0 <= n <= self.num_blocks:
            raise UserError(f"--blocks_to_swap {blocks_to_swap}: {type(model).__name__} has {self.num_blocks} blocks "
                            f"({self.blocks_name}); give 0 to {self.num_blocks}")
        self.swapped = n
        cuda = self.device.type == "cuda"
        self.pin = cuda if pin is None else pin
        self.stream = torch.cuda.Stream(self.device) if cuda and prefetch else None
        threshold = None if split_threshold_mb is None else int(split_threshold_mb * 2 ** 20)
        self.units: list[Unit] = []
        self.kept: list[Unit] = []  # units taken out of streaming, their weights on the device for good
        # A UNet's execution order is known after its first forward pass: every block streams until then.
        self._settled = not self.nested or n == 0
        first = self.num_blocks - n if self._settled else 0
        for i in range(first, self.num_blocks):
            for name, module, owners in _split(*blocks[i], threshold):
                owners = list(module.modules()) if owners is None else owners
                params = list({id(p): p for m in owners for p in m.parameters(recurse=False) if _movable(p)}.values())
                subs = [(m, key, p.detach().to("cpu")) for m in owners for key, p in m._parameters.items()
                        if _subclass(p)]
                if params or subs:
                    self.units.append(Unit(name, module, i, params, subs=subs))
        self._reindex()
        self._order: list[Unit] = []  # units as the first forward pass ran them (a UNet's)
        self._seen: set[int] = set()
        self._recording = not self._settled
        self._saw_checkpoint = False
        self._handles = []
        self._task = None  # the backward pass whose end drops every unit
        self.peak_onloaded = self.onloaded_bytes = 0
        self.onloads = 0
        self._build_arena()
        model.to(self.device)  # the rest of the model (placeholders are on the device already)
        for unit in self.units:
            self._handles.append(unit.module.register_forward_pre_hook(self._pre_hook(unit)))
            self._handles.append(unit.module.register_forward_hook(self._post_hook(unit)))
        self._handles.append(model.register_state_dict_post_hook(
            lambda module, state, prefix, meta: self._real_weights(state, prefix)))

    def _reindex(self) -> None:
        self._index = {id(u): k for k, u in enumerate(self.units)}

    # -- the arena ------------------------------------------------------------------------------------------------
    def _build_arena(self) -> None:
        by_dtype: dict[torch.dtype, int] = {}
        for unit in self.units:
            for p in unit.params:
                by_dtype[p.dtype] = by_dtype.get(p.dtype, 0) + p.numel()
        self.arenas = {}
        for dtype, numel in by_dtype.items():  # one allocation per dtype: no per-tensor pinning rounding
            arena = torch.empty(numel, dtype=dtype)
            if self.pin:
                from torch.cuda._pin_memory_utils import pin_memory

                pin_memory(arena.data_ptr(), arena.numel() * arena.element_size())
            self.arenas[dtype] = arena
        offsets = dict.fromkeys(by_dtype, 0)
        for unit in self.units:
            for p in unit.params:
                at = offsets[p.dtype]
                view = self.arenas[p.dtype][at:at + p.numel()].view(p.shape)
                view.copy_(p.data)
                offsets[p.dtype] = at + p.numel()
                unit.host.append(view)
                p.data = self._placeholder(p)
        for unit in self.units:
            for m, n, host in unit.subs:
                m._parameters[n] = nn.Parameter(self._placeholder(host), requires_grad=False)

    def _placeholder(self, p) -> torch.Tensor:
        return torch.empty(0, dtype=p.dtype, device=self.device)

    @property
    def arena_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.arenas.values())

    @property
    def host_bytes(self) -> int:
        """Frozen weight bytes kept on the host: the arena and the quantised weights."""
        return self.arena_bytes + sum(_bytes(t) for u in (*self.units, *self.kept) for _, _, t in u.subs)

    def resident_bytes(self) -> int:
        """Bytes the model keeps on the device between unit uses (parameters and buffers; placeholders are 0)."""
        tensors = {id(t): t for t in (*self.model.parameters(), *self.model.buffers()) if t.device == self.device}
        return sum(_bytes(t.data if isinstance(t, nn.Parameter) else t) for t in tensors.values())

    @property
    def unchecked(self) -> list[str]:
        """The offloaded units kept on the device because the model runs them with gradients outside its checkpoints."""
        first = self.num_blocks - self.swapped if self._settled else 0
        return [u.name for u in self.kept if u.unchecked and u.block >= first]

    def describe(self, label: str | None = None) -> str:
        gib = 2 ** 30
        biggest = max((u.nbytes for u in self.units), default=0)
        what = f"{self.swapped} of {self.num_blocks} blocks ({self.blocks_name})"
        if not self._settled and self.swapped < self.num_blocks:
            what += ", the last to run (all stream until the first backward pass, which knows the order)"
        if unchecked := self.unchecked:
            what += (f", {len(unchecked)} of them kept on {self.device} (run outside the model's gradient "
                     f"checkpointing: {', '.join(unchecked[:2])}{', ...' if len(unchecked) > 2 else ''})")
        return (f"model offload: {label or self.label}: {what} in "
                f"{len(self.units)} unit(s), {self.host_bytes / gib:.3f} GiB of frozen weights on the host "
                f"({'pinned ' if self.pin else ''}arena {self.arena_bytes / gib:.3f} GiB); resident on {self.device}: "
                f"{self.resident_bytes() / gib:.3f} GiB (+ up to {2 + BACKWARD_LAG} unit(s) of at most "
                f"{biggest / gib:.3f} GiB while streaming{', prefetched on a side stream' if self.stream else ''})")

    # -- onload / offload -------------------------------------------------------------------------------------------
    def _start(self, unit: Unit) -> None:
        """Begin copying `unit` to the device (on the side stream with CUDA); its parameters point at the copies."""
        if unit.onloaded:
            return
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                copies = [torch.empty_like(h, device=self.device).copy_(h, non_blocking=True) for h in unit.host]
                unit.event = torch.cuda.Event()
                unit.event.record(self.stream)
        else:  # a fresh tensor even when the device is the CPU: the arena is never what the model computes with
            copies = [torch.empty_like(h, device=self.device).copy_(h) for h in unit.host]
        for p, c in zip(unit.params, copies):
            p.data = c
        for m, n, host in unit.subs:  # on the compute stream: no side-stream memory to hand over
            copy = host.clone() if self.device.type == "cpu" else host.to(self.device, non_blocking=True)
            m._parameters[n] = nn.Parameter(copy, requires_grad=False)
        unit.onloaded = True
        self.onloads += 1
        self.onloaded_bytes += unit.nbytes
        self.peak_onloaded = max(self.peak_onloaded, self.onloaded_bytes)

    def _ready(self, unit: Unit) -> None:
        self._start(unit)
        if unit.event is not None:  # the compute stream waits for the copy, and owns the copies from now on
            stream = torch.cuda.current_stream(self.device)
            stream.wait_event(unit.event)
            for p in unit.params:
                p.data.record_stream(stream)
            unit.event = None

    def _drop(self, unit: Unit) -> None:
        if not unit.onloaded:
            return
        if unit.event is not None:  # prefetched but never used: the side stream must finish before the memory goes
            unit.event.synchronize()
            unit.event = None
        for p in unit.params:
            p.data = self._placeholder(p)
        for m, n, host in unit.subs:
            m._parameters[n] = nn.Parameter(self._placeholder(host), requires_grad=False)
        unit.onloaded = False
        self.onloaded_bytes -= unit.nbytes

    def drop_all(self) -> None:
        for unit in self.units:
            self._drop(unit)

    def _keep(self, unit: Unit, unchecked: bool = False) -> None:
        """Take `unit` out of streaming: its weights go to the device for good."""
        self._ready(unit)
        self.onloaded_bytes -= unit.nbytes
        unit.resident, unit.unchecked = True, unchecked
        self.units.remove(unit)
        self.kept.append(unit)
        self._reindex()

    def _settle(self) -> None:
        """At a UNet's first backward pass: the blocks and units in the order the first forward ran them (any it did
        not run after them, as registered), and the blocks before the last `swapped` to run kept on the device."""
        self._settled, self._recording = True, False
        seen = {id(u): i for i, u in enumerate(self._order)}
        everything = sorted((*self.units, *self.kept), key=lambda u: seen.get(id(u), len(seen)))
        rank: dict[int, int] = {}
        for b in (*(u.block for u in everything), *range(self.num_blocks)):
            rank.setdefault(b, len(rank))
        names = [""] * self.num_blocks
        for b, name in enumerate(self._block_names):
            names[rank[b]] = name
        self._block_names = names
        for u in everything:
            u.block = rank[u.block]
        self.units = [u for u in everything if not u.resident]
        self._reindex()
        for u in [u for u in self.units if u.block < self.num_blocks - self.swapped]:
            self._keep(u)
        modules = dict(self.model.named_modules())
        self.blocks_name = _describe_nested(names, [modules[n] for n in names])
        if self._log:
            self._log(self.describe())

    def _pre_hook(self, unit: Unit):
        def hook(module, args):
            backward = _in_backward()
            if self._recording and not backward:  # a UNet's first forward pass: the order its units run in
                if id(unit) in self._seen:
                    self._recording = False
                else:
                    self._order.append(unit)
                    self._seen.add(id(unit))
            if unit.resident:
                return
            if torch.is_grad_enabled() and not backward and not _checkpointed():
                if not (self.nested and self._saw_checkpoint):
                    raise UserError("model offload: a block ran with gradients but without gradient checkpointing; "
                                    "offloaded weights need --use_gradient_checkpointing")
                self._keep(unit, unchecked=True)  # its weights are saved for backward: streaming frees nothing
                if self._settled and self._log:
                    self._log(self.describe())
                return
            if backward:
                self._at_end_of_backward()
                if not self._settled:
                    self._settle()
                    if unit.resident:
                        return
            elif torch.is_grad_enabled():
                self._saw_checkpoint = True
            k = self._index[id(unit)]
            if backward:  # blocks run in reverse; a recompute onloads a whole block's units before its backward
                for other in self.units:  # blocks more than the lag behind (in backward order) are done with
                    if other.block > unit.block + BACKWARD_LAG or other.block < unit.block - 1:
                        self._drop(other)
            self._ready(unit)
            nxt = k - 1 if backward else k + 1  # prefetch the next unit in this pass's order
            if self.stream is not None and self._settled and 0 <= nxt < len(self.units):
                self._start(self.units[nxt])
        return hook

    def _post_hook(self, unit: Unit):
        def hook(module, args, output):
            if not unit.resident and not _in_backward():  # in backward the recompute's saved tensors may be the
                self._drop(unit)  # parameters themselves
        return hook

    def _at_end_of_backward(self) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._task:
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._task = None
        self.drop_all()

    # -- state dict -------------------------------------------------------------------------------------------------
    def _real_weights(self, state_dict, prefix) -> None:
        """`state_dict()` holds the arena's weights, never placeholders."""
        names = {id(p): n for n, p in self.model.named_parameters(remove_duplicate=False)}
        modules = {id(m): n for n, m in self.model.named_modules(remove_duplicate=False)}
        for unit in self.units:
            for p, h in zip(unit.params, unit.host):
                key = prefix + names[id(p)]
                if key in state_dict:
                    state_dict[key] = h
            for m, n, h in unit.subs:
                key = prefix + (f"{modules[id(m)]}.{n}" if modules[id(m)] else n)
                if key in state_dict:
                    state_dict[key] = h

    def remove(self, to=None) -> None:
        """Remove the hooks and put every weight back whole: on the device, or on `to` (the host: the arena's own
        memory, no copy)."""
        target = self.device if to is None else torch.device(to)
        self.drop_all()
        for h in self._handles:
            h.remove()
        for unit in self.units:
            for p, h in zip(unit.params, unit.host):
                p.data = h if target.type == "cpu" else h.to(target, copy=True)
            for m, n, h in unit.subs:
                m._parameters[n] = nn.Parameter(h.to(target), requires_grad=False)
        if to is not None:
            self.model.to(target)
        if self.pin:
            from torch.cuda._pin_memory_utils import unpin_memory

            for arena in self.arenas.values():
                unpin_memory(arena.data_ptr())
        self.units, self.kept, self.arenas = [], [], {}


def refuse_sharded_engines(accelerator, flag: str) -> None:
    """FSDP2 and DeepSpeed place and shard the weights themselves: combining them with offload is refused."""
    from .engines import DEEPSPEED, FSDP, engine_of

    engine = engine_of(accelerator)
    if engine in (FSDP, DEEPSPEED):
        other = "its offload_param / offload_optimizer settings" if engine == DEEPSPEED else "FSDP2's own CPU offload"
        raise UserError(f"{flag}: not supported under {engine} (it shards the weights itself; use {other}, or "
                        f"launch with DDP or one process)")


def model_offload_requested(config) -> bool:
    return bool(config.enable_model_cpu_offload) or config.blocks_to_swap is not None


def offload_settings(config, log=print):
    """The run's configuration for model offload: the models load on the CPU (the offloader places them) and the
    blocks are checkpointed (their weights are then needed again only in their recompute)."""
    if not model_offload_requested(config):
        return config
    if not config.use_gradient_checkpointing:
        log("note: model offload turns --use_gradient_checkpointing on (a block's weights are then needed in backward "
            "only in its recompute, so they can leave the GPU after its forward)")
    return config.replace(use_gradient_checkpointing=True, initialize_model_on_cpu=True)


def install_model_offload(module, config, accelerator, log=print) -> list[ModelOffloader]:
    """Offload the denoiser(s) of a training module per the flags; one ModelOffloader per model offloaded."""
    if not model_offload_requested(config):
        return []
    flag = "--blocks_to_swap" if config.blocks_to_swap is not None else "--enable_model_cpu_offload"
    refuse_sharded_engines(accelerator, flag)
    pipe = module.pipe
    slots = [s for s in (getattr(pipe, "loss_models", None) or ()) if pipe.models.get(s) is not None]
    if not slots:
        raise UserError(f"{flag}: this pipeline names no denoiser to offload")
    whole = [s for s in slots if s in config.trainable_models]  # a submodule trained (dit.blocks.0.x) leaves the rest
    if whole:
        raise UserError(f"{flag}: {whole[0]} is trained in full (--trainable_models {whole[0]}), and model offload "
                        f"streams frozen weights only (trained ones stay on the GPU with their gradients); train a "
                        f"LoRA on it (--lora_base_model {whole[0]}), or use --enable_optimizer_cpu_offload")
    out = []
    for slot in slots:
        offloader = ModelOffloader(pipe.models[slot], accelerator.device, blocks_to_swap=config.blocks_to_swap,
                                   split_threshold_mb=config.cpu_offload_split_threshold, label=slot, log=log)
        log(offloader.describe(slot))
        out.append(offloader)
    module.offloaders = out
    return out


__all__ = ["ModelOffloader", "Unit", "find_blocks", "find_nested_blocks", "install_model_offload",
           "model_offload_requested", "offload_settings", "refuse_sharded_engines"]
