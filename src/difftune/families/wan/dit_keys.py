"""The Wan DiT in Wan-AI's original key names: what `--full_format original` writes for a fully trained DiT,
so the file loads where Wan's own checkpoints do (Wan's code, ComfyUI, DiffSynth-Studio) and back here.
"""

from __future__ import annotations

import torch

# diffusers name -> Wan's, applied in this order (the inverse of diffusers' renames; norm2/norm3 swap places).
_DIT = [
    ("condition_embedder.time_embedder.linear_1", "time_embedding.0"),
    ("condition_embedder.time_embedder.linear_2", "time_embedding.2"),
    ("condition_embedder.text_embedder.linear_1", "text_embedding.0"),
    ("condition_embedder.text_embedder.linear_2", "text_embedding.2"),
    ("condition_embedder.time_proj", "time_projection.1"),
    ("condition_embedder.image_embedder.norm1", "img_emb.proj.0"),
    ("condition_embedder.image_embedder.ff.net.0.proj", "img_emb.proj.1"),
    ("condition_embedder.image_embedder.ff.net.2", "img_emb.proj.3"),
    ("condition_embedder.image_embedder.norm2", "img_emb.proj.4"),
    ("attn1", "self_attn"), ("attn2", "cross_attn"),
    (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    (".add_k_proj.", ".k_img."), (".add_v_proj.", ".v_img."), (".norm_added_k.", ".norm_k_img."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"),
    (".norm2.", ".norm__swap."), (".norm3.", ".norm2."), (".norm__swap.", ".norm3."),
]


def dit_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A WanTransformer3DModel state dict in Wan-AI's original key names (`WanModel`'s), the inverse of
    diffusers' `convert_wan_transformer_to_diffusers`; the tensors are the same objects."""
    out = {}
    for key, value in state.items():
        new = key
        if new == "scale_shift_table":
            new = "head.modulation"
        elif new.startswith("proj_out."):
            new = "head.head." + new[len("proj_out."):]
        elif new == "condition_embedder.image_embedder.pos_embed":
            new = "img_emb.emb_pos"  # FLF2V's, which diffusers' converter does not rename
        elif new.endswith(".scale_shift_table"):
            new = new[: -len("scale_shift_table")] + "modulation"
        for a, b in _DIT:
            new = new.replace(a, b)
        out[new] = value
    return out


# the reference's boundaries between Wan2.2 A14B's experts (Wan2.2-*-A14B.sh), by the DiT's input channels
_BOUNDARY_BY_IN_CHANNELS = {16: 0.417, 36: 0.358}  # T2V-A14B; I2V-A14B (16 + 4 mask + 16 condition)


def expert_boundary(models: list) -> float | None:
    """--expert_boundary's default for the pair: T2V-A14B's 0.417 or I2V-A14B's 0.358, told apart by the DiT's
    `patch_embedding` input channels in its file header (nothing loaded); None when it cannot tell."""
    from ...models.detect import header_shapes, read_header

    for slot, config in models:
        if slot != "dit":
            continue
        files = config.resolve()
        for f in [files] if isinstance(files, str) else files:
            if not str(f).endswith(".safetensors"):
                return None
            for key, shape in header_shapes(read_header(str(f))).items():
                if key.endswith("patch_embedding.weight") and len(shape) == 5:
                    return _BOUNDARY_BY_IN_CHANNELS.get(shape[1])
    return None
