"""LongCat-Video (meituan-longcat/LongCat-Video): its own text-to-video DiT (`model`) over Wan2.1's VAE latents and
UMT5 prompt embeddings, as the reference's `lora|full/LongCat-Video.sh` train it; `keys` recognises its files,
`units` and `pipeline` run it.

diffusers has no LongCat-Video transformer; `LongCatVideoTransformer3DModel` is written here from the published
architecture (the reference's `diffsynth/models/longcat_video_dit.py`), in the released `dit/` files' key names
(`x_embedder.proj`, `blocks.N.attn.qkv`, `blocks.N.cross_attn.kv_linear`, `blocks.N.ffn.w1`, `final_layer.*`),
so the reference's LoRA targets (`attn.qkv,attn.proj,cross_attn.q_linear,...,ffn.w3`) name its modules as they
are. It carries the released config.json's class name and parameter names.

What differs from Wan's DiT: per-frame timesteps (a video-continuation prefix of `longcat_latents` frames at
timestep 0), SwiGLU feed-forward, fused qkv with per-head RMSNorm, LLaMA-style (interleaved-pair) 3-D RoPE,
fp32 modulation, text tokens past the prompt zeroed after their projection, and a velocity of the opposite sign
(`model_fn` negates it, as the reference's does).
"""

from .keys import LONGCAT_DIT
from .pipeline import WanLongCatPipeline

__all__ = ["LONGCAT_DIT", "WanLongCatPipeline"]
