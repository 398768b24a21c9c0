"""Video-As-Prompt (ByteDance/Video-As-Prompt-Wan2.1-14B): a mixture-of-transformers branch (`vap`) beside Wan2.1
I2V-14B that reads a reference clip (`vap_video`) and joins the DiT's self-attention in every fourth block.

The released `transformer/diffusion_pytorch_model*.safetensors` hold both models in diffusers' names: the Wan I2V
DiT (`blocks.N.attn1.to_q`, ...) and the branch under `_mot_ref` names (`patch_embedding_mot_ref`,
`condition_embedder_mot_ref.*`, `blocks.N.attn1_mot_ref.*`, ... in the blocks that have one), with a config.json of
class `WanTransformer3DMOTModel`. Here they are two slots, as the reference has them:

  * `dit`: diffusers' `WanTransformer3DModel` (`WanTransformer3DMOTModel` below is that class under the released
    config's name, so the config.json configures it; the `_mot_ref` tensors are left out);
  * `vap`: `WanVAPModel`, the branch in the reference's `MotWanModel` names (`blocks.M.self_attn.q`, `img_emb.proj.1`,
    `time_projection.1`, ... with M the branch's own block index), so a fully trained `vap` saved here loads with
    the reference's `pipe.vap.load_state_dict`. `vap_from_released` converts the released names.

One file fills both slots: `VAP` is a companion component (recognised in the files recognised as the DiT; its
heads are Wan's 128 channels wide, as the released 5120 / 40, and its blocks sit beside DiT blocks 0, 4, 8, ...).

Training (`lora|full/Video-As-Prompt-Wan2.1-14B.sh`, `--extra_inputs vap_video,input_image`): the DiT is conditioned
as Wan2.1 I2V-14B on the clip's first frame; `vap_video` (a clip as long as the training clip) gives the branch's
input (its VAE latents + the I2V condition of its first frame: 36 channels), its first frame's CLIP embedding and
`vap_prompt`'s UMT5 embedding ("" when the data has none, as the reference trains). The branch sees timestep 1 and
frames at RoPE positions -f..-1 (before the clip's).

The package: `model` (the DiT class and the branch, their joint call), `keys` (the released layout, recognition),
`units`, `pipeline`.
"""

from .keys import VAP, VAP_DIT
from .pipeline import WanVAPPipeline

__all__ = ["VAP", "VAP_DIT", "WanVAPPipeline"]
