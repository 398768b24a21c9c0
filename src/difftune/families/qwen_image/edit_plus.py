"""Qwen-Image-Edit-2509 / -2511 (and FireRed-Image-Edit): several edit images per prompt, as diffusers'
`QwenImageEditPlusPipeline` does it ("Edit-Plus").

Which template a sample gets follows the reference: the type of its `edit_image`. One image (a csv cell, a JSON
string) is Qwen-Image-Edit: the image inside the user turn, shown to the VL encoder at its VAE size. A list of
images (a JSON list in the metadata, even of one file; a list passed to the pipeline) is Edit-Plus: a
"Picture i: <image>" prefix per image before the prompt, each image shown to the VL encoder at about 384x384
pixels, and each VAE-encoded at its own size (about 1 MP with `edit_image_auto_resize`) and given to the
transformer as its own entry of `img_shapes`. The model does not decide: the same weights take either form.

Values: `edit_image` for Edit-Plus is one list of images per sample (a batch: a list of those lists), and
`edit_latents` one list of (16, h, w) latents per sample (batched as a list; `edit_latent_batches` turns it into
one (B, 16, h, w) tensor per image for the transformer).
"""

from __future__ import annotations

import torch
from PIL import Image

from ...core.batch import LIST
from ...core.features import RAW, Feature
from ...core.options import SWITCH, sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list, images_to_tensor
from .encoding import EDIT_IMAGE_AREA, EDIT_PROMPT_TEMPLATE, edit_image_size, vae_encode
from .feature import sizes
from .prompt import QwenImagePromptEmbedder, encode

CONDITION_IMAGE_AREA = 384 * 384  # what the VL encoder sees of each image
VAE_IMAGE_AREA = EDIT_IMAGE_AREA  # what the transformer sees of each, with edit_image_auto_resize
IMAGE_PAD = "<|image_pad|>"
PICTURE_TEMPLATE = "Picture {}: <|vision_start|>" + IMAGE_PAD + "<|vision_end|>"
# Edit's system turn; the user turn holds the pictures and the prompt (so its drop count equals Edit's).
EDIT_PLUS_PROMPT_TEMPLATE = EDIT_PROMPT_TEMPLATE.replace("<|vision_start|>" + IMAGE_PAD + "<|vision_end|>{}", "{}")


def edit_groups(edit_image, batch_size: int | None) -> list[list[Image.Image]] | None:
    """The edit images of each sample of a batch if `edit_image` is the Edit-Plus form, else None.

    Forms: one image (Edit, shared by the batch); a list of images with a batch of one (Edit-Plus, the
    reference's form); a list of lists (Edit-Plus, one list per sample: a stage-1 batch); a list of images with a
    larger batch (Edit, one image per sample: a stage-1 batch of Edit samples)."""
    if edit_image is None or isinstance(edit_image, Image.Image):
        return None
    items = list(edit_image)
    batch_size = int(batch_size or 1)
    if items and all(isinstance(i, (list, tuple)) for i in items):
        groups = [list(i) for i in items]
    elif batch_size == 1:
        groups = [items]
    else:
        return None
    if len(groups) == 1 and batch_size > 1:
        groups = groups * batch_size
    if len(groups) != batch_size:
        raise UserError(f"edit_image: {len(groups)} lists of edit images for a batch of {batch_size} prompts")
    for g in groups:
        if not g or not all(isinstance(i, Image.Image) for i in g):
            found = next((type(i).__name__ for i in g if not isinstance(i, Image.Image)), "nothing")
            raise UserError(f"edit_image: each entry must be an image (a file named in --data_file_keys), got {found}")
    return groups


_noted: set[str] = set()


def loaded_edit_image(value):
    """A data row's `edit_image`, or None when it holds file names nobody loaded: like the reference, a column that
    --extra_inputs does not name is no input (Qwen-Image-Edit-2509-LoRA-NPU.sh trains so). Said once, not silent."""
    names = [value] if isinstance(value, str) else value if isinstance(value, list) else None
    if not names or not all(isinstance(n, str) for n in names):
        return value
    if "edit_image" not in _noted:
        _noted.add("edit_image")
        print("note: the metadata's 'edit_image' column is not used: its files were not loaded (the reference "
              "trains without it unless --extra_inputs names it; name it there to train editing)")
    return None


