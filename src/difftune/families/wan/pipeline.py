"""`WanVideoPipeline`: Wan2.1 / Wan2.2 text- and image-to-video (inference and the training hooks).

Architectures come from diffusers (`WanTransformer3DModel`, `AutoencoderKLWan`) and transformers
(`UMT5EncoderModel`, `CLIPVisionModel`), so diffusers-layout checkpoints load with their own key names. Which
variant it is follows from the weights: the DiT's channels (I2V takes a condition, TI2V-5B has 48), whether it
embeds a CLIP image, the VAE's channels, and whether a second DiT (the A14B low-noise expert) is loaded.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from ...core.batch import SAME
from ...core.features import Feature
from ...core.pipeline import BasePipeline
from ...errors import UserError
from ...media.video import tensor_to_clips
from .animate import WanAnimateFaceMotion, WanAnimateInpaint, WanAnimatePoseLatents, WanAnimateVideoSplit
from .camera import WanCameraControl, WanCameraImageLatents
from .components import DEFAULT_BOUNDARY_RATIO
from .fun_control import WanFunControlEmbedder, WanFunReferenceEmbedder
from .model_fn import model_fn_wan
from .scheduler import WanScheduler
from .speed_control import WanMotionResidual, WanSpeedControl
from .units import (WanImageEmbedderCLIP, WanImageEmbedderFused, WanImageEmbedderVAE, WanInputVideoEmbedder,
                    WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker, frames_of, vae_decode, vae_scales)
from .vace import WanVaceEmbedder, WanVaceInputVideoEmbedder, WanVaceNoiseInitializer, reference_frame_count


# The family's sampling defaults (diffusers' WanPipeline: 480x832, 81 frames, 50 steps, guidance 5): one place,
# read by __call__, `difftune sample` and validation.
CALL_DEFAULTS = {"height": 480, "width": 832, "num_frames": 81, "num_inference_steps": 50, "cfg_scale": 5.0}
FACE_SIZE = 512  # Wan2.2-Animate's face frames (the reference's and diffusers' size)


def latent_channels(context) -> int:
    """The run's latent channels: the VAE's (48 for Wan2.2's TI2V VAE), else the DiT's, else 16."""
    vae, dit = context.config("vae") or {}, context.config("dit") or {}
    return int(vae.get("z_dim") or dit.get("out_channels") or 16)


I2V = Feature("i2v", when=lambda c: c.has("input_image") and latent_channels(c) != 48,
              model_fn_inputs=("condition",), data_inputs=("input_image", "end_image"),
              description="image-to-video (Wan2.1 I2V / FLF2V, Wan2.2 I2V-A14B): the input (and end) image as the "
                          "known frames of a VAE-encoded condition")
CLIP = Feature("clip", when=lambda c: c.has("input_image") and c.config("image_encoder") is not None,
               model_fn_inputs=("image_embeds", "end_image_embeds"), data_inputs=("input_image", "end_image"),
               description="Wan2.1 I2V 14B / FLF2V: CLIP's embedding of the input (and end) image")
TI2V = Feature("ti2v", when=lambda c: c.has("input_image") and latent_channels(c) == 48,
               model_fn_inputs=("first_frame_latents",), data_inputs=("input_image",),
               description="Wan2.2 TI2V-5B: the input image as the clean first latent frame")


def _dit_extra_channels(context) -> int | None:
    """The DiT's input channels beyond the latents' (the conditions it takes on channels), None when no DiT."""
    dit = context.config("dit")
    if not dit or dit.get("in_channels") is None:
        return None
    return int(dit["in_channels"]) - int(dit.get("out_channels") or dit["in_channels"])


# The variants that add to the same algorithm (each a feature, chosen per run from its data columns; docs/wan.md)
FUN_CONTROL = Feature("fun_control", columns=("control_video",), model_fn_inputs=("control_latents",),
                      description="Fun-Control: the control video's VAE latents on channels before the image condition")
FUN_REFERENCE = Feature("fun_reference", columns=("reference_image",),
                        model_fn_inputs=("reference_latents", "reference_image_embeds"),
                        description="Fun-Control V1.1 / Wan2.2-Fun-A14B-Control: a reference image through the "
                                    "DiT's ref_conv (and its CLIP embedding)")
CAMERA = Feature("camera", columns=("camera_control_direction",),
                 data_inputs=("camera_control_direction", "camera_control_speed", "camera_control_origin"),
                 model_fn_inputs=("control_camera_latents",),
                 description="Fun-Control-Camera: a camera move as Plücker rays through the DiT's control adapter")
# The Wan2.1 camera DiTs take the input image's latents alone (16 channels) instead of the I2V condition (20)
CAMERA_IMAGE = Feature("camera_image", when=lambda c: c.has("camera_control_direction") and c.has("input_image")
                       and _dit_extra_channels(c) == 16, model_fn_inputs=("camera_image_latents",),
                       data_inputs=("input_image",),
                       description="Wan2.1 Fun-Control-Camera: the first frame's latents as the image condition")
SPEED_CONTROL = Feature("speed_control", columns=("motion_bucket_id",), model_fn_inputs=("motion_residual",),
                        description="speed control: the motion controller's residual on the time modulation")
VACE = Feature("vace", columns=("vace_video", "vace_video_mask", "vace_reference_image"),
               model_fn_inputs=("vace_context",),
               description="VACE: the control video, its mask and reference images as the VACE branch's context")
ANIMATE = Feature("animate", columns=("animate_pose_video", "animate_face_video"),
                  model_fn_inputs=("pose_latents", "face_motion"),
                  description="Wan2.2-Animate: a pose video (patch residual) and a face video (face adapter)")
ANIMATE_REPLACE = Feature("animate_replace", columns=("animate_inpaint_video", "animate_mask_video"),
                          requires=("animate",),
                          description="Wan2.2-Animate replacement mode: a background video and character mask as "
                                      "the image condition")
# Slots of the models only some variants use (model_fn reads the first three)
VARIANT_SLOTS = ("vace", "vace2", "animate_adapter", "motion_controller")


class WanVideoPipeline(BasePipeline):
    model_names = ("dit", "dit2", "text_encoder", "vae", "image_encoder", *VARIANT_SLOTS)
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds",)
    features = (I2V, CLIP, TI2V, FUN_CONTROL, FUN_REFERENCE, CAMERA, CAMERA_IMAGE, SPEED_CONTROL, VACE, ANIMATE,
                ANIMATE_REPLACE)
    data_inputs = ("video", "image", "prompt", "seed", "rand_device", "num_inference_steps")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "num_frames": SAME,
                      "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "num_frames", "rand_device")
    # model_fn runs the DiT and, where loaded, the VACE branch and the animate adapter (their hints / face blocks
    # read the DiT's tokens): stage 2 loads them with it
    loss_models = ("dit", "vace", "animate_adapter")
    decode_models = ("vae",)
    division_factor = 16  # x8 VAE and 2x2 patches (TI2V-5B's x16 VAE: its shape check rounds to 32)
    call_defaults = CALL_DEFAULTS
    output_kind = "clip"

    patch_size = 2
    vae_scale = 8
    latent_channels = 16
    # The video data path's settings: clips of 4k+1 frames, 81 by default (the reference's); --extra_inputs
    # input_image / end_image are the clip's first / last frame where the metadata has no such column.
    default_num_frames = 81
    time_division_factor = 4
    time_division_remainder = 1
    frame_inputs = {"input_image": ("video", 0), "end_image": ("video", -1)}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler if scheduler is not None else WanScheduler()
        self.tokenizer = None
        self.image_processor = None
        self.boundary_ratio = None  # the A14B expert switch from the repository (model_index.json)
        self.units = [
            WanShapeChecker(), WanNoiseInitializer(), WanVaceNoiseInitializer(), WanInputVideoEmbedder(),
            WanVaceInputVideoEmbedder(), WanPromptEmbedder(), WanImageEmbedderCLIP(), WanImageEmbedderVAE(),
            WanCameraImageLatents(), WanImageEmbedderFused(),
            WanFunControlEmbedder(), WanFunReferenceEmbedder(), WanCameraControl(),
            WanSpeedControl(), WanMotionResidual(),
            WanVaceEmbedder(),
            # the pose / face / background videos cut to the clip's frames minus 4 first (training)
            WanAnimateVideoSplit(), WanAnimatePoseLatents(), WanAnimateFaceMotion(), WanAnimateInpaint(),
        ]

    @classmethod
    def check_run(cls, context, features):
        """Models and data that do not go together, refused before any work (each in one line)."""
        extra = _dit_extra_channels(context)
        if extra and latent_channels(context) != 48 and "i2v" not in features and "fun_control" not in features:
            raise UserError("this Wan DiT is image-to-video: give an input image (--extra_inputs input_image)")
        dit = context.config("dit")
        needs = {"vace": ("vace", "a VACE file (its DiT file holds the VACE branch)"),
                 "animate": ("animate_adapter", "the Wan2.2-Animate-14B file (it holds the animate adapter)"),
                 "speed_control": ("motion_controller", "the motion controller (DiffSynth-Studio/"
                                   "Wan2.1-1.3b-speedcontrol-v1's model.safetensors)")}
        columns = {"vace": "vace_video / vace_reference_image", "animate": "animate_pose_video / animate_face_video",
                   "speed_control": "motion_bucket_id"}
        for feature, (slot, what) in needs.items():
            if feature in features and dit is not None and context.config(slot) is None:
                raise UserError(f"{columns[feature]}: given, but no {slot} model is loaded: name {what} in "
                                f"--model_paths / --model_id_with_origin_paths")
        if dit is None:
            return
        if "fun_control" in features and extra is not None and extra < 16:
            raise UserError("control_video: this Wan DiT takes no control latents (a Fun-Control DiT does)")
        if "fun_reference" in features and not dit.get("ref_conv_channels"):
            raise UserError("reference_image: this Wan DiT has no ref_conv (Fun-Control V1.1 and "
                            "Wan2.2-Fun-A14B-Control have one)")
        if "camera" in features:
            if not dit.get("control_adapter_in_channels"):
                raise UserError("camera_control_direction: this Wan DiT has no camera control adapter (a "
                                "Fun-Control-Camera DiT has one)")
            if "i2v" not in features:
                raise UserError("camera control needs the first frame: --extra_inputs input_image")

    @property
    def repo_scheduler(self):
        return getattr(self.scheduler, "sampler", None)

    @repo_scheduler.setter
    def repo_scheduler(self, found) -> None:
        """The repository's scheduler/ (FamilySpec tokenizers load it beside the DiT): sampling steps it."""
        if found is None:
            return
        self.scheduler.sampler = found.scheduler
        self.boundary_ratio = found.boundary_ratio

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None, first_frame_latents=None,
                 end_image_embeds=None, expert_boundary=None, **inputs):
        dit, vace = self.dit, self.vace
        if expert_boundary is not None and self.dit2 is not None and bool(timestep.reshape(-1)[0] < expert_boundary):
            # the low-noise expert below the boundary, as diffusers' boundary_ratio (with its own VACE branch)
            dit, vace = self.dit2, self.vace2 if self.vace2 is not None else self.vace
        if dit is None:
            raise UserError("no Wan DiT loaded")
        return model_fn_wan(dit, latents, timestep, prompt_embeds, image_embeds, condition, first_frame_latents,
                            end_image_embeds, vace=vace, animate_adapter=self.animate_adapter, **inputs)

    def module_path(self, slot: str, path: str) -> str:
        """`--trainable_models dit.blocks.0.self_attn.q` (Wan's original module names) -> blocks.0.attn1.to_q."""
        from .lora_names import module_in_diffusers

        return module_in_diffusers(path) if slot in ("dit", "dit2") else path

    def load_lora(self, module, path: str, alpha: float = 1.0) -> None:
        """As `BasePipeline.load_lora`; a DiT LoRA (`transformer.`) also fuses into the low-noise expert `dit2`,
        whose runs train it as `dit` (diffusers: `load_lora_weights(..., load_into_transformer_2=True)`)."""
        from ...lora import fuse_lora, load_lora_file

        if module is None or module is not self.dit2:
            return super().load_lora(module, path, alpha)
        lora = load_lora_file(path, converters=self.spec.lora_converters)
        component = "transformer_2" if "transformer_2" in lora.components else "transformer"
        fuse_lora(module, lora, scale=alpha, component=component)

    # -- latent layout --------------------------------------------------------------------------------
    def loss_mask(self, values):
        """TI2V-5B with an input image: its first latent frame is given clean, so it is left out of the loss."""
        if values.get("first_frame_latents") is None:
            return None
        frames = values["input_latents"].shape[2]
        mask = torch.ones(1, 1, frames, 1, 1)
        mask[:, :, 0] = 0
        return mask

    def noise_shape(self, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        """The latents of a clip of `num_frames` frames (validation: one frame unless told)."""
        channels, spatial, temporal = (self.latent_channels, self.vae_scale, 4) if self.vae is None \
            else vae_scales(self.vae)
        return (channels, (int(num_frames) - 1) // temporal + 1, height // spatial, width // spatial)

    def size_of(self, latents):
        _, spatial, temporal = (self.latent_channels, self.vae_scale, 4) if self.vae is None else vae_scales(self.vae)
        return {"height": int(latents.shape[-2]) * spatial, "width": int(latents.shape[-1]) * spatial,
                "num_frames": (int(latents.shape[2]) - 1) * temporal + 1}

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents -> clips (B, 3, F, H, W) in [-1, 1]; a one-frame clip as images (B, 3, H, W)."""
        video = vae_decode(self, latents)
        return video[:, :, 0] if video.shape[2] == 1 else video

    # -- sampling hooks -------------------------------------------------------------------------------
    def set_timesteps(self, values, num_inference_steps, denoising_strength=1.0):
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength)

    def finish_latents(self, latents, values):
        first = values.get("first_frame_latents")  # TI2V-5B: the clean first frame back in place
        if first is not None:
            latents = torch.cat([first.to(latents.dtype), latents[:, :, 1:]], dim=2)
        references = reference_frame_count(values.get("vace_reference_image"))  # VACE: its leading frames go
        if not references and values.get("pose_latents") is not None:
            # Animate-14B: the character's leading latent frame goes too (the reference and diffusers decode the
            # pose video's frames only, num_frames - 4)
            references = 1
        return latents[:, :, references:] if references else latents

    def postprocess(self, latents, output_type="pil"):
        """Per prompt a clip (a list of frames); "pt": (B, 3, F, H, W) in [0, 1]."""
        if output_type == "latent":
            return latents
        video = vae_decode(self, latents)
        if output_type == "pt":
            return (video.float() / 2 + 0.5).clamp(0, 1)
        return tensor_to_clips(video)

    # -- training -------------------------------------------------------------------------------------
    # The variants' data columns, as the reference's train.py hands them to its pipeline: clips (lists of frames; a
    # still image is a one-frame clip), images (the first frame of what the column loads, as its `[0]`) and values
    # (text or numbers). `same_length`: clips that must have the training clip's frames.
    clip_inputs = ("control_video", "vace_video", "vace_video_mask", "animate_pose_video", "animate_face_video",
                   "animate_inpaint_video", "animate_mask_video")
    same_length = ("control_video", "vace_video", "vace_video_mask")
    image_inputs = ("reference_image", "vace_reference_image")
    value_inputs = ("camera_control_direction", "camera_control_speed", "camera_control_origin", "motion_bucket_id")

    @classmethod
    def data_operators(cls, config) -> dict:
        """animate_face_video: its frames cropped and resized to 512 x 512 (the reference's face operator), not to the
        clip's size."""
        from ...data import UnifiedDataset

        frames = config.frames
        if frames is None:
            return {}
        return {"animate_face_video": UnifiedDataset.default_video_operator(
            config.dataset_base_path, FACE_SIZE, FACE_SIZE, config.max_pixels, 16, 16, **frames.as_dict())}

    def variant_inputs(self, data: dict[str, Any], num_frames: int) -> dict[str, Any]:
        """The variant columns a row has, as pipeline inputs (one-line errors naming the row and column)."""
        row = data.get("_row", "?")
        out = {}
        for name in self.clip_inputs:
            value = data.get(name)
            if value is None:
                continue
            frames = frames_of(value)
            if not frames or not all(isinstance(f, Image.Image) for f in frames):
                raise UserError(f"row {row}: '{name}' must be a clip or an image file (listed in --data_file_keys)")
            if name in self.same_length and len(frames) != num_frames:
                raise UserError(f"row {row}: '{name}' has {len(frames)} frames, the clip {num_frames}: give a clip "
                                f"as long as the video (cut to --num_frames)")
            out[name] = frames
        for name in self.image_inputs:
            value = data.get(name)
            if value is None:
                continue
            frames = frames_of(value)
            if not frames or not isinstance(frames[0], Image.Image):
                raise UserError(f"row {row}: '{name}' must be an image file (listed in --data_file_keys)")
            out[name] = frames[0]
        for name in self.value_inputs:
            value = data.get(name)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                out[name] = value
        return out

    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """A clip (`video`: its frames; or `image`: a one-frame clip) and its prompt; `input_image` and
        `end_image` when the data gives them (--extra_inputs), and the variants' columns (`variant_inputs`)."""
        row = data.get("_row", "?")
        video = data.get("video")
        if video is None:
            video = data.get("image")
        frames = frames_of(video)
        if not frames or not all(isinstance(f, Image.Image) for f in frames):
            raise UserError(f"row {row}: no clip: 'video' (frames) or 'image' must be a file listed in "
                            f"--data_file_keys")
        if (len(frames) - 1) % 4:
            raise UserError(f"row {row}: the clip has {len(frames)} frames; Wan needs 4k+1 (e.g. --num_frames 81)")
        images = {}
        for name, pick in (("input_image", 0), ("end_image", -1)):
            value = data.get(name)
            if isinstance(value, (list, tuple)) and value and all(isinstance(f, Image.Image) for f in value):
                value = value[pick]  # a file column read as a clip (an image file is a one-frame clip)
            if value is not None and not isinstance(value, Image.Image):
                raise UserError(f"row {row}: '{name}' must be an image (an image file, or a frame of the clip)")
            images[name] = value
        prompt = data.get("prompt", "")
        if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
            prompt = ""
        width, height = frames[0].size
        return {"prompt": prompt, "negative_prompt": "", "input_video": frames, "height": height, "width": width,
                "num_frames": len(frames), "input_image": images["input_image"], "end_image": images["end_image"],
                "seed": data.get("seed"), "rand_device": data.get("rand_device", "cpu"), "batch_size": 1,
                "num_inference_steps": data.get("num_inference_steps"), **self.variant_inputs(data, len(frames))}

    def batch_signature(self, sample: dict[str, Any]) -> tuple:
        frames = frames_of(sample.get("video") if sample.get("video") is not None else sample.get("image"))
        if any(sample.get(n) is not None for n in (*self.clip_inputs, *self.image_inputs, *self.value_inputs)):
            return ("one at a time", sample.get("_id"))  # a variant's inputs: each sample encoded alone
        return (frames[0].size if frames else None, len(frames), sample.get("input_image") is not None,
                sample.get("end_image") is not None, sample.get("rand_device", "cpu"))

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "", input_image=None,
                 end_image=None, height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"], num_frames: int = CALL_DEFAULTS["num_frames"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"],
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], seed: int | None = None,
                 boundary_ratio: float | None = None, progress: bool = True, output_type: str = "pil",
                 *, control_video=None, reference_image=None, camera_control_direction: str | None = None,
                 camera_control_speed: float | None = None, camera_control_origin=None,
                 motion_bucket_id: float | None = None, vace_video=None, vace_video_mask=None,
                 vace_reference_image=None, vace_scale: float = 1.0, animate_pose_video=None,
                 animate_face_video=None, animate_inpaint_video=None, animate_mask_video=None):
        """Frames as PIL images (a list per prompt when `prompt` is a list); `output_type` "latent" or "pt"
        (B, 3, F, H, W) in [0, 1]. With both A14B experts, `dit` runs above `boundary_ratio` x 1000 and `dit2`
        below (the repository's boundary_ratio, else 0.875).

        The variants' inputs (docs/wan.md): Fun-Control's `control_video` (frames) and `reference_image`; the
        camera move (`camera_control_direction` such as "Left" or "RightUp", `camera_control_speed` per frame,
        default 1/54); speed control's `motion_bucket_id`; VACE's `vace_video`, `vace_video_mask` (white: generate),
        `vace_reference_image` (one image or a list) and `vace_scale`; Wan2.2-Animate's `animate_pose_video` and
        `animate_face_video` (and, replacing a character, `animate_inpaint_video` and `animate_mask_video`), with
        the character image as `input_image`."""
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = input_image.size
        values.update({"height": height, "width": width, "num_frames": num_frames, "seed": seed,
                       "input_image": input_image, "end_image": end_image})
        variant = {"control_video": control_video, "reference_image": reference_image,
                   "camera_control_direction": camera_control_direction, "camera_control_speed": camera_control_speed,
                   "camera_control_origin": camera_control_origin, "motion_bucket_id": motion_bucket_id,
                   "vace_video": vace_video, "vace_video_mask": vace_video_mask,
                   "vace_reference_image": vace_reference_image, "animate_pose_video": animate_pose_video,
                   "animate_face_video": animate_face_video, "animate_inpaint_video": animate_inpaint_video,
                   "animate_mask_video": animate_mask_video}
        values.update({k: v for k, v in variant.items() if v is not None})
        if animate_face_video is not None:  # the unguided prediction sees a black face (-1 everywhere)
            values["negative_animate_face_video"] = [Image.new("RGB", f.size) for f in frames_of(animate_face_video)]
        settings = {"vace_scale": vace_scale}
        if self.dit2 is not None:
            ratio = boundary_ratio if boundary_ratio is not None else self.boundary_ratio
            ratio = DEFAULT_BOUNDARY_RATIO if ratio is None else float(ratio)
            settings["expert_boundary"] = ratio * self.scheduler.num_train_timesteps
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps, settings=settings,
                            progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out
