"""The reference's side of benchmarks/fidelity.py: DiffSynth-Studio's own classes, units and loss on the tiny weights
(run in DiffSynth-Studio's venv by fidelity.py; prints one FIDELITY_RESULT line and writes its tensors).

What it sets up, none of which edits DiffSynth:

* torchvision's op schemas (benchmarks/torchvision_shim.py), before anything imports diffusers or transformers.
* Model classes at the tiny widths: Z-Image's `ZImageDiT` and Wan's `WanModel` take their sizes as arguments; the
  text encoders' and VAEs' classes (and FLUX.1's `FluxDiT`, Qwen-Image's `QwenImageDiT`) hard-code the release's, so
  subclasses change only `__init__` (the same layers at the tiny widths; Wan's T5 also gets the tiny UMT5's
  relative-position range, 32, where the class keeps UMT5-XXL's 128). Every state dict goes through the reference's
  own converter (its model_configs.py entry for the release's file: FLUX.1's BFL DiT, CLIP, T5 and ae.safetensors
  converters) and loads with `strict=True`. The tiny CLIP file holds transformers 5's names (no `text_model.`
  prefix); the prefix the release's file has is put back before the converter.
* Qwen-Image: the DiT's `ApproximateGELU` (x * sigmoid(1.702 x)) as the class has it, or, with the payload's
  `"qwen_mlp_activation": "tanh"`, the released model's tanh-GELU (the documented difference removed).
* ERNIE-Image: `Flux2VAE.latent_stats` normalises with eps 1e-4 as the class has it, or, with the payload's
  `"latent_bn_eps": 1e-5`, difftune's (diffusers') epsilon (the documented difference removed).
* Krea-2: its attention asks for the cuDNN kernel alone (`sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`), absent on a
  CPU, so `krea2_dit.sdpa_kernel` is made a no-op (the same scaled_dot_product_attention, any backend); with the
  payload's `"krea2_text_positions": "real"` the text encoder gets positions counting real tokens only (difftune's and
  diffusers'), where the reference, passing only the mask, numbers the padding too.
* FLUX.2 and ERNIE-Image: the DiT and the VAE take their sizes as arguments (read from the diffusers configs); the
  text encoders' classes hard-code the release's widths and get the tiny ones in a subclass's `__init__`.
* Z-Image's `TimestepEmbedder` casts its sinusoidal features to bfloat16 whatever the weights' dtype (a bf16-only
  path: an fp32 run fails in the MLP's matmul); here the cast follows the MLP's weights (the same cast in a bf16 run),
  and the replay's `tembed_bf16` probe runs the embedding in bf16 as the reference's code has it.
* The loss's draws: `FlowMatchSFTLoss` calls `torch.randint` (the table index) and `torch.randn_like` (the noise);
  during the loss they answer the index and the noise fidelity.py gives.
* Replay: `launch_training_task` itself (AdamW, accelerate, its loop), with `ConstantLR` at factor 1 unless the payload
  keeps the warm-up (difftune's rate is constant).

Usage: `<diffsynth-venv>/bin/python benchmarks/fidelity_reference.py '<json payload>'`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchvision_shim import install as torchvision_shim  # noqa: E402

torchvision_shim()

RESULT_MARK = "FIDELITY_RESULT "


def _load(path) -> dict:
    import torch
    from safetensors.torch import load_file

    path = str(path)
    if path.endswith(".safetensors"):
        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def _folder(folder: Path) -> dict:
    out = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        out.update(_load(f))
    return out


# -- Z-Image ------------------------------------------------------------------------------------------------------

def tembed_cast(mode: str = "weights") -> None:
    """Z-Image's time embedding (see the module docstring): "weights": its cast follows the MLP's dtype; "bf16": the
    MLP runs in bfloat16 as the reference's cast asks (on a bf16 copy of its weights), its output cast back to the
    weights' dtype for the fp32 layers after it."""
    import copy

    import torch
    from diffsynth.models import z_image_dit

    cls = z_image_dit.TimestepEmbedder

    def forward(self, t):
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        dtype = self.mlp[0].weight.dtype
        if mode == "bf16":
            return copy.deepcopy(self.mlp).to(torch.bfloat16)(t_freq.to(torch.bfloat16)).to(dtype)
        return self.mlp(t_freq.to(dtype))

    cls.forward = forward


