"""Black Forest Labs' original single-file layouts (flux1-dev.safetensors, ae.safetensors) -> diffusers'.

The AE goes through diffusers' own `convert_ldm_vae_checkpoint`. diffusers' FLUX transformer converter fixes
the width at 3072 (FLUX.1's), so the transformer is mapped here, with the widths read from the tensors. Both
work on meta tensors, which is how the layouts are recognised from headers alone.
"""

from __future__ import annotations

import re

import torch

# BFL name (after the block prefix) -> diffusers name, for tensors that map one to one.
_GLOBAL = {
    "img_in": "x_embedder", "txt_in": "context_embedder",
    "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
    "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
    "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
    "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
    "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
    "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
    "final_layer.linear": "proj_out",
    "final_layer.adaLN_modulation.1": "norm_out.linear",  # shift/scale swapped below
}
_DOUBLE = {
    "img_mod.lin": "norm1.linear", "txt_mod.lin": "norm1_context.linear",
    "img_attn.proj": "attn.to_out.0", "txt_attn.proj": "attn.to_add_out",
    "img_attn.norm.query_norm.scale": "attn.norm_q.weight", "img_attn.norm.key_norm.scale": "attn.norm_k.weight",
    "txt_attn.norm.query_norm.scale": "attn.norm_added_q.weight",
    "txt_attn.norm.key_norm.scale": "attn.norm_added_k.weight",
    "img_mlp.0": "ff.net.0.proj", "img_mlp.2": "ff.net.2",
    "txt_mlp.0": "ff_context.net.0.proj", "txt_mlp.2": "ff_context.net.2",
}
_DOUBLE_FUSED = {"img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
                 "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj")}
_SINGLE = {
    "modulation.lin": "norm.linear", "linear2": "proj_out",
    "norm.query_norm.scale": "attn.norm_q.weight", "norm.key_norm.scale": "attn.norm_k.weight",
}
_SINGLE_FUSED = ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")  # linear1: q, k, v (width each), mlp


def _swap_halves(t: torch.Tensor) -> torch.Tensor:
    # BFL's final modulation is (shift, scale); diffusers' AdaLayerNormContinuous reads (scale, shift)
    a, b = t.chunk(2, dim=0)
    return torch.cat([b, a], dim=0)


def _rename(name: str, table: dict[str, str]) -> str | None:
    for old, new in table.items():
        if name == old:
            return new
        if name.startswith(old + "."):
            return new + name[len(old):]
    return None


