"""Qwen-Image In-Context control (DiffSynth-Studio's Qwen-Image-In-Context-Control-Union LoRA): a control image
(canny, depth, pose, ...) is VAE-encoded at the output size and its tokens follow the noisy image's tokens in the
DiT's image sequence, with their own RoPE frame index; the prediction is read from the noisy tokens only."""

from __future__ import annotations

import torch

from ...core.features import RAW, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...media.image import as_image_list, images_to_tensor
from .encoding import vae_encode
from .feature import loaded, per_prompt


class QwenImageContextImageEmbedder(PipelineUnit):
    """`context_image` -> `context_latents` (B, 16, h, w), resized to the output's height and width."""

    inputs = ("context_image", "height", "width")
    outputs = ("context_latents",)
    models = ("vae",)
    feature = "context"
    before = ("QwenImagePromptEmbedder",)  # the family encodes prompts after every image
    skip_without = ("context_image",)

    def process(self, pipe, context_image, height, width):
        return {"context_latents": self.encode(pipe, as_image_list(context_image), height, width)}

    @staticmethod
    def encode(pipe, images, height, width) -> torch.Tensor:
        return vae_encode(pipe, images_to_tensor(images, height, width))


class _Context(Feature):
    def row_values(self, pipe, data, values):
        return {"context_image": loaded(data.get("context_image"))}

    def call_values(self, given, values):
        return {"context_image": per_prompt(given.get("context_image"), values["batch_size"])}, {}

    def signature(self, sample):
        return ()  # resized to the output's size: control images of any size share a stage-1 batch

    def denoise(self, pipe, call):
        """The control image's tokens right after the noisy image's (before any edit image's, as the reference)."""
        call.conditions.append(call.values["context_latents"])


CONTEXT = _Context("context", columns=("context_image",), model_fn_inputs=("context_latents",),
                   units=(QwenImageContextImageEmbedder(),), inputs={"context_image": RAW},
                   call_inputs={"context_image": None},
                   flags={"context_image": sample_input("In-Context control: the control image.", load="RGB")},
                   description="In-Context control: a control image's tokens beside the image's")
