"""Black Forest Labs' original single-file layouts (flux1-dev.safetensors, ae.safetensors) -> diffusers'.

The AE goes through diffusers' own `convert_ldm_vae_checkpoint`. diffusers' FLUX transformer converter fixes
the width at 3072 (FLUX.1's), so the transformer is mapped here, with the widths read from the tensors. Both
work on meta tensors, which is how the layouts are recognised from headers alone.
"""

from __future__ import annotations

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


def convert_bfl_vae(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """BFL's ae.safetensors (the LDM VAE layout) in diffusers' AutoencoderKL names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    from .components import FLUX1_VAE_CONFIG

    # the converter reads only the number of down/up blocks from the config (4 in every FLUX.1 AE)
    return convert_ldm_vae_checkpoint(dict(state), FLUX1_VAE_CONFIG)
