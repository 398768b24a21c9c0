"""Black Forest Labs' original single-file layouts (flux1-dev.safetensors, ae.safetensors) -> diffusers'.

The AE goes through diffusers' own `convert_ldm_vae_checkpoint` (`parts/flux_ae.py`). diffusers' FLUX transformer converter fixes
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


# -- writing LoRAs in BFL's names (--lora_format kohya / comfyui) ---------------------------------------------

_COMFY_BFL = re.compile(r"^(?:diffusion_model\.)?(?P<path>(?:double_blocks|single_blocks)\.\d+\..+|"
                        + "|".join(re.escape(k) for k in _GLOBAL) + r")\.(?P<kind>lora_A\.weight|lora_B\.weight|alpha)$")


def comfyui_bfl_to_kohya(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """ComfyUI's generic LoRA layout on BFL's module names (`diffusion_model.double_blocks.0.img_attn.qkv.
    lora_A.weight` + `.alpha`, what `--lora_format comfyui` writes for FLUX) renamed to kohya's; None when the
    file has no BFL block names."""
    if not any(k.startswith(("diffusion_model.double_blocks.", "diffusion_model.single_blocks.")) for k in state):
        return None
    out = {}
    for key, t in state.items():
        m = _COMFY_BFL.match(key)
        if m is None:
            return None  # not wholly this layout: left to the other readers (which refuse what they cannot place)
        kind = {"lora_A.weight": "lora_down.weight", "lora_B.weight": "lora_up.weight"}.get(m["kind"], "alpha")
        out[f"lora_unet_{m['path'].replace('.', '_')}.{kind}"] = t
    return out


def convert_bfl_named_flux_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """kohya (`lora_unet_double_blocks_...`) or ComfyUI (`diffusion_model.double_blocks....`) LoRAs in BFL's
    names -> diffusers' layout (see `convert_kohya_flux_lora`); None for other files."""
    kohya = comfyui_bfl_to_kohya(state)
    return convert_kohya_flux_lora(kohya if kohya is not None else state)


def _bfl_place(path: str) -> tuple[str, int, int] | None:
    """A diffusers module path -> (BFL module, its part in a fused layer, the number of parts), or None."""
    head, _, rest = path.partition(".")
    if head in ("transformer_blocks", "single_transformer_blocks"):
        index, _, name = rest.partition(".")
        blocks = "double_blocks" if head == "transformer_blocks" else "single_blocks"
        fused = _DOUBLE_FUSED if head == "transformer_blocks" else {"linear1": _SINGLE_FUSED}
        for bfl, parts in fused.items():
            if name in parts:
                return f"{blocks}.{index}.{bfl}", parts.index(name), len(parts)
        old = _rename(name, {v: k for k, v in (_DOUBLE if head == "transformer_blocks" else _SINGLE).items()})
        return (f"{blocks}.{index}.{old}", 0, 1) if old is not None else None
    old = _rename(path, {v: k for k, v in _GLOBAL.items()})
    return (old, 0, 1) if old is not None else None


