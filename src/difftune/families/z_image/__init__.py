"""The Z-Image family (Z-Image, Z-Image-Turbo, Z-Image-Omni-Base, the Turbo Fun ControlNets): its spec, found by the
family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import SWITCH, option
from ...models.load import load_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES, original_dit_keys
from .pipeline import ZImagePipeline
from .trajectory import TRAJECTORY_IMITATION

GROUP = "Z-Image"


def _npu_found() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class ZImageOptions:
    tokenizer_path: str | None = option(None, "Tokenizer directory or model_id:folder/ (default: tokenizer/ beside "
                                        "the text encoder, else Tongyi-MAI/Z-Image-Turbo:tokenizer/).", group=GROUP,
                                        sample=True)
    enable_npu_patch: bool = option(False, "The reference's fused RMSNorm / RoPE kernels for Ascend NPUs: accepted, "
                                    "changes nothing (difftune has no NPU kernels).", kind=SWITCH, group=GROUP)
    # difftune sample's inputs
    edit_image: list | None = option(None, "Omni-Base: an image to edit; repeat it for several.", repeat=True,
                                     load="RGB", group=GROUP, sample=True, train=False)
    controlnet_image: str | None = option(None, "Fun ControlNet: the control image.", load="RGB", group=GROUP,
                                          sample=True, train=False)
    controlnet_inpaint_mask: str | None = option(None, "Fun ControlNet: where to paint (white), with "
                                                 "--controlnet_inpaint_image.", load="RGB", group=GROUP, sample=True,
                                                 train=False)
    controlnet_inpaint_image: str | None = option(None, "Fun ControlNet: the image to paint into.", load="RGB",
                                                  group=GROUP, sample=True, train=False)
    controlnet_scale: float | None = option(None, "Fun ControlNet: the strength of its hints (default 1).",
                                            kind=float, group=GROUP, sample=True, train=False)
    control_compat: str | None = option(None, "Fun ControlNet: 'reference' (default: the reference's and the "
                                        "model authors' forward) or 'diffusers' (as ZImageControlNetPipeline).",
                                        choices=("reference", "diffusers"), group=GROUP, sample=True, train=False)

    def notes(self) -> list[str]:
        if not self.enable_npu_patch:
            return []
        where = "an NPU is present, but" if _npu_found() else "no NPU here, and"
        return [f"--enable_npu_patch: {where} difftune has no fused NPU kernels: the run is the same without it"]

    def call_inputs(self, images: dict) -> dict:
        """`difftune sample`'s inputs as pipeline arguments (`images`: the image flags, loaded)."""
        out = {k: v for k, v in images.items() if v is not None}
        if out.get("edit_image") is not None and len(out["edit_image"]) == 1:
            out["edit_image"] = out["edit_image"][0]
        for name in ("controlnet_scale", "control_compat"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


FAMILY = FamilySpec(
    name="z_image",
    pipeline=ZImagePipeline,
    components=COMPONENTS,
    tokenizers=(
        # the reference's default when a command names none: Z-Image-Turbo's tokenizer/
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path", default="Tongyi-MAI/Z-Image-Turbo:tokenizer/"),
    ),
    lora_prefixes={"dit": "transformer", "text_encoder": "text_encoder", "controlnet": "controlnet"},
    lora_target_modules=LORA_TARGET_MODULES,
    # --lora_format comfyui writes diffusers' module names behind diffusion_model.: ComfyUI maps them onto its fused
    # qkv itself (comfy/lora.py's Lumina2 branch, comfy/utils.py z_image_to_diffusers), so no renaming is needed.
    lora_native_names=None,
    # the default file: diffusion_model.<module> + .alpha, which diffusers, ComfyUI and the reference's loader all read
    # (diffusers' layout under transformer. is not read by the reference's loader)
    lora_default_format="comfyui",
    full_native_keys={"dit": original_dit_keys},
    options=ZImageOptions,
    losses={"trajectory_imitation": TRAJECTORY_IMITATION},
    description="Z-Image, Z-Image-Turbo, Z-Image-Omni-Base, Turbo Fun ControlNets (diffusers ZImageTransformer2DModel, "
                "Qwen3, FLUX.1 AE, SigLIP2)",
)

__all__ = ["FAMILY", "ZImagePipeline"]
