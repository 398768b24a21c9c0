"""Model offload (training/offload.py) on a toy denoiser and on a tiny diffusers UNet, the target device the CPU: the
arena holds the real weights and each onload copies them into fresh tensors, so the model never computes with the
arena itself."""

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from difftune.errors import UserError
from difftune.training.offload import ModelOffloader, find_blocks, find_nested_blocks


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)  # its weight is saved for backward as the parameter itself
        self.to_q = nn.Linear(d, d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.scale = nn.Parameter(torch.randn(d))  # a weight of the block itself, outside its children
        self.register_buffer("shift", torch.linspace(-1, 1, d))

    def forward(self, x, temb):
        h = self.to_q(self.norm(x)) * self.scale + self.shift
        return x + self.ff(h + temb)


class ToyDiT(nn.Module):
    def __init__(self, d=16, n=4):
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.time = nn.Linear(1, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.heads = nn.ModuleList([nn.Linear(d, d), nn.Linear(d, d)])  # a smaller list: not the blocks
        self.out = nn.Linear(d, d)
        self.gradient_checkpointing = True

    def forward(self, x, t):
        temb = self.time(t)
        x = self.embed(x)
        for block in self.blocks:
            if torch.is_grad_enabled() and self.gradient_checkpointing:
                x = checkpoint(block, x, temb, use_reentrant=False)
            else:
                x = block(x, temb)
        return self.out(self.heads[1](self.heads[0](x)))


def lora_model(seed=0, d=16, n=4):
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(seed)
    model = ToyDiT(d, n)
    model.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "ff.0", "ff.2"]), model)
    return model


def batches(steps, d=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(3, 5, d, generator=g), torch.rand(3, 1, 1, generator=g), torch.randn(3, 5, d, generator=g))
            for _ in range(steps)]


def frozen_block_params(model):
    return [p for p in model.blocks.parameters() if not p.requires_grad]


def lora(model):
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def train(model, data):
    opt = torch.optim.AdamW(lora(model).values(), lr=1e-2)
    record = []
    for x, t, target in data:
        loss = torch.nn.functional.mse_loss(model(x, t), target)
        loss.backward()
        record.append((loss.detach().clone(), {n: p.grad.clone() for n, p in lora(model).items()}))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return record


@pytest.mark.parametrize("threshold,early_stop", [(None, True), (0.0005, True), (None, False)])
def test_offloaded_training_is_bit_exact(threshold, early_stop):
    """Early stop on (torch's default), a recompute ends at its last saved tensor, before the block's forward hook;
    off, the forward hook runs inside backward too."""
    data = batches(4)
    plain, off = lora_model(), lora_model()
    offloader = ModelOffloader(off, "cpu", split_threshold_mb=threshold)
    assert offloader.blocks_name == "blocks" and offloader.swapped == 4
    if threshold is not None:  # each block is larger than 0.5 kB: split into its children
        assert len(offloader.units) > 4 and len({u.block for u in offloader.units}) == 4
    assert all(p.numel() == 0 for p in frozen_block_params(off))  # placeholders before any use
    a = train(plain, data)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        b = train(off, data)
    for (la, ga), (lb, gb) in zip(a, b):
        assert torch.equal(la, lb)
        assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert all(torch.equal(p, lora(off)[n]) for n, p in lora(plain).items())
    assert any(n.endswith("lora_B.default.weight") for n in lora(off))
    # lora_B starts at zero: its gradient must not stay zero with checkpointing and offload (ai-toolkit #1054)
    first = b[0][1]
    assert all(g.abs().max() > 0 for n, g in first.items() if "lora_B" in n)
    assert all(p.numel() == 0 for p in frozen_block_params(off))  # every unit dropped at the end of backward
    assert offloader.onloaded_bytes == 0
    biggest = max(u.nbytes for u in offloader.units)
    per_block = sum(u.nbytes for u in offloader.units) // 4
    assert 0 < offloader.peak_onloaded <= max(3 * per_block, biggest)  # never the whole model at once