def z_image_pipeline(p: dict):
    import torch
    from diffsynth.models.flux_vae import DownSampler, FluxVAEEncoder, ResnetBlock, VAEAttentionBlock
    from diffsynth.models.z_image_dit import ZImageDiT
    from diffsynth.models.z_image_text_encoder import ZImageTextEncoder
    from diffsynth.pipelines.z_image import ZImagePipeline
    from diffsynth.utils.state_dict_converters.flux_vae import FluxVAEEncoderStateDictConverterDiffusers
    from diffsynth.utils.state_dict_converters.z_image_text_encoder import ZImageTextEncoderStateDictConverter
    from torch import nn
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    spec, repo = p["spec"], Path(p["repo"])
    vae_config = json.loads((repo / "vae" / "config.json").read_text())

    class TinyTextEncoder(ZImageTextEncoder):
        def __init__(self):
            nn.Module.__init__(self)
            self.model = Qwen3Model(Qwen3Config.from_pretrained(str(repo / "text_encoder")))

    class TinyVAEEncoder(FluxVAEEncoder):
        """FluxVAEEncoder's layers (two ResNet blocks a level, the mid block, no conv attention, as model_configs.py
        builds it for Z-Image-Turbo's AE) at the tiny widths and group count."""

        def __init__(self):
            nn.Module.__init__(self)
            self.scaling_factor, self.shift_factor = vae_config["scaling_factor"], vae_config["shift_factor"]
            c, g = vae_config["block_out_channels"], vae_config["norm_num_groups"]
            self.conv_in = nn.Conv2d(3, c[0], kernel_size=3, padding=1)
            blocks, prev = [], c[0]
            for i, width in enumerate(c):
                blocks += [ResnetBlock(prev, width, groups=g, eps=1e-6), ResnetBlock(width, width, groups=g, eps=1e-6)]
                if i < len(c) - 1:
                    blocks.append(DownSampler(width, padding=0, extra_padding=True))
                prev = width
            blocks += [ResnetBlock(prev, prev, groups=g, eps=1e-6),
                       VAEAttentionBlock(1, prev, prev, 1, norm_num_groups=g, eps=1e-6, use_conv_attention=False),
                       ResnetBlock(prev, prev, groups=g, eps=1e-6)]
            self.blocks = nn.ModuleList(blocks)
            self.conv_norm_out = nn.GroupNorm(num_channels=prev, num_groups=g, eps=1e-6)
            self.conv_act = nn.SiLU()
            self.conv_out = nn.Conv2d(prev, 2 * vae_config["latent_channels"], kernel_size=3, padding=1)

    dtype = torch.float32
    pipe = ZImagePipeline(device="cpu", torch_dtype=dtype)
    dit = ZImageDiT(dim=spec["dim"], n_layers=spec["n_layers"], n_refiner_layers=spec["n_refiner_layers"],
                    n_heads=spec["n_heads"], n_kv_heads=spec["n_heads"], cap_feat_dim=spec["text_hidden"],
                    axes_dims=list(spec["axes_dims"]), axes_lens=[1536, 512, 512])
    dit.load_state_dict(_folder(repo / "transformer"), strict=True)  # model_configs.py: no converter for this file
    text = TinyTextEncoder()
    text.load_state_dict(ZImageTextEncoderStateDictConverter(_folder(repo / "text_encoder")), strict=True)
    vae = TinyVAEEncoder()
    vae.load_state_dict(FluxVAEEncoderStateDictConverterDiffusers(_folder(repo / "vae")), strict=True)
    pipe.dit, pipe.text_encoder, pipe.vae_encoder = dit.to(dtype), text.to(dtype).eval(), vae.to(dtype).eval()
    pipe.tokenizer = AutoTokenizer.from_pretrained(str(repo / "tokenizer"))
    tembed_cast("weights")
    return pipe


def z_image_inputs(pipe, data):
    """examples/z_image/model_training/train.py's `get_pipeline_inputs` for sft."""
    image = data["image"]
    shared = {"input_image": image, "height": image.size[1], "width": image.size[0], "cfg_scale": 1,
              "rand_device": pipe.device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False}
    return shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}


def z_image_dataset(p: dict, repeat: int = 1):
    from diffsynth.core import UnifiedDataset

    return UnifiedDataset(base_path=p["data"], metadata_path=p["metadata"], repeat=repeat, data_file_keys=["image"],
                          main_data_operator=UnifiedDataset.default_image_operator(
                              base_path=p["data"], max_pixels=1024 * 1024, height=p["size"], width=p["size"],
                              height_division_factor=16, width_division_factor=16))


# -- Wan ----------------------------------------------------------------------------------------------------------

def wan_pipeline(p: dict):
    import torch
    from diffsynth.models.wan_video_dit import WanModel
    from diffsynth.models.wan_video_text_encoder import HuggingfaceTokenizer, WanTextEncoder
    from diffsynth.models.wan_video_vae import WanVideoVAE
    from diffsynth.pipelines.wan_video import WanVideoPipeline

    repo = Path(p["repo"])
    cfg = json.loads((repo / "config.json").read_text())
    dtype = torch.float32
    pipe = WanVideoPipeline(device="cpu", torch_dtype=dtype)
    dit_state = _load(repo / "diffusion_pytorch_model.safetensors")
    dim, heads = cfg["dim"], cfg["num_heads"]
    text_dim = dit_state["text_embedding.0.weight"].shape[1]
    freq_dim = dit_state["time_embedding.0.weight"].shape[1]
    dit = WanModel(dim=dim, in_dim=cfg["in_dim"], ffn_dim=cfg["ffn_dim"], out_dim=cfg["out_dim"], text_dim=text_dim,
                   freq_dim=freq_dim, eps=1e-6, patch_size=(1, 2, 2), num_heads=heads, num_layers=cfg["num_layers"],
                   has_image_input=False)
    dit.load_state_dict(dit_state, strict=True)
    t5_state = _load(repo / "models_t5_umt5-xxl-enc-bf16.pth")
    t5_config = json.loads((repo / "diffusers" / "text_encoder" / "config.json").read_text())
    text = WanTextEncoder(vocab=t5_state["token_embedding.weight"].shape[0], dim=t5_config["d_model"],
                          dim_attn=t5_config["num_heads"] * t5_config["d_kv"], dim_ffn=t5_config["d_ff"],
                          num_heads=t5_config["num_heads"], num_layers=t5_config["num_layers"],
                          num_buckets=t5_config["relative_attention_num_buckets"], shared_pos=False)
    text.load_state_dict(t5_state, strict=True)
    from diffsynth.models.wan_video_text_encoder import T5RelativeEmbedding

    for m in text.modules():  # the tiny UMT5's bucket range (the class's default, 128, is UMT5-XXL's)
        if isinstance(m, T5RelativeEmbedding):
            m.max_dist = t5_config["relative_attention_max_distance"]
    vae_state = _load(repo / "Wan2.1_VAE.pth")
    from diffsynth.models.wan_video_vae import VideoVAE_
    from diffsynth.utils.state_dict_converters.wan_video_vae import WanVideoVAEStateDictConverter

    class TinyVAE(WanVideoVAE):
        """WanVideoVAE with its VideoVAE_ at the tiny first width (the level structure is the release's)."""

        def __init__(self):
            super().__init__(z_dim=16)
            self.model = VideoVAE_(dim=vae_state["encoder.conv1.weight"].shape[0], z_dim=16).eval().requires_grad_(False)

    vae = TinyVAE()

    vae.load_state_dict(WanVideoVAEStateDictConverter(vae_state), strict=True)
    pipe.dit, pipe.text_encoder, pipe.vae = dit.to(dtype), text.to(dtype).eval(), vae.to(dtype).eval()
    pipe.tokenizer = HuggingfaceTokenizer(name=str(repo / "google" / "umt5-xxl"), seq_len=512, clean="whitespace")
    return pipe


