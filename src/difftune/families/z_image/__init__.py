"""The Z-Image family (Z-Image, Z-Image-Turbo, Z-Image-Omni-Base, the Turbo Fun ControlNets): its spec, found by the
family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, text_tokenizer
from ...core.options import SWITCH, option
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
    enable_npu_patch: bool = option(False, "The reference's fused RMSNorm / RoPE kernels for Ascend NPUs: accepted, "
                                    "changes nothing (difftune has no NPU kernels).", kind=SWITCH, group=GROUP)

    def notes(self) -> list[str]:
        if not self.enable_npu_patch:
            return []
        where = "an NPU is present, but" if _npu_found() else "no NPU here, and"
        return [f"--enable_npu_patch: {where} difftune has no fused NPU kernels: the run is the same without it"]


FAMILY = FamilySpec(
    name="z_image",
    pipeline=ZImagePipeline,
    components=COMPONENTS,
    # the reference's default when a command names none: Z-Image-Turbo's tokenizer/
    tokenizers=(text_tokenizer("tokenizer_path", "Tongyi-MAI/Z-Image-Turbo:tokenizer/"),),
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
