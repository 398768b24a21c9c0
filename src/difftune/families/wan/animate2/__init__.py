"""Wan2.2-Animate-2-14B (and -Distilled): its own transformer, diffusers' `WanAnimate2Transformer3DModel`, called
by `model`; `keys` (its released layout), `units`, `pipeline`.

The denoiser reads the generated clip (the reference image's latents as a leading frame, then the clip's) with its
condition (the reference image: mask 1 + latents; then zeros, mask 0) and, in context, a reference video: a first
pass over the reference video's latents (mask 1 + latents), its own prompt (`animate2_prompt_ref`) and the CLIP
embedding of its first frame, at a fixed timestep, keeps every block's self-attention keys and values; the second
pass over the clip lets each clip frame attend to all clip tokens and to the reference video frame before it. The
second pass of the unguided prediction skips block 9.

diffusers runs the second pass's attention through a flex-attention block mask, which has no backward pass on the
CPU and is compiled on first use; `DenseInContextAttnProcessor` computes the same attention with a dense boolean
mask and SDPA, so the model trains anywhere (the test compares the two).

The released file (`wan_animate_2/wan_animate_2_bf16[_distillation].safetensors`) names the blocks
`blocks.N.block.self_attn.q`: diffusers' converter maps it (`blocks.N.self_attn.to_q`); `animate2_module_name`
maps the reference's module names (its `--trainable_models dit.blocks.0.block.self_attn.q,...` and LoRA targets).
"""

from .keys import ANIMATE2_ORIGINAL, animate2_to_original
from .pipeline import WanAnimate2Pipeline

__all__ = ["ANIMATE2_ORIGINAL", "WanAnimate2Pipeline", "animate2_to_original"]