def test_the_arena_is_not_what_the_model_computes_with():
    model = lora_model()
    offloader = ModelOffloader(model, "cpu")
    seen = []
    model.blocks[0].to_q.register_forward_pre_hook(
        lambda m, a: seen.append(m.base_layer.weight.data_ptr()))
    model(*batches(1)[0][:2])
    arena = offloader.arenas[torch.float32]
    start, end = arena.data_ptr(), arena.data_ptr() + arena.numel() * arena.element_size()
    assert seen and not start <= seen[0] < end


def test_partial_swap_keeps_the_other_blocks_resident():
    model = lora_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    offloader = ModelOffloader(model, "cpu", blocks_to_swap=2)
    assert [u.block for u in offloader.units] == [2, 3]
    for i, block in enumerate(model.blocks):
        frozen = [p for p in block.parameters() if not p.requires_grad]
        assert all((p.numel() == 0) == (i >= 2) for p in frozen)
    assert "2 of 4 blocks (blocks)" in offloader.describe("dit")
    # state_dict gives the real weights (from the arena), never placeholders
    state = model.state_dict()
    assert all(torch.equal(state[n], v) for n, v in before.items())
    with pytest.raises(UserError, match="--blocks_to_swap 5: ToyDiT has 4 blocks"):
        ModelOffloader(lora_model(), "cpu", blocks_to_swap=5)


def test_a_missed_onload_raises_in_forward(monkeypatch):
    model = lora_model()
    offloader = ModelOffloader(model, "cpu")
    monkeypatch.setattr(offloader, "_ready", lambda unit: None)
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(*batches(1)[0][:2])


def test_a_missed_onload_raises_in_recompute(monkeypatch):
    from difftune.training import offload

    model = lora_model()
    offloader = ModelOffloader(model, "cpu")
    ready = offloader._ready
    monkeypatch.setattr(offloader, "_ready", lambda unit: None if offload._in_backward() else ready(unit))
    x, t, target = batches(1)[0]
    loss = torch.nn.functional.mse_loss(model(x, t), target)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_a_drop_before_backward_used_the_weights_raises(monkeypatch):
    """The recompute's saved tensors include parameters themselves (LayerNorm's weight): dropping a unit right
    after its recompute, as a plain forward does, must fail loudly rather than compute with anything else."""
    from difftune.training import offload

    monkeypatch.setattr(offload, "_in_backward", lambda: False)  # the post-hook then drops after the recompute too
    model = lora_model()
    ModelOffloader(model, "cpu")
    x, t, target = batches(1)[0]
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recomputes run to the block's forward hook
        loss = torch.nn.functional.mse_loss(model(x, t), target)
        with pytest.raises(RuntimeError):
            loss.backward()


def test_recomputed_activations_equal_the_first_forward():
    model = lora_model()
    ModelOffloader(model, "cpu")
    outputs = {}
    for i, block in enumerate(model.blocks):
        block.register_forward_hook(lambda m, a, out, i=i: outputs.setdefault(i, []).append(out.detach().clone()))
    x, t, target = batches(1)[0]
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # a recompute runs to the block's output
        torch.nn.functional.mse_loss(model(x, t), target).backward()
    assert sorted(outputs) == [0, 1, 2, 3]
    for i, outs in outputs.items():
        assert len(outs) == 2 and torch.equal(outs[0], outs[1])  # forward, then recompute in backward


def test_offload_needs_gradient_checkpointing():
    model = lora_model()
    model.gradient_checkpointing = False
    ModelOffloader(model, "cpu")
    with pytest.raises(UserError, match="--use_gradient_checkpointing"):
        model(*batches(1)[0][:2])
    with torch.no_grad():  # inference (validation renders) needs none
        model(*batches(1)[0][:2])


def test_the_blocks_are_the_large_module_lists():
    ((name, blocks),) = find_blocks(lora_model())  # not `heads` (small), not a block's own lists
    assert name == "blocks" and len(blocks) == 4

    class TwoStreams(nn.Module):  # FLUX-like: double-stream blocks, then single-stream ones
        def __init__(self):
            super().__init__()
            self.double = nn.ModuleList(Block(16) for _ in range(2))
            self.single = nn.ModuleList(Block(8) for _ in range(5))
            self.out = nn.Linear(8, 8)

    model = TwoStreams().requires_grad_(False)
    assert [n for n, _ in find_blocks(model)] == ["double", "single"]
    offloader = ModelOffloader(model, "cpu", blocks_to_swap=6)
    assert [u.name for u in offloader.units] == ["double.1", *(f"single.{i}" for i in range(5))]
    assert offloader.num_blocks == 7 and "6 of 7 blocks (double, single)" in offloader.describe()
    with pytest.raises(UserError, match="no list of repeated blocks"):
        ModelOffloader(nn.Sequential(nn.Linear(2, 2)), "cpu")


