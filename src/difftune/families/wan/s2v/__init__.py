"""Wan2.2-S2V-14B (speech-to-video): its DiT (`model`), the recognition of its files (`keys`), its wav2vec2 audio
features and units (`units`) and its pipeline class (`pipeline`).

diffusers has no S2V transformer, so `WanModel_S2V` is written here from the published architecture (Wan-AI's
`wan/modules/s2v/model_s2v.py`, as the reference runs it: `diffsynth/models/wan_video_dit_s2v.py`), with the
released file's own key names (`blocks.N.self_attn.q`, `casual_audio_encoder.*`, `audio_injector.*`,
`frame_packer.*`, ...), so `Wan-AI/Wan2.2-S2V-14B/diffusion_pytorch_model*.safetensors` loads as it is. The class
carries the released config.json's class name, so that file configures it; bare files are recognised from their
shapes (`infer_s2v_config`).

Training, as the reference's `lora|full/Wan2.2-S2V-14B.sh`:
  * `input_image` (the clip's first frame): its VAE latents stand as the clean first latent frame (the
    reference image; left out of the loss, as TI2V-5B's first frame);
  * `input_audio` (an audio file, or a clip's audio track): wav2vec2's hidden states of every layer, at 30 per
    second, one per video frame at 16 fps (`s2v_audio_embeds`), (1, layers, 1024, num_frames - 1);
  * `s2v_pose_video` (a clip): its VAE latents, added to the patch embedding through `cond_encoder`;
  * motion frames: the reference encodes 73 black frames and then drops them (`drop_motion_frames`), so they
    change nothing in training; here they are not computed (`motion_latents` stays None).
"""

from .keys import AUDIO_ENCODER, S2V_DIT
from .pipeline import WanS2VPipeline
from .units import AUDIO_PROCESSOR

__all__ = ["AUDIO_ENCODER", "AUDIO_PROCESSOR", "S2V_DIT", "WanS2VPipeline"]