def wan_inputs(pipe, data):
    """examples/wanvideo/model_training/train.py's `get_pipeline_inputs` for T2V sft."""
    video = data["video"]
    shared = {"input_video": video, "height": video[0].size[1], "width": video[0].size[0], "num_frames": len(video),
              "cfg_scale": 1, "tiled": False, "rand_device": pipe.device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False, "cfg_merge": False, "vace_scale": 1,
              "max_timestep_boundary": 1, "min_timestep_boundary": 0}
    return shared, {"prompt": data["prompt"]}, {}


def wan_dataset(p: dict, repeat: int = 1):
    from diffsynth.core import UnifiedDataset

    return UnifiedDataset(base_path=p["data"], metadata_path=p["metadata"], repeat=repeat, data_file_keys=["video"],
                          main_data_operator=UnifiedDataset.default_video_operator(
                              base_path=p["data"], max_pixels=1920 * 1080, height=p["size"], width=p["size"],
                              height_division_factor=16, width_division_factor=16, num_frames=p["frames"],
                              time_division_factor=4, time_division_remainder=1))


# -- FLUX.1 -------------------------------------------------------------------------------------------------------

def tiny_vae_encoder(vae_config: dict, use_conv_attention: bool):
    """FluxVAEEncoder's layers (two ResNet blocks a level, the mid block, as model_configs.py builds it for FLUX.1's
    and Z-Image-Turbo's AE) at the tiny widths and group count of a diffusers AutoencoderKL config."""
    from diffsynth.models.flux_vae import DownSampler, FluxVAEEncoder, ResnetBlock, VAEAttentionBlock
    from torch import nn

    class TinyVAEEncoder(FluxVAEEncoder):
        def __init__(self):
            nn.Module.__init__(self)
            self.scaling_factor, self.shift_factor = vae_config["scaling_factor"], vae_config["shift_factor"]
            c, g = vae_config["block_out_channels"], vae_config["norm_num_groups"]
            self.conv_in = nn.Conv2d(3, c[0], kernel_size=3, padding=1)
            blocks, prev = [], c[0]
            for i, width in enumerate(c):
                blocks += [ResnetBlock(prev, width, groups=g, eps=1e-6), ResnetBlock(width, width, groups=g, eps=1e-6)]
                if i < len(c) - 1:
                    blocks.append(DownSampler(width, padding=0, extra_padding=True))
                prev = width
            blocks += [ResnetBlock(prev, prev, groups=g, eps=1e-6),
                       VAEAttentionBlock(1, prev, prev, 1, norm_num_groups=g, eps=1e-6,
                                         use_conv_attention=use_conv_attention),
                       ResnetBlock(prev, prev, groups=g, eps=1e-6)]
            self.blocks = nn.ModuleList(blocks)
            self.conv_norm_out = nn.GroupNorm(num_channels=prev, num_groups=g, eps=1e-6)
            self.conv_act = nn.SiLU()
            self.conv_out = nn.Conv2d(prev, 2 * vae_config["latent_channels"], kernel_size=3, padding=1)

    return TinyVAEEncoder()