def per_prompt_edit_images(edit_image, prompts: int):
    """A pipeline call's `edit_image`: a list of images is Edit-Plus for every prompt (as the reference)."""
    if isinstance(edit_image, (list, tuple)) and not any(isinstance(i, (list, tuple)) for i in edit_image):
        return [list(edit_image)] * prompts
    return edit_image


def condition_image(image: Image.Image) -> Image.Image:
    """The image the VL encoder sees: same aspect ratio, about CONDITION_IMAGE_AREA pixels, sides multiples of 32."""
    return image.resize(edit_image_size(*image.size, area=CONDITION_IMAGE_AREA), Image.LANCZOS)


def edit_plus_vl_inputs(pipe, prompts: list[str], groups: list[list[Image.Image]]):
    """Token and pixel inputs of Qwen2.5-VL for Edit-Plus prompts: each image's pad token expanded to its
    number of merged patches (what Qwen2VLProcessor does), images in the order of their pictures."""
    if pipe.processor is None:
        raise UserError("editing needs the image processor: pass --processor_path (the model's processor/ folder)")
    texts = [EDIT_PLUS_PROMPT_TEMPLATE.format("".join(PICTURE_TEMPLATE.format(i + 1) for i in range(len(g))) + p)
             for p, g in zip(prompts, groups)]
    vis = pipe.processor(images=[condition_image(img) for g in groups for img in g], return_tensors="pt")
    merge = getattr(pipe.processor, "merge_size", 2) ** 2
    counts = iter(int(n) for n in (vis["image_grid_thw"].prod(-1) // merge).tolist())
    expanded = []
    for text, g in zip(texts, groups):
        head, *rest = text.split(IMAGE_PAD)
        if len(rest) != len(g):
            raise UserError(f"prompt {text[-60:]!r}: the text itself holds {IMAGE_PAD}")
        expanded.append(head + "".join(IMAGE_PAD * next(counts) + tail for tail in rest))
    tokens = pipe.tokenizer(expanded, padding=True, return_tensors="pt")
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}, dict(vis)


def encode_edit_groups(pipe, groups: list[list[Image.Image]], auto_resize) -> list[list[torch.Tensor]]:
    """Each edit image VAE-encoded at its own size (about 1 MP unless `auto_resize` is False): per sample, a list
    of (16, h, w) latents."""
    out = []
    for group in groups:
        latents = []
        for img in group:
            img = img.convert("RGB")
            if auto_resize is not False:
                img = img.resize(edit_image_size(*img.size, area=VAE_IMAGE_AREA), Image.LANCZOS)
            latents.append(vae_encode(pipe, images_to_tensor([img]))[0])
        out.append(latents)
    return out


def edit_latent_batches(edit_latents, batch_size: int, like: torch.Tensor) -> list[torch.Tensor]:
    """`edit_latents` in any of its forms -> one (B, 16, h, w) tensor per edit image, on `like`'s device and dtype.

    Forms: a (B, 16, h, w) tensor (Edit); a list of such tensors, one per image; a list with one entry per
    sample, each a (16, h, w) tensor or a list of them (as batched and as cached)."""
    if edit_latents is None:
        return []
    if isinstance(edit_latents, torch.Tensor):
        per_image = [edit_latents]
    elif all(isinstance(e, torch.Tensor) and e.dim() == 4 for e in edit_latents):
        per_image = list(edit_latents)
    else:
        samples = [[e] if isinstance(e, torch.Tensor) else list(e) for e in edit_latents]
        if len(samples) == 1 and batch_size > 1:
            samples = samples * batch_size
        shapes = [[tuple(t.shape[-2:]) for t in s] for s in samples]
        odd = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
        if odd is not None:
            raise UserError(f"cannot batch 'edit_latents': sample 1 of the batch has edit images of latent sizes "
                            f"{shapes[0]} but sample {odd + 1} has {shapes[odd]}; samples of one batch need the same "
                            f"number and sizes of edit images (--batch_size 1 avoids it)")
        per_image = [torch.stack([s[j] for s in samples]) for j in range(len(samples[0]))]
    return [(e.expand(batch_size, *e.shape[1:]) if e.shape[0] == 1 < batch_size else e).to(like.device, like.dtype)
            for e in per_image]


# -- the feature: its units, values and part of the denoiser call ----------------------------------------

class QwenImageEditImageEmbedder(PipelineUnit):
    """Qwen-Image-Edit: resize the edit image to about 1 MP (unless told not to) and encode it."""

    inputs = ("edit_image", "edit_image_auto_resize", "batch_size")
    outputs = ("edit_image", "edit_latents")
    models = ("vae",)
    feature = "edit"
    before = ("QwenImagePromptEmbedder",)  # the family encodes prompts after every image
    batching = {"edit_latents": LIST}  # Edit-Plus: a list of latents per sample
    skip_without = ("edit_image",)

    def process(self, pipe, edit_image, edit_image_auto_resize, batch_size):
        groups = edit_groups(edit_image, batch_size)
        if groups is not None:  # Edit-Plus: each image at its own size; the originals stay for the prompt
            return {"edit_latents": encode_edit_groups(pipe, groups, edit_image_auto_resize)}
        images = as_image_list(edit_image)
        if edit_image_auto_resize is not False:
            w, h = edit_image_size(*images[0].size)
            images = [img.convert("RGB").resize((w, h), Image.LANCZOS) for img in images]
        latents = vae_encode(pipe, images_to_tensor(images))
        # one image stays one image: a list would read as Edit-Plus to the prompt
        return {"edit_image": images[0] if isinstance(edit_image, Image.Image) else images, "edit_latents": latents}


class QwenImageEditPromptEmbedder(QwenImagePromptEmbedder):
    """Qwen-Image-Edit: the prompt with the edit image(s) shown to Qwen2.5-VL. One image (the Edit template, inside
    the user turn) or a list of them per sample (Edit-Plus: "Picture i" per image), as the reference tells them
    apart: by the form of the value."""

    inputs = ("edit_image",)
    feature = "edit"
    replaces = ("QwenImagePromptEmbedder",)
    skip_without = ("prompt",)

    def process(self, pipe, prompt, edit_image):
        if edit_image is None:  # a call without an edit image: the plain template
            return super().process(pipe, prompt)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        groups = edit_groups(edit_image, len(prompts))
        if groups is not None:  # Edit-Plus: "Picture i" per image
            template = EDIT_PLUS_PROMPT_TEMPLATE
            tokens, extra = edit_plus_vl_inputs(pipe, prompts, groups)
        else:
            template = EDIT_PROMPT_TEMPLATE
            tokens, extra = pipe.vl_inputs([template.format(p) for p in prompts], as_image_list(edit_image))
        # Only text prompts are cut (as diffusers): an edit prompt's image tokens come first and often pass it.
        return encode(pipe, template, tokens, extra, limit=None)


class _Edit(Feature):
    def row_values(self, pipe, data, values):
        return {"edit_image": loaded_edit_image(data.get("edit_image"))}

    def call_values(self, given, values):
        return {"edit_image": per_prompt_edit_images(given.get("edit_image"), values["batch_size"]),
                "edit_image_auto_resize": given.get("edit_image_auto_resize", True)}, {}

    def sample_values(self, flags):
        """--edit_image given once is Qwen-Image-Edit's one image, unless --edit_plus; a list means Edit-Plus."""
        edit = flags.get("edit_image")
        if flags.get("edit_plus") and not edit:
            raise UserError("--edit_plus: it needs --edit_image")
        return {"edit_image": edit if len(edit) > 1 or flags.get("edit_plus") else edit[0]} if edit else {}

    def signature(self, sample):
        """A list (Edit-Plus) never shares a batch with one image (Edit), even of the same size."""
        return (sizes(loaded_edit_image(sample.get("edit_image"))),)

    def batch_values(self, values, samples):
        if samples == 1 and isinstance(values.get("edit_image"), list):
            values["edit_image"] = [values["edit_image"]]  # the sample axis, so one image's list stays a list

    def denoise(self, pipe, call):
        """Each edit image's tokens after the conditions', each its own entry of img_shapes."""
        call.references.extend(edit_latent_batches(call.values["edit_latents"], call.batch, call.tokens))


EDIT = _Edit("edit", columns=("edit_image",), model_fn_inputs=("edit_latents",),
             units=(QwenImageEditImageEmbedder(), QwenImageEditPromptEmbedder()), inputs={"edit_image": RAW},
             call_inputs={"edit_image": None, "edit_image_auto_resize": True},
             flags={"edit_image": sample_input("Qwen-Image-Edit: the image to edit; repeat it for several "
                                               "(Edit-2509/2511: the multi-image template).", repeat=True, load="RGB"),
                    "edit_plus": sample_input("The multi-image template (Edit-2509/2511) even for one --edit_image.",
                                              kind=SWITCH)},
             description="Qwen-Image-Edit / Edit-Plus: edit image(s) shown to the text encoder and the DiT")