def test_removing_the_offloader_restores_the_weights():
    model = lora_model()
    before = copy.deepcopy(model.state_dict())
    offloader = ModelOffloader(model, "cpu")
    offloader.remove()
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())


@pytest.mark.parametrize("engine", ["FSDP2", "DeepSpeed"])
def test_sharded_engines_are_refused(monkeypatch, engine):
    from difftune.training import engines
    from difftune.training.offload import refuse_sharded_engines

    monkeypatch.setattr(engines, "engine_of", lambda accelerator: engine)
    with pytest.raises(UserError, match=f"--enable_model_cpu_offload: not supported under {engine}"):
        refuse_sharded_engines(object(), "--enable_model_cpu_offload")
    monkeypatch.setattr(engines, "engine_of", lambda accelerator: "DDP")
    refuse_sharded_engines(object(), "--enable_model_cpu_offload")  # DDP keeps its gradient sync: allowed


def test_quantised_weights_stream_too_and_training_matches():
    """torchao int8 weights (tensor subclasses) are kept on the host as they are and onloaded like the rest: the
    offloaded run trains what the resident int8 run trains."""
    pytest.importorskip("torchao")
    from difftune.models.quant import QuantOption, quantize_linears

    def int8_lora_model():
        from peft import LoraConfig, inject_adapter_in_model

        torch.manual_seed(0)
        model = ToyDiT(32, 4)
        model.requires_grad_(False)
        quantize_linears(model.blocks, QuantOption("torchao_int8_w8a16"), torch.float32)
        inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "ff.0", "ff.2"]), model)
        return model

    plain, off = int8_lora_model(), int8_lora_model()
    offloader = ModelOffloader(off, "cpu")
    weights = [u.subs for u in offloader.units]
    assert all(len(s) == 3 for s in weights)  # to_q, ff.0, ff.2 of each block
    assert all(m._parameters[n].numel() == 0 for s in weights for m, n, _ in s)  # placeholders between uses
    data = batches(3, d=32)
    a, b = train(plain, data), train(off, data)
    for (la, ga), (lb, gb) in zip(a, b):
        assert torch.equal(la, lb) and all(torch.equal(ga[k], gb[k]) for k in ga)
    assert offloader.host_bytes > offloader.arena_bytes > 0
    state = off.state_dict()  # the host's quantised weights, never placeholders
    assert type(state["blocks.0.to_q.base_layer.weight"]).__name__ == "Int8Tensor"


# -- a UNet: its blocks sit in lists of mixed classes, and its checkpointing wraps the modules inside them ----------
# diffusers checkpoints each ResnetBlock2D and each BasicTransformerBlock (inside a Transformer2DModel), not a down /
# up block; its mid block runs its first resnet outside any checkpoint; its down- / upsamplers and a
# Transformer2DModel's norm and projections run outside the checkpoints too.

UNET_TOLERANCE = 2e-6  # test_offload_training.py's: offload computes with fresh copies of the same weights
UNET_ORDER = ["down_blocks.0.resnets.0", "down_blocks.0.attentions.0.transformer_blocks.0", "down_blocks.1.resnets.0",
              "mid_block.resnets.0", "mid_block.attentions.0.transformer_blocks.0", "mid_block.resnets.1",
              "up_blocks.0.resnets.0", "up_blocks.0.resnets.1", "up_blocks.1.resnets.0",
              "up_blocks.1.attentions.0.transformer_blocks.0", "up_blocks.1.resnets.1",
              "up_blocks.1.attentions.1.transformer_blocks.0"]