def flux_pipeline(p: dict):
    """FluxImagePipeline with FluxDiT (BFL's flux1-dev.safetensors through FluxDiTStateDictConverter), its CLIP and T5
    encoders (text_encoder/, text_encoder_2/ through their converters) and FluxVAEEncoder (ae.safetensors through
    FluxVAEEncoderStateDictConverter), each at the tiny widths."""
    import torch
    from diffsynth.models.flux_dit import (AdaLayerNormContinuous, FluxDiT, FluxJointTransformerBlock,
                                           FluxSingleTransformerBlock, RoPEEmbedding, TimestepEmbeddings)
    from diffsynth.models.flux_text_encoder_clip import CLIPEncoderLayer, FluxTextEncoderClip
    from diffsynth.models.flux_text_encoder_t5 import FluxTextEncoderT5
    from diffsynth.pipelines.flux_image import FluxImagePipeline
    from diffsynth.utils.state_dict_converters.flux_dit import FluxDiTStateDictConverter
    from diffsynth.utils.state_dict_converters.flux_text_encoder_clip import FluxTextEncoderClipStateDictConverter
    from diffsynth.utils.state_dict_converters.flux_text_encoder_t5 import FluxTextEncoderT5StateDictConverter
    from diffsynth.utils.state_dict_converters.flux_vae import FluxVAEEncoderStateDictConverter
    from torch import nn
    from transformers import CLIPTokenizer, T5Config, T5EncoderModel, T5TokenizerFast

    spec, repo = p["spec"], Path(p["repo"])
    heads, dim = spec["num_attention_heads"], spec["num_attention_heads"] * spec["attention_head_dim"]

    class TinyDiT(FluxDiT):
        def __init__(self):
            nn.Module.__init__(self)
            self.pos_embedder = RoPEEmbedding(dim, 10000, list(spec["axes_dims_rope"]))
            self.time_embedder = TimestepEmbeddings(256, dim)
            self.guidance_embedder = TimestepEmbeddings(256, dim) if spec["guidance_embeds"] else None
            self.pooled_text_embedder = nn.Sequential(nn.Linear(spec["clip_hidden"], dim), nn.SiLU(),
                                                      nn.Linear(dim, dim))
            self.context_embedder = nn.Linear(spec["t5_hidden"], dim)
            self.x_embedder = nn.Linear(64, dim)
            self.blocks = nn.ModuleList([FluxJointTransformerBlock(dim, heads) for _ in range(spec["num_layers"])])
            self.single_blocks = nn.ModuleList([FluxSingleTransformerBlock(dim, heads)
                                                for _ in range(spec["num_single_layers"])])
            self.final_norm_out = AdaLayerNormContinuous(dim)
            self.final_proj_out = nn.Linear(dim, 64)
            self.input_dim = 64

    clip_config = json.loads((repo / "text_encoder" / "config.json").read_text())

    class TinyClip(FluxTextEncoderClip):
        def __init__(self):
            nn.Module.__init__(self)
            width, n_heads = clip_config["hidden_size"], clip_config["num_attention_heads"]
            self.token_embedding = nn.Embedding(clip_config["vocab_size"], width)
            self.position_embeds = nn.Parameter(torch.zeros(1, clip_config["max_position_embeddings"], width))
            self.encoders = nn.ModuleList([CLIPEncoderLayer(width, clip_config["intermediate_size"], num_heads=n_heads,
                                                            head_dim=width // n_heads)
                                           for _ in range(clip_config["num_hidden_layers"])])
            self.attn_mask = self.attention_mask(clip_config["max_position_embeddings"])
            self.final_layer_norm = nn.LayerNorm(width)

    class TinyT5(FluxTextEncoderT5):
        def __init__(self):
            T5EncoderModel.__init__(self, T5Config.from_pretrained(str(repo / "text_encoder_2")))

    dtype = torch.float32
    pipe = FluxImagePipeline(device="cpu", torch_dtype=dtype)
    dit = TinyDiT()
    dit.load_state_dict(FluxDiTStateDictConverter(_load(repo / "flux1-dev.safetensors")), strict=True)
    clip = TinyClip()
    # the release's file names CLIPTextModel's weights `text_model.*`; transformers 5 saves them without the prefix
    clip_state = {k if k.startswith("text_model.") else "text_model." + k: v
                  for k, v in _load(repo / "text_encoder" / "model.safetensors").items()}
    clip.load_state_dict(FluxTextEncoderClipStateDictConverter(clip_state), strict=True)
    t5 = TinyT5()
    t5.load_state_dict(FluxTextEncoderT5StateDictConverter(_folder(repo / "text_encoder_2")), strict=True)
    vae = tiny_vae_encoder(json.loads((repo / "vae" / "config.json").read_text()), use_conv_attention=True)
    vae.load_state_dict(FluxVAEEncoderStateDictConverter(_load(repo / "ae.safetensors")), strict=True)
    pipe.dit, pipe.text_encoder_1, pipe.text_encoder_2 = dit.to(dtype), clip.to(dtype).eval(), t5.to(dtype).eval()
    pipe.vae_encoder = vae.to(dtype).eval()
    pipe.tokenizer_1 = CLIPTokenizer.from_pretrained(str(repo / "tokenizer"))
    pipe.tokenizer_2 = T5TokenizerFast.from_pretrained(str(repo / "tokenizer_2"))
    return pipe


def flux_inputs(pipe, data):
    """examples/flux/model_training/train.py's `get_pipeline_inputs` (sft, no extra inputs)."""
    image = data["image"]
    shared = {"input_image": image, "height": image.size[1], "width": image.size[0], "cfg_scale": 1,
              "embedded_guidance": 1, "t5_sequence_length": 512, "tiled": False, "rand_device": pipe.device,
              "use_gradient_checkpointing": False, "use_gradient_checkpointing_offload": False}
    return shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}


# -- Qwen-Image ---------------------------------------------------------------------------------------------------

def qwen_mlp_activation(mode: str) -> None:
    """The DiT MLP's activation: "reference" leaves `ApproximateGELU` as it is (x * sigmoid(1.702 x)); "tanh" makes it
    the tanh approximation of GELU, the released model's (diffusers' `gelu-approximate`, which difftune runs)."""
    import torch
    from diffsynth.models import qwen_image_dit

    cls = qwen_image_dit.ApproximateGELU
    if not hasattr(cls, "_fidelity_forward"):
        cls._fidelity_forward = cls.forward
    if mode == "tanh":
        cls.forward = lambda self, x: torch.nn.functional.gelu(self.proj(x), approximate="tanh")
    else:
        cls.forward = cls._fidelity_forward


