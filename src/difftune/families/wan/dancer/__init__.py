"""Wan-Dancer-14B (Wan-AI/Wan-Dancer-14B: `global_model.safetensors`, `local_model.safetensors`): Wan2.1 I2V-14B
with music injected after some blocks, a reference-image embedding, and a second patch embedding / head for
keyframes at another frame rate.

`WanDancerTransformer` is diffusers' `WanTransformer3DModel` with the Dancer's modules added under the released
file's own names (`music_injector.injector.N.q`, `img_emb_refimage.proj.1`, `music_projection`,
`music_encoder.N.self_attn.in_proj_weight`, `patch_embedding_global`, `head_global.head`, `ref_conv`); the file's
Wan base is in Wan-AI's names and goes through diffusers' converter (`dancer_from_original`), so a full checkpoint
written back in original names (`dancer_to_original`) is the layout the reference loads.

Both files are one architecture; which path runs is a data value, `wantodance_fps`: at 30 fps (the local model's
data) the plain patch embedding, RoPE and head; at any other rate (the global model's 7.5 fps keyframes) the
`_global` ones and frame positions stretched by 30 / fps (`global_frame_rope`). Training inputs, as the scripts
give them (`--extra_inputs wantodance_music_path,wantodance_reference_image,wantodance_fps,wantodance_keyframes,
wantodance_keyframes_mask[,framewise_decoding]`):
  * `wantodance_music_path`: the music's 35 librosa features (onset strength, 20 MFCCs, 12 CENS chroma, onset and
    beat one-hots) at 30 features a second (`music_features`), encoded by the DiT's music encoder;
  * `wantodance_reference_image`: its CLIP embedding, the image tokens of every cross-attention;
  * `wantodance_keyframes` + `wantodance_keyframes_mask`: the I2V condition (keyframes VAE-encoded, a mask of the
    frames that are keyframes) and the first keyframe's CLIP embedding (which stands in the text tokens' place);
  * `framewise_decoding` (the global model): every frame VAE-encoded alone, one latent frame per video frame.
"""

from __future__ import annotations

from .keys import DANCER_DIT, DANCER_MODULE_PREFIXES, dancer_to_original
from .pipeline import WanDancerPipeline

__all__ = ["DANCER_DIT", "DANCER_MODULE_PREFIXES", "WanDancerPipeline", "dancer_to_original"]