def unet_model(seed=0):
    from diffusers import UNet2DConditionModel
    from peft import LoraConfig, inject_adapter_in_model

    from difftune.core.checkpointing import set_gradient_checkpointing

    torch.manual_seed(seed)
    unet = UNet2DConditionModel(sample_size=8, block_out_channels=(8, 16), layers_per_block=1, cross_attention_dim=8,
                                norm_num_groups=4, attention_head_dim=2,
                                down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))
    unet.requires_grad_(False)
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]), unet)
    set_gradient_checkpointing(unet, True)  # as a family's model_fn does
    return unet


def unet_batches(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(2, 4, 8, 8, generator=g), torch.randint(0, 1000, (2,), generator=g),
             torch.randn(2, 3, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)) for _ in range(steps)]


def train_unet(model, data, lr=1e-2):
    opt = torch.optim.AdamW(lora(model).values(), lr=lr)
    losses = []
    for x, t, text, target in data:
        loss = torch.nn.functional.mse_loss(model(x, t, text).sample, target)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in lora(model).items()}


def lora_difference(a, b) -> float:
    assert a.keys() == b.keys() and any("lora_B" in n for n in a)
    assert all(a[n].abs().max() > 0 for n in a if "lora_B" in n)  # every lora_B trained (it starts at zero)
    return max((a[n] - b[n]).abs().max().item() for n in a)


def run_order(model):
    """The blocks in the order a forward pass runs them."""
    order = []
    handles = [m.register_forward_pre_hook(lambda m, a, n=n: order.append(n)) for n, m in find_nested_blocks(model)]
    with torch.no_grad():
        model(*unet_batches(1)[0][:3])
    for h in handles:
        h.remove()
    return order


def test_the_unet_blocks_are_what_its_checkpointing_wraps():
    assert [n for n, _ in find_nested_blocks(lora_model())] == []  # one-class lists: a DiT keeps find_blocks'
    model = unet_model()
    assert run_order(model) == UNET_ORDER
    assert sorted(n for n, _ in find_nested_blocks(model)) == sorted(UNET_ORDER)


@pytest.mark.parametrize("threshold,early_stop", [(None, True), (None, False), (0.0005, True)])
def test_an_offloaded_unet_trains_the_same_lora(threshold, early_stop):
    data = unet_batches(3)
    plain, off = unet_model(), unet_model()
    lines = []
    offloader = ModelOffloader(off, "cpu", split_threshold_mb=threshold, label="unet", log=lines.append)
    assert offloader.num_blocks == 12 and offloader.swapped == 12
    assert all(p.numel() == 0 for u in offloader.units for p in u.params)  # placeholders before any use
    losses_a, a = train_unet(plain, data)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        losses_b, b = train_unet(off, data)
    assert lora_difference(a, b) <= UNET_TOLERANCE
    assert max(abs(x - y) for x, y in zip(losses_a, losses_b)) <= UNET_TOLERANCE
    # streamed in the order they ran, the mid block's first resnet (run outside any checkpoint) kept on the device
    blocks = [u.name for u in offloader.units] if threshold is None else \
        list(dict.fromkeys(offloader._block_names[u.block] for u in offloader.units))
    assert blocks == [n for n in UNET_ORDER if n != "mid_block.resnets.0"]
    unchecked = {next(b for b in UNET_ORDER if n == b or n.startswith(b + ".")) for n in offloader.unchecked}  # parts
    assert unchecked == {"mid_block.resnets.0"}
    assert all(p.numel() == 0 for u in offloader.units for p in u.params)  # all dropped at the end of backward
    assert offloader.onloaded_bytes == 0
    assert 0 < offloader.peak_onloaded < sum(u.nbytes for u in offloader.units) / 2  # never the whole UNet at once
    assert lines == [offloader.describe()]  # told once, when the first backward pass settled the order
    assert ("model offload: unet: 12 of 12 blocks (ResnetBlock2D, BasicTransformerBlock in down_blocks, mid_block, "
            "up_blocks), ") in lines[0] and "kept on cpu (run outside the model's gradient checkpointing: " \
        "mid_block.resnets.0" in lines[0]


def test_the_unet_tolerance_sees_a_one_percent_learning_rate_change():
    data = unet_batches(3)
    _, a = train_unet(unet_model(), data)
    _, b = train_unet(unet_model(), data, lr=1.01e-2)
    assert lora_difference(a, b) > 20 * UNET_TOLERANCE