def qwen_image_pipeline(p: dict):
    """QwenImagePipeline with QwenImageDiT, QwenImageTextEncoder and QwenImageVAE at the tiny widths, loaded strictly
    from the diffusers / transformers files (model_configs.py: no converter for the DiT and the VAE)."""
    import torch
    from diffsynth.models.general_modules import AdaLayerNorm, RMSNorm, TimestepEmbeddings
    from diffsynth.models.qwen_image_dit import QwenEmbedRope, QwenImageDiT, QwenImageTransformerBlock
    from diffsynth.models.qwen_image_text_encoder import QwenImageTextEncoder
    from diffsynth.models.qwen_image_vae import QwenImageVAE
    from diffsynth.pipelines.qwen_image import QwenImagePipeline
    from torch import nn
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    spec, repo = p["spec"], Path(p["repo"])
    heads, head_dim, text = spec["num_attention_heads"], spec["attention_head_dim"], spec["text_hidden"]
    dim = heads * head_dim

    class TinyDiT(QwenImageDiT):
        def __init__(self):
            nn.Module.__init__(self)
            self.pos_embed = QwenEmbedRope(theta=10000, axes_dim=list(spec["axes_dims_rope"]), scale_rope=True)
            self.time_text_embed = TimestepEmbeddings(256, dim, diffusers_compatible_format=True, scale=1000,
                                                      align_dtype_to_timestep=False, use_additional_t_cond=False)
            self.txt_norm = RMSNorm(text, eps=1e-6)
            self.img_in, self.txt_in = nn.Linear(64, dim), nn.Linear(text, dim)
            self.transformer_blocks = nn.ModuleList([QwenImageTransformerBlock(
                dim=dim, num_attention_heads=heads, attention_head_dim=head_dim) for _ in range(spec["num_layers"])])
            self.norm_out, self.proj_out = AdaLayerNorm(dim, single=True), nn.Linear(dim, 64)

    class TinyTextEncoder(QwenImageTextEncoder):
        """The class's forward on transformers' Qwen2.5-VL of the tiny config (its __init__ builds the 7B's)."""

        def __init__(self, hf):
            nn.Module.__init__(self)
            self.model, self.lm_head, self.config = hf.model, hf.lm_head, hf.config

    dtype = torch.float32
    pipe = QwenImagePipeline(device="cpu", torch_dtype=dtype)
    dit = TinyDiT()
    dit.load_state_dict(_folder(repo / "transformer"), strict=True)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(repo / "text_encoder"), torch_dtype=dtype)
    vae = QwenImageVAE(base_dim=spec["vae_base_dim"], z_dim=16, dim_mult=list(spec["vae_dim_mult"]),
                       num_res_blocks=spec["vae_num_res_blocks"], temperal_downsample=[False, True, True])
    vae.load_state_dict(_folder(repo / "vae"), strict=True)
    pipe.dit, pipe.text_encoder = dit.to(dtype), TinyTextEncoder(hf).to(dtype).eval()
    pipe.vae = vae.to(dtype).eval()
    pipe.tokenizer = AutoTokenizer.from_pretrained(str(repo / "tokenizer"))
    if p.get("drop") is not None and p["drop"] != 34:  # not the template count the prompt unit hard-codes
        raise ValueError(f"the tokenizer's template is {p['drop']} tokens; the reference drops 34")
    qwen_mlp_activation(p.get("qwen_mlp_activation", "reference"))
    return pipe


def qwen_image_inputs(pipe, data):
    """examples/qwen_image/model_training/train.py's `get_pipeline_inputs` (sft, one image, no extra inputs)."""
    image = data["image"]
    shared = {"cfg_scale": 1, "rand_device": pipe.device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False, "edit_image_auto_resize": True, "zero_cond_t": False,
              "input_image": image, "height": image.size[1], "width": image.size[0]}
    return shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}


# -- FLUX.2 -------------------------------------------------------------------------------------------------------

def _init_kwargs(cls, config: dict, renames: dict | None = None) -> dict:
    """The values of a diffusers config that `cls.__init__` takes (some under another name)."""
    import inspect

    names = inspect.signature(cls.__init__).parameters
    out = {}
    for key, value in config.items():
        key = (renames or {}).get(key, key)
        if key in names and key != "self":
            out[key] = tuple(value) if isinstance(value, list) else value
    return out


def flux2_pipeline(p: dict):
    """Flux2ImagePipeline (klein: the Qwen3 text encoder) with Flux2DiT and Flux2VAE from the diffusers configs (both
    take their sizes as arguments; no converter for their files) and ZImageTextEncoder at the tiny width (its class
    hard-codes Qwen3-4B's; the converter drops lm_head)."""
    import torch
    from diffsynth.models.flux2_dit import Flux2DiT
    from diffsynth.models.flux2_vae import Flux2VAE
    from diffsynth.models.z_image_text_encoder import ZImageTextEncoder
    from diffsynth.pipelines.flux2_image import Flux2ImagePipeline
    from diffsynth.utils.state_dict_converters.z_image_text_encoder import ZImageTextEncoderStateDictConverter
    from torch import nn
    from transformers import AutoTokenizer, Qwen3Config, Qwen3Model

    repo = Path(p["repo"])

    class TinyTextEncoder(ZImageTextEncoder):
        def __init__(self):
            nn.Module.__init__(self)
            self.model = Qwen3Model(Qwen3Config.from_pretrained(str(repo / "text_encoder")))

    dtype = torch.float32
    pipe = Flux2ImagePipeline(device="cpu", torch_dtype=dtype)
    dit = Flux2DiT(**_init_kwargs(Flux2DiT, json.loads((repo / "transformer" / "config.json").read_text())))
    dit.load_state_dict(_folder(repo / "transformer"), strict=True)
    text = TinyTextEncoder()
    text.load_state_dict(ZImageTextEncoderStateDictConverter(_folder(repo / "text_encoder")), strict=True)
    vae_config = json.loads((repo / "vae" / "config.json").read_text())
    vae = Flux2VAE(**_init_kwargs(Flux2VAE, vae_config, {"norm_num_groups": "num_groups"}))
    vae.load_state_dict(_folder(repo / "vae"), strict=True)
    pipe.dit, pipe.text_encoder_qwen3, pipe.vae = dit.to(dtype), text.to(dtype).eval(), vae.to(dtype).eval()
    pipe.tokenizer = AutoTokenizer.from_pretrained(str(repo / "tokenizer"))
    return pipe