def bfl_lora_from_diffusers(sd: dict[str, torch.Tensor], alphas: dict[str, float]
                            ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A transformer LoRA on diffusers' modules (`<path>.lora_A/B.weight`, alpha per path) on BFL's modules
    instead, at the same strength, for files ComfyUI and kohya tools read in BFL's names.

    The parts of a fused layer (q, k, v; the single blocks' q, k, v + MLP) become one adapter: where every part
    holds the same down and alpha/rank (one adapter shared by the parts, as the reference's fused targets train),
    that down and the parts' ups stacked (rank r, the reference's shape); otherwise the downs stacked (rank = the sum
    of the parts' ranks), the up block-diagonal (zero rows for a part not trained), which is the form kohya's own
    split-qkv LoRAs have. Its alpha keeps each part's alpha/rank where the parts
    agree; where they differ the scales are folded into the up blocks and alpha = rank. The final modulation's
    up rows are swapped into BFL's (shift, scale) order."""
    groups: dict[str, dict[int, str]] = {}
    sizes: dict[str, int] = {}
    for key in sd:
        if not key.endswith(".lora_A.weight"):
            continue
        path = key[: -len(".lora_A.weight")]
        place = _bfl_place(path)
        if place is None:
            raise ValueError(f"{path}: no FLUX.1 module in BFL's layout holds this layer")
        bfl, part, n = place
        groups.setdefault(bfl, {})[part] = path
        sizes[bfl] = n
    out, out_alphas = {}, {}
    for bfl, parts in groups.items():
        n = sizes[bfl]
        if n == 1:
            path = parts[0]
            up = sd[f"{path}.lora_B.weight"]
            out[f"{bfl}.lora_A.weight"] = sd[f"{path}.lora_A.weight"]
            out[f"{bfl}.lora_B.weight"] = _swap_halves(up) if bfl == "final_layer.adaLN_modulation.1" else up
            out_alphas[bfl] = alphas[path]
            continue
        present = [parts[i] for i in sorted(parts)]
        width = sd[f"{present[0]}.lora_A.weight"].shape[1]  # q, k, v: the model's width; the MLP part 4x it
        widths = [width] * 3 + ([4 * width] if n == 4 else [])
        ranks = {i: sd[f"{p}.lora_A.weight"].shape[0] for i, p in parts.items()}
        scales = {i: alphas[p] / ranks[i] for i, p in parts.items()}
        down = sd[f"{present[0]}.lora_A.weight"]
        if len(parts) == n and len(set(scales.values())) == 1 and \
                all(torch.equal(sd[f"{p}.lora_A.weight"], down) for p in present):
            # one adapter shared by the parts (the reference's fused targets): the fused layer's own LoRA, rank r
            out[f"{bfl}.lora_A.weight"] = down
            out[f"{bfl}.lora_B.weight"] = torch.cat([sd[f"{p}.lora_B.weight"] for p in present])
            out_alphas[bfl] = alphas[present[0]]
            continue
        total = sum(ranks.values())
        same = len(set(scales.values())) == 1
        ref = sd[f"{present[0]}.lora_B.weight"]
        up = torch.zeros(sum(widths), total, dtype=ref.dtype)
        downs, col = [], 0
        for i in sorted(parts):
            p = parts[i]
            b = sd[f"{p}.lora_B.weight"]
            row = sum(widths[:i])
            up[row:row + widths[i], col:col + ranks[i]] = b if same else b * scales[i]
            downs.append(sd[f"{p}.lora_A.weight"])
            col += ranks[i]
        out[f"{bfl}.lora_A.weight"] = torch.cat(downs, dim=0)
        out[f"{bfl}.lora_B.weight"] = up
        out_alphas[bfl] = next(iter(scales.values())) * total if same else float(total)
    return out, out_alphas


# -- what each reader takes of a FLUX LoRA file (notes when one is written) -------------------------------------

_BLOCKS = ("transformer_blocks.", "single_transformer_blocks.")


def flux_lora_export_notes(layout: str, paths: list[str]) -> list[str]:
    """Notes for a FLUX transformer LoRA on the diffusers modules `paths` written in `layout`: the modules a reader
    skips without a word. DiffSynth-Studio's FluxLoRALoader renames block modules only (diffusers' names in the
    diffusers layout, BFL's in the kohya one; a ComfyUI-layout file it does not read at all); diffusers' kohya reader
    leaves every module outside the blocks (the final layer, the embedders) out of the transformer."""
    outside = sorted(p for p in paths if not p.startswith(_BLOCKS))
    notes = []
    if layout == "comfyui":
        notes.append("FLUX LoRA in the comfyui layout (BFL names): ComfyUI and diffusers read it; DiffSynth-Studio's "
                     "loader does not (it reads the diffusers and kohya layouts)")
    if outside and layout in ("diffusers", "kohya"):
        notes.append(f"FLUX LoRA on modules outside the blocks ({', '.join(outside)}): DiffSynth-Studio's loader "
                     f"skips them (its FLUX model has no LoRA name for them there)")
    if outside and layout == "kohya":
        notes.append(f"FLUX LoRA in the kohya layout: diffusers' FluxPipeline.load_lora_weights drops its modules "
                     f"outside the blocks ({', '.join(outside)}) without a warning; the diffusers layout keeps them")
    return notes
