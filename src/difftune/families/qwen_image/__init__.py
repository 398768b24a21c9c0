"""The Qwen-Image family (text-to-image, Qwen-Image-Edit and Edit-Plus, In-Context control, Blockwise ControlNet,
EliGen; Qwen-Image-Layered as its own pipeline class): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import BOOL, SWITCH, option
from ...models.load import load_tokenizer
from ...parts.qwen_vl import load_processor
from .components import DIT, LORA_TARGET_MODULES, TEXT_ENCODER, VAE
from .controlnet import BLOCKWISE_CONTROLNET, ControlNetInput
from .layered import QwenImageLayeredPipeline
from .pipeline import QwenImagePipeline

GROUP = "Qwen-Image"


@dataclass(frozen=True)
class QwenImageOptions:
    tokenizer_path: str | None = option(None, "Tokenizer directory or model_id:folder/ (default: tokenizer/ beside "
                                        "the text encoder).", group=GROUP, sample=True)
    processor_path: str | None = option(None, "Image processor directory (Qwen-Image-Edit; default: processor/ "
                                        "beside the text encoder, else Qwen/Qwen-Image-Edit:processor/).",
                                        group=GROUP, sample=True)
    zero_cond_t: bool = option(False, "Qwen-Image-Edit-2511: the edit images' tokens are modulated at t=0 (on "
                               "anyway when the transformer's config.json says so).", kind=SWITCH, group=GROUP)
    edit_image_auto_resize: bool = option(True, "Qwen-Image-Edit: resize edit images to about 1 MP (default true, "
                                          "as the reference).", kind=BOOL, group=GROUP)
    # difftune sample's inputs
    edit_image: list | None = option(None, "Qwen-Image-Edit: the image to edit; repeat it for several "
                                     "(Edit-2509/2511: the multi-image template).", repeat=True, load="RGB",
                                     group=GROUP, sample=True, train=False)
    edit_plus: bool = option(False, "The multi-image template (Edit-2509/2511) even for one --edit_image.",
                             kind=SWITCH, group=GROUP, sample=True, train=False)
    context_image: str | None = option(None, "In-Context control: the control image.", load="RGB", group=GROUP,
                                       sample=True, train=False)
    layer_input_image: str | None = option(None, "Qwen-Image-Layered: the image to take apart (RGBA).", load="RGBA",
                                           group=GROUP, sample=True, train=False)
    layer_num: int | None = option(None, "Qwen-Image-Layered: layers besides the first (writes NAME-layer<k>.png "
                                   "per layer).", kind=int, group=GROUP, sample=True, train=False)

    def call_inputs(self, images: dict) -> dict:
        """`difftune sample`'s inputs as pipeline arguments (`images`: the image flags, loaded)."""
        from ...errors import UserError

        if self.edit_plus and not images.get("edit_image"):
            raise UserError("--edit_plus: it needs --edit_image")
        out = {k: v for k, v in images.items() if v is not None}
        edit = images.get("edit_image")
        if edit:  # a list means Edit-Plus
            out["edit_image"] = edit if len(edit) > 1 or self.edit_plus else edit[0]
        if self.layer_num is not None:
            out["layer_num"] = self.layer_num
        if self.zero_cond_t:
            out["zero_cond_t"] = True
        return out


FAMILY = FamilySpec(
    name="qwen_image",
    pipeline=QwenImagePipeline,
    variants=(QwenImageLayeredPipeline,),
    components=(DIT, TEXT_ENCODER, VAE, BLOCKWISE_CONTROLNET),
    tokenizers=(
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path"),
        # Qwen-Image-Edit's processor: a processor/ folder beside the text encoder, else (for edit data) the
        # reference's default, Qwen/Qwen-Image-Edit:processor/ (Qwen/Qwen-Image has none).
        TokenizerSpec(attr="processor", slot="text_encoder", folder="processor", load=load_processor,
                      flag="processor_path", default="Qwen/Qwen-Image-Edit:processor/", required=False,
                      feature="edit"),
    ),
    lora_prefixes={"dit": "transformer", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    # diffusion_model.<module> + .alpha: diffusers, ComfyUI and DiffSynth-Studio all read it (docs/lora_files.md)
    lora_default_format="comfyui",
    options=QwenImageOptions,
    unit_settings=lambda options: {"edit_image_auto_resize": bool(options.edit_image_auto_resize),
                                   "zero_cond_t": bool(options.zero_cond_t)},
    description="Qwen-Image, Qwen-Image-Edit (diffusers QwenImageTransformer2DModel, Qwen2.5-VL, Qwen-Image VAE)",
)

__all__ = ["FAMILY", "ControlNetInput", "QwenImageLayeredPipeline", "QwenImagePipeline"]