def flux2_inputs(pipe, data):
    """examples/flux2/model_training/train.py's `get_pipeline_inputs` (sft, no extra inputs)."""
    image = data["image"]
    shared = {"input_image": image, "height": image.size[1], "width": image.size[0], "embedded_guidance": 1.0,
              "cfg_scale": 1, "rand_device": pipe.device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False}
    return shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}


# -- ERNIE-Image --------------------------------------------------------------------------------------------------

def latent_bn_eps(eps: float | None) -> None:
    """Flux2VAE's latent normalisation epsilon: the class's 1e-4 (None), or `eps` (difftune's 1e-5, diffusers')."""
    import torch
    from diffsynth.models.flux2_vae import Flux2VAE

    if not hasattr(Flux2VAE, "_fidelity_latent_stats"):
        Flux2VAE._fidelity_latent_stats = Flux2VAE.latent_stats
    if eps is None:
        Flux2VAE.latent_stats = Flux2VAE._fidelity_latent_stats
        return

    def latent_stats(self, device, dtype):
        mean, var = self.bn()
        mean = mean.to(device=device, dtype=dtype).view(1, -1, 1, 1)
        return mean, torch.sqrt(var.to(device=device, dtype=dtype) + eps).view(1, -1, 1, 1)

    Flux2VAE.latent_stats = latent_stats


def ernie_image_pipeline(p: dict):
    """ErnieImagePipeline with ErnieImageDiT and Flux2VAE from the diffusers configs (sizes as arguments, no
    converter) and ErnieImageTextEncoder at the tiny width (its class hard-codes Ministral-3-3B's; the converter keeps
    the language model of the Mistral3Model file)."""
    import torch
    from diffsynth.models.ernie_image_dit import ErnieImageDiT
    from diffsynth.models.ernie_image_text_encoder import ErnieImageTextEncoder
    from diffsynth.models.flux2_vae import Flux2VAE
    from diffsynth.pipelines.ernie_image import ErnieImagePipeline
    from diffsynth.utils.state_dict_converters.ernie_image_text_encoder import ErnieImageTextEncoderStateDictConverter
    from torch import nn
    from transformers import AutoTokenizer, Ministral3Config, Ministral3Model

    repo = Path(p["repo"])
    text_config = json.loads((repo / "text_encoder" / "config.json").read_text())["text_config"]

    class TinyTextEncoder(ErnieImageTextEncoder):
        def __init__(self):
            nn.Module.__init__(self)
            self.config = Ministral3Config(**text_config)
            self.model = Ministral3Model(self.config)

    dtype = torch.float32
    pipe = ErnieImagePipeline(device="cpu", torch_dtype=dtype)
    dit = ErnieImageDiT(**_init_kwargs(ErnieImageDiT, json.loads((repo / "transformer" / "config.json").read_text())))
    dit.load_state_dict(_folder(repo / "transformer"), strict=True)
    text = TinyTextEncoder()
    text.load_state_dict(ErnieImageTextEncoderStateDictConverter(_folder(repo / "text_encoder")), strict=True)
    vae_config = json.loads((repo / "vae" / "config.json").read_text())
    vae = Flux2VAE(**_init_kwargs(Flux2VAE, vae_config, {"norm_num_groups": "num_groups"}))
    vae.load_state_dict(_folder(repo / "vae"), strict=True)
    pipe.dit, pipe.text_encoder, pipe.vae = dit.to(dtype), text.to(dtype).eval(), vae.to(dtype).eval()
    pipe.tokenizer = AutoTokenizer.from_pretrained(str(repo / "tokenizer"))
    latent_bn_eps(p.get("latent_bn_eps"))
    return pipe


def ernie_image_inputs(pipe, data):
    """examples/ernie_image/model_training/train.py's `get_pipeline_inputs` (sft, no extra inputs)."""
    image = data["image"]
    shared = {"input_image": image, "height": image.size[1], "width": image.size[0], "cfg_scale": 1,
              "rand_device": pipe.device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False}
    return shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}


# -- Krea-2 -------------------------------------------------------------------------------------------------------