def convert_bfl_transformer(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A BFL FLUX.1 transformer state dict (prefix already removed) in diffusers' FluxTransformer2DModel names."""
    width = state["img_in.weight"].shape[0]
    out = {}
    for key, t in state.items():
        head, _, rest = key.partition(".")
        if head in ("double_blocks", "single_blocks"):
            index, _, name = rest.partition(".")
            prefix = f"{'transformer_blocks' if head == 'double_blocks' else 'single_transformer_blocks'}.{index}."
            module, _, param = name.rpartition(".")
            fused = _DOUBLE_FUSED.get(module) if head == "double_blocks" else \
                (_SINGLE_FUSED if module == "linear1" else None)
            if fused is not None:
                sizes = [width] * 3 + ([t.shape[0] - 3 * width] if len(fused) == 4 else [])
                for target, part in zip(fused, torch.split(t, sizes, dim=0)):
                    out[f"{prefix}{target}.{param}"] = part
                continue
            new = _rename(name, _DOUBLE if head == "double_blocks" else _SINGLE)
        else:
            prefix, new = "", _rename(key, _GLOBAL)
        if new is None:
            raise KeyError(f"{key}: not a tensor of BFL's FLUX.1 transformer")
        out[prefix + new] = _swap_halves(t) if key.startswith("final_layer.adaLN_modulation.1.") else t
    return out


def bfl_transformer_from_diffusers(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `convert_bfl_transformer` (writes BFL-layout test files from diffusers weights)."""
    inverse = {}
    for key, t in state.items():
        for head, blocks, table, fused in (("transformer_blocks", "double_blocks", _DOUBLE, _DOUBLE_FUSED),
                                           ("single_transformer_blocks", "single_blocks", _SINGLE,
                                            {"linear1": _SINGLE_FUSED})):
            if key.startswith(head + "."):
                index, _, name = key[len(head) + 1:].partition(".")
                module, _, param = name.rpartition(".")
                for bfl, parts in fused.items():
                    if module in parts:
                        if module == parts[0]:
                            inverse[f"{blocks}.{index}.{bfl}.{param}"] = torch.cat(
                                [state[f"{head}.{index}.{p}.{param}"] for p in parts], dim=0)
                        break
                else:
                    old = _rename(name, {v: k for k, v in table.items()})
                    inverse[f"{blocks}.{index}.{old}"] = t
                break
        else:
            old = _rename(key, {v: k for k, v in _GLOBAL.items()})
            inverse[old] = _swap_halves(t) if old.startswith("final_layer.adaLN_modulation.1.") else t
    return inverse


def convert_bfl_vae(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """BFL's ae.safetensors (the LDM VAE layout) in diffusers' AutoencoderKL names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    # the converter reads only the number of down/up blocks from the config (4 in every FLUX.1 AE)
    return convert_ldm_vae_checkpoint(dict(state), config)


# -- kohya / BFL-named LoRAs ----------------------------------------------------------------------------------

_KOHYA = re.compile(r"^lora_unet_(?:(?P<blocks>double_blocks|single_blocks)_(?P<index>\d+)_)?(?P<name>[A-Za-z0-9_]+)"
                    r"\.(?P<kind>lora_down\.weight|lora_up\.weight|alpha)$")


def _flat(table):
    return {k.replace(".", "_"): v for k, v in table.items()}


def convert_kohya_flux_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A kohya LoRA in BFL's module names (`lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`, fused
    qkv; `lora_unet_single_blocks_0_linear1` = q, k, v + MLP) in diffusers' layout (`transformer.<module>.
    lora_A/B.weight` + `.alpha`), at the same strength: a fused up (n*out, r) becomes n adapters sharing the
    down and alpha. None when the file is not in BFL's names; a UserError for a key it cannot place (never a
    partial LoRA). diffusers' own converter fixes FLUX.1's widths (3072), so this one reads them off the tensors.
    """
    from ...errors import UserError

    if not any(k.startswith(("lora_unet_double_blocks_", "lora_unet_single_blocks_")) for k in state):
        return None
    glob, double, single = _flat({**_GLOBAL}), _flat(_DOUBLE), _flat(_SINGLE)
    out = {}
    for key, t in state.items():
        m = _KOHYA.match(key)
        if m is None:
            raise UserError(f"{key}: not a key of a kohya FLUX.1 transformer LoRA (text-encoder parts and other "
                            f"tensors are not supported in this layout)")
        name, kind = m["name"], m["kind"]
        suffix = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}.get(kind, "alpha")
        if m["blocks"] is None:
            targets, prefix = [glob.get(name)], ""
        else:
            prefix = f"{'transformer_blocks' if m['blocks'] == 'double_blocks' else 'single_transformer_blocks'}." \
                     f"{m['index']}."
            fused = {_k.replace(".", "_"): v for _k, v in _DOUBLE_FUSED.items()} if m["blocks"] == "double_blocks" \
                else {"linear1": _SINGLE_FUSED}
            targets = list(fused[name]) if name in fused else [(double if m["blocks"] == "double_blocks"
                                                                else single).get(name)]
        if targets[0] is None or targets[0].endswith(".weight"):  # unknown, or a norm scale (not a Linear)
            raise UserError(f"{key}: no FLUX.1 Linear layer has this kohya name")
        if suffix == "lora_B.weight" and len(targets) > 1:
            # q, k, v (and single blocks' MLP, 4x the width: out = 3w + 4w) stacked along the rows
            width = t.shape[0] // (3 if len(targets) == 3 else 7)
            parts = torch.split(t, [width] * 3 + ([4 * width] if len(targets) == 4 else []), dim=0)
        elif suffix == "lora_B.weight" and name == "final_layer_adaLN_modulation_1":
            parts = [_swap_halves(t)]  # the rows of (shift, scale) -> (scale, shift), as the weight
        else:
            parts = [t] * len(targets)
        for target, part in zip(targets, parts):
            out[f"transformer.{prefix}{target}.{suffix}"] = part.contiguous()
    return out