def test_every_frozen_weight_a_unet_checkpoint_computes_with_is_streamed():
    """What the UNet computes with inside its checkpoints is exactly what streams; what it computes with outside
    them (down- / upsamplers, a Transformer2DModel's norm and projections, the mid block's first resnet, conv_in,
    the time embedding, ...) stays on the device."""
    from difftune.training import offload

    plain = unet_model()
    inside, outside = set(), set()
    modules = {id(m): n for n, m in plain.named_modules()}

    def record(m, args):
        names = {f"{modules[id(m)]}.{k}" for k, p in m.named_parameters(recurse=False) if not p.requires_grad}
        (inside if offload._checkpointed() else outside).update(names)

    for m in plain.modules():
        m.register_forward_pre_hook(record)
    x, t, text, target = unet_batches(1)[0]
    plain(x, t, text)  # with gradients: the checkpoints run
    frozen = {n for n, p in plain.named_parameters() if not p.requires_grad}
    assert inside | outside == frozen and not inside & outside
    assert any(".downsamplers." in n for n in outside) and any(".proj_in." in n for n in outside)

    off = unet_model()
    offloader = ModelOffloader(off, "cpu")
    train_unet(off, [(x, t, text, target)])
    names = {id(p): n for n, p in off.named_parameters()}
    assert {names[id(p)] for u in offloader.units for p in u.params} == inside
    assert {names[id(p)] for u in offloader.kept for p in u.params} == \
        {n for n in outside if n.startswith("mid_block.resnets.0.")}
    assert all(p.numel() > 0 for n, p in off.named_parameters() if n in outside)


def test_blocks_to_swap_on_a_unet_takes_the_last_blocks_to_run():
    data = unet_batches(3)
    plain, off = unet_model(), unet_model()
    lines = []
    offloader = ModelOffloader(off, "cpu", blocks_to_swap=9, label="unet", log=lines.append)
    assert "9 of 12 blocks" in offloader.describe() and "the last to run" in offloader.describe()
    _, a = train_unet(plain, data)
    _, b = train_unet(off, data)
    assert lora_difference(a, b) <= UNET_TOLERANCE
    # the last 9 to run stream (the mid block's first resnet among them, kept: the model does not checkpoint it)
    assert [u.name for u in offloader.units] == [n for n in UNET_ORDER[3:] if n != "mid_block.resnets.0"]
    assert offloader.unchecked == ["mid_block.resnets.0"]
    resident = {n for n in UNET_ORDER[:3]}
    for name, m in off.named_modules():
        if name in UNET_ORDER:
            frozen = [p for p in m.parameters() if not p.requires_grad]
            assert all((p.numel() > 0) == (name in resident or name == "mid_block.resnets.0") for p in frozen), name
    assert lines == [offloader.describe()] and "9 of 12 blocks" in lines[0] and "in 8 unit(s)" in lines[0]
    assert "the last to run" not in lines[0]
    with pytest.raises(UserError, match=r"--blocks_to_swap 13: UNet2DConditionModel has 12 blocks"):
        ModelOffloader(unet_model(), "cpu", blocks_to_swap=13)


def test_a_missed_onload_in_a_unet_recompute_raises(monkeypatch):
    """The recompute calls the resnets and transformer blocks themselves: their pre-hooks onload them."""
    from difftune.training import offload

    model = unet_model()
    offloader = ModelOffloader(model, "cpu")
    ready = offloader._ready
    monkeypatch.setattr(offloader, "_ready", lambda unit: None if offload._in_backward() else ready(unit))
    x, t, text, target = unet_batches(1)[0]
    loss = torch.nn.functional.mse_loss(model(x, t, text).sample, target)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_a_unet_without_gradient_checkpointing_is_refused():
    from difftune.core.checkpointing import set_gradient_checkpointing

    model = unet_model()
    set_gradient_checkpointing(model, False)
    ModelOffloader(model, "cpu")
    with pytest.raises(UserError, match="--use_gradient_checkpointing"):
        model(*unet_batches(1)[0][:3])
    with torch.no_grad():  # inference needs none
        model(*unet_batches(1)[0][:3])
