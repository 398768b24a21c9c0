"""LoRA on convolutions (a UNet's conv_in, its resnets' convs): peft's LoRA layers train them, and the file (a LoCon:
A a convolution of the layer's kernel to rank r, B a 1x1 convolution back) round-trips through every layout, as an
adapter and fused, to the adapted model's output."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from difftune.errors import UserError
from difftune.lora import (fuse_lora, inject_lora, load_lora_file, load_lora_into, lora_state_dict, save_lora,
                           to_comfyui, to_kohya, write_safetensors)

RANK, ALPHA = 2, 4.0


class TinyUNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.blocks = nn.ModuleList(nn.ModuleDict({"conv1": nn.Conv2d(8, 8, 3, padding=1),
                                                   "proj": nn.Linear(8, 8)}) for _ in range(2))
        self.temb = nn.Conv1d(8, 8, 1)
        self.conv_out = nn.Conv2d(8, 3, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.blocks:
            h = h + block["conv1"](h).tanh()
            h = h + block["proj"](h.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        h = h + self.temb(h.mean(-1)).unsqueeze(-1)
        return self.conv_out(h)


def base():
    torch.manual_seed(0)
    return TinyUNetish()


@pytest.fixture(scope="module")
def adapted():
    model = base()
    config = inject_lora(model, ["conv_in", "conv1", "proj", "temb"], RANK, ALPHA)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(1, 3, 8, 8, generator=g)
    return {"model": model, "config": config, "sd": lora_state_dict(model), "x": x, "out": model(x).detach()}


def test_a_convolutions_lora_trains(adapted):
    sd = adapted["sd"]
    assert sd["conv_in.lora_A.weight"].shape == (RANK, 3, 3, 3) and sd["conv_in.lora_B.weight"].shape == (8, RANK, 1, 1)
    model = adapted["model"]
    model(adapted["x"]).square().mean().backward()
    trained = {n for n, p in model.named_parameters() if p.grad is not None and p.grad.abs().max() > 0}
    assert {"conv_in.lora_A.default.weight", "blocks.0.conv1.lora_B.default.weight",
            "temb.lora_A.default.weight"} <= trained
    assert not any(".lora_" not in n for n in trained)  # only the LoRA trains
    model.zero_grad()


@pytest.mark.parametrize("layout", ["difftune", "comfyui", "kohya"])
def test_a_locon_round_trips_every_layout_as_adapter_and_fused(adapted, tmp_path, layout):
    sd = adapted["sd"]
    path = tmp_path / f"{layout}.safetensors"
    if layout == "difftune":
        save_lora(path, {"dit": sd}, {"dit": adapted["config"]})
    else:
        write_safetensors(path, (to_comfyui if layout == "comfyui" else to_kohya)(sd, ALPHA))
    imported = load_lora_file(path)
    fused = base()
    fuse_lora(fused, imported, component="transformer")
    assert torch.allclose(fused(adapted["x"]), adapted["out"], atol=1e-5)
    again = base()
    load_lora_into(again, imported, component="transformer")
    assert torch.allclose(again(adapted["x"]), adapted["out"], atol=1e-5)


def test_a_locon_for_another_kernel_is_refused(adapted, tmp_path):
    sd = dict(adapted["sd"])
    sd["conv_in.lora_A.weight"] = torch.zeros(RANK, 3, 1, 1)  # a 1x1 kernel's LoRA on a 3x3 convolution
    path = write_safetensors(tmp_path / "bad.safetensors", to_comfyui(sd, ALPHA))
    with pytest.raises(UserError, match=r"bad\.safetensors: LoRA key .*conv_in.* is Conv2d\(3 -> 8\); is this a LoRA "
                                        r"for another model\?"):
        fuse_lora(base(), load_lora_file(path), component="transformer")


def test_a_linear_lora_on_a_convolution_is_refused_when_read(adapted, tmp_path):
    sd = dict(adapted["sd"])
    sd["conv_in.lora_A.weight"] = torch.zeros(RANK, 3)
    path = write_safetensors(tmp_path / "flat.safetensors", to_comfyui(sd, ALPHA))
    with pytest.raises(UserError, match=r"is not a Linear or convolution LoRA \(lora_A \(2, 3\), lora_B \(8, 2, 1, 1\)"):
        load_lora_file(path)


def test_a_target_that_is_no_linear_or_convolution_is_refused():
    class WithNorm(TinyUNetish):
        def __init__(self):
            super().__init__()
            self.norm = nn.GroupNorm(2, 8)

    with pytest.raises(UserError, match="'norm' is a GroupNorm, not a Linear or convolution layer"):
        inject_lora(WithNorm(), ["norm"], RANK)