def krea2_pipeline(p: dict):
    """Krea2Pipeline with SingleStreamDiT at the tiny sizes (its config dict; raw.safetensors loads as it is),
    Krea2TextEncoder at the tiny width (its class hard-codes Qwen3-VL-4B's; its converter) and QwenImageVAE."""
    import torch
    from diffsynth.models.krea2_dit import SingleStreamDiT
    from diffsynth.models.krea2_text_encoder import Krea2TextEncoder
    from diffsynth.models.qwen_image_vae import QwenImageVAE
    from diffsynth.pipelines.krea2 import Krea2Pipeline
    from diffsynth.utils.state_dict_converters.krea2_text_encoder import Krea2TextEncoderStateDictConverter
    from torch import nn
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    spec, dit_path, text_path, vae_path = p["spec"], *map(Path, p["paths"])
    # its attention asks for the cuDNN kernel only (`sdpa_kernel(SDPBackend.CUDNN_ATTENTION)`), which a CPU has not:
    # the same scaled_dot_product_attention with any backend (the math one here)
    import contextlib as _contextlib

    from diffsynth.models import krea2_dit

    krea2_dit.sdpa_kernel = lambda *a, **k: _contextlib.nullcontext()

    real_positions = p.get("krea2_text_positions") == "real"

    class TinyTextEncoder(Krea2TextEncoder):
        def __init__(self):
            nn.Module.__init__(self)
            self.config = Qwen3VLConfig.from_pretrained(str(text_path.parent))
            self.model = Qwen3VLForConditionalGeneration(self.config)

        def forward(self, input_ids=None, attention_mask=None, output_hidden_states=True, **kwargs):
            if real_positions:  # positions counting real tokens only (diffusers' Krea2Pipeline, difftune)
                positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
                kwargs["position_ids"] = positions.unsqueeze(0).expand(3, -1, -1)
            return super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)

    dtype = torch.float32
    pipe = Krea2Pipeline(device="cpu", torch_dtype=dtype)
    features = spec["hidden_heads"] * spec["head_dim"]
    dit = SingleStreamDiT(config={"features": features, "tdim": 32, "txtdim": spec["text_hidden"],
                                  "heads": spec["hidden_heads"], "kvheads": spec["kv_heads"],
                                  "multiplier": spec["multiplier"], "layers": spec["layers"], "patch": 2, "channels": 16,
                                  "txtheads": spec["text_heads"], "txtkvheads": spec["text_heads"], "txtlayers": 12})
    dit.load_state_dict(_load(dit_path), strict=True)
    text = TinyTextEncoder()
    text.load_state_dict(Krea2TextEncoderStateDictConverter(_load(text_path)), strict=True)
    vae_config = json.loads((vae_path.parent / "config.json").read_text())
    vae = QwenImageVAE(base_dim=vae_config["base_dim"], z_dim=vae_config["z_dim"], dim_mult=vae_config["dim_mult"],
                       num_res_blocks=vae_config["num_res_blocks"],
                       temperal_downsample=vae_config["temperal_downsample"])
    vae.load_state_dict(_load(vae_path), strict=True)
    pipe.dit, pipe.text_encoder, pipe.vae = dit.to(dtype), text.to(dtype).eval(), vae.to(dtype).eval()
    pipe.tokenizer = AutoTokenizer.from_pretrained(str(text_path.parent), max_length=512)
    return pipe


def krea2_inputs(pipe, data):
    """examples/krea2/model_training/train.py's `get_pipeline_inputs` (sft, no extra inputs)."""
    image = data["image"]
    shared = {"input_image": image, "height": image.size[1], "width": image.size[0], "cfg_scale": 1,
              "rand_device": pipe.device, "use_gradient_checkpointing": False,
              "use_gradient_checkpointing_offload": False}
    return shared, {"prompt": data["prompt"]}, {"negative_prompt": ""}


FAMILIES = {"z_image": (z_image_pipeline, z_image_inputs, z_image_dataset),
            "wan": (wan_pipeline, wan_inputs, wan_dataset),
            "flux": (flux_pipeline, flux_inputs, z_image_dataset),
            "qwen_image": (qwen_image_pipeline, qwen_image_inputs, z_image_dataset),
            "flux2": (flux2_pipeline, flux2_inputs, z_image_dataset),
            "ernie_image": (ernie_image_pipeline, ernie_image_inputs, z_image_dataset),
            "krea2": (krea2_pipeline, krea2_inputs, z_image_dataset)}


# -- the training module and the loss -----------------------------------------------------------------------------

@contextlib.contextmanager
def forced(index: int, noise):
    """During the loss: torch.randint answers [index], torch.randn_like the forced noise."""
    import torch

    randint, randn_like = torch.randint, torch.randn_like
    torch.randint = lambda *a, **k: torch.tensor([index])
    torch.randn_like = lambda x, *a, **k: noise.to(dtype=x.dtype, device=x.device).reshape(x.shape).clone()
    try:
        yield
    finally:
        torch.randint, torch.randn_like = randint, randn_like


def make_module(p: dict, pipe, inputs_fn, noise, record: dict):
    from diffsynth.diffusion.loss import FlowMatchSFTLoss
    from diffsynth.diffusion.training_module import DiffusionTrainingModule

    class Module(DiffusionTrainingModule):
        """The family's train.py module shape: training mode in __init__, units + FlowMatchSFTLoss in forward."""

        def __init__(self):
            super().__init__()
            self.pipe = pipe
            self.switch_pipe_to_training_mode(pipe, None, "dit", p["targets"], p["rank"], task="sft")
            self.split_pipeline_units("sft", pipe, None, "dit")

        def forward(self, data, inputs=None):
            inputs = inputs_fn(self.pipe, data) if inputs is None else inputs
            inputs = self.transfer_data_to_device(inputs, self.pipe.device, self.pipe.torch_dtype)
            for unit in self.pipe.units:
                inputs = self.pipe.unit_runner(unit, self.pipe, *inputs)
            record["inputs"] = inputs
            with forced(p["index"], noise):
                loss = FlowMatchSFTLoss(self.pipe, **inputs[0], **inputs[1])
            record.setdefault("losses", []).append(float(loss))
            return loss

    return Module()


def load_lora(module, path: str) -> int:
    import torch

    init = _load(path)
    n = 0
    with torch.no_grad():
        for name, param in module.pipe.dit.named_parameters():
            if ".lora_" in name:
                param.copy_(init.pop(name))
                n += 1
    if init:
        raise KeyError(f"LoRA tensors with no parameter here: {sorted(init)[:5]}")
    return n


def step(p: dict) -> dict:
    import torch
    from safetensors.torch import save_file

    build, inputs_fn, dataset_fn = FAMILIES[p["family"]]
    pipe = build(p)
    noise = _load(p["noise"])["noise"]
    if p.get("noise_layout") == "tokens":  # difftune's (B, C, h, w) latents -> the reference's (B, h w, C) tokens
        noise = noise.flatten(2).transpose(1, 2).contiguous()
    record: dict = {}
    module = make_module(p, pipe, inputs_fn, noise, record)
    load_lora(module, p["lora"])
    data = dataset_fn(p)[0]
    loss = module(data)
    loss.backward()
    shared, posi = record["inputs"][0], record["inputs"][1]
    out = {}
    stage1 = p.get("stage1") or {"prompt_embeds": ["prompt_embeds", "context"], "input_latents": ["input_latents"]}
    for ours, names in stage1.items():  # difftune's name -> the reference's names for the value
        value = next(d[k] for k in names for d in (posi, shared) if d.get(k) is not None)
        while isinstance(value, (list, tuple)):
            value = value[0]
        mask_name = (p.get("stage1_masks") or {}).get(ours)
        if mask_name is not None:  # a fixed-length sequence: its real (unmasked) tokens, as difftune keeps them
            mask = next(d[mask_name] for d in (posi, shared) if d.get(mask_name) is not None)
            value = value[0][mask[0].bool()]
        out[f"stage1.{ours}"] = value.float()
    for name, param in pipe.dit.named_parameters():
        if ".lora_" in name:  # no gradient where the loss does not read the layer (as difftune's side: zeros)
            out[f"grad.{name}"] = param.grad.float() if param.grad is not None else torch.zeros_like(param).float()
    save_file({k: v.detach().contiguous() for k, v in out.items()}, p["result"])
    timestep = pipe.scheduler.timesteps[p["index"]]
    return {"loss": float(loss), "timestep": float(timestep), "sigma": float(pipe.scheduler.sigmas[p["index"]]),
            "weight": float(pipe.scheduler.training_weight(timestep))}


def replay(p: dict) -> dict:
    """`launch_training_task` for `steps` steps on the one sample (repeat = steps), and the probes' variants."""
    import accelerate
    import torch
    from diffsynth.diffusion import runner
    from diffsynth.diffusion.logger import ModelLogger
    from safetensors.torch import save_file

    build, inputs_fn, dataset_fn = FAMILIES[p["family"]]
    noise = _load(p["noise"])["noise"]
    out, info = {}, {}

    def run(tag: str, warmup: bool, tembed_fp32: bool = True, optimizer: dict | None = None) -> list[float]:
        pipe = build(p)
        if p["family"] == "z_image":
            tembed_cast("weights" if tembed_fp32 else "bf16")
        record: dict = {}
        module = make_module(p, pipe, inputs_fn, noise, record)
        load_lora(module, p["lora"])
        scheduler_class, optimizer_class = torch.optim.lr_scheduler.ConstantLR, runner.get_optimizer_class
        if not warmup:
            runner.torch.optim.lr_scheduler.ConstantLR = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
        if optimizer is not None:
            runner.get_optimizer_class = lambda customized=None: (
                lambda params, **kw: torch.optim.AdamW(params, **kw, **optimizer))
        args = SimpleNamespace(learning_rate=p["learning_rate"], weight_decay=p["weight_decay"],
                               dataset_num_workers=0, save_steps=None, num_epochs=1, enable_model_cpu_offload=False,
                               enable_optimizer_cpu_offload=False, cpu_offload_split_threshold=None,
                               customized_optimizer=None, output_path=os.path.join(p["output"], tag))
        try:
            runner.launch_training_task(accelerate.Accelerator(cpu=True), dataset_fn(p, repeat=p["steps"]), module,
                                        ModelLogger(args.output_path, remove_prefix_in_ckpt="pipe.dit."), args=args)
        finally:
            torch.optim.lr_scheduler.ConstantLR, runner.get_optimizer_class = scheduler_class, optimizer_class
        prefix = "final." if tag == "base" else f"probe.{tag}."
        for name, param in pipe.dit.named_parameters():
            if ".lora_" in name:
                out[prefix + name] = param.detach().float().clone()
        return record["losses"]

    losses = run("base", p["warmup"])
    probes = p.get("probes", [])
    if "tembed_bf16" in probes and p["family"] == "z_image":
        bf16 = run("tembed_bf16", p["warmup"], tembed_fp32=False)
        info["tembed_bf16"] = {"losses_first_last": [bf16[0], bf16[-1]],
                               "loss_rel_step1": abs(bf16[0] - losses[0]) / abs(losses[0])}
    if "unfused_ref" in probes:  # the reference with difftune's AdamW (fused) instead of its default (for-loop)
        fused = run("fused_adamw", p["warmup"], optimizer={"fused": True})
        info["fused_adamw"] = {"losses_first_last": [fused[0], fused[-1]]}
    save_file({k: v.contiguous() for k, v in out.items()}, p["result"])
    return {"losses": losses, "probes": info}


def main() -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    p = json.loads(sys.argv[1])
    torch.manual_seed(0)
    result = step(p) if p["mode"] == "step" else replay(p)
    print(RESULT_MARK + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
