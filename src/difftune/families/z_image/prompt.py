"""Z-Image's prompt through Qwen3: the second-to-last hidden states of the prompt's real tokens (diffusers'
`_encode_prompt`, the reference's prompt embedder).

A plain prompt is one user turn of Qwen3's chat template. With Omni-Base edit images the text is cut into pieces
around each image's slot, each encoded on its own: only one piece holds the prompt (`ZImageEditPromptEmbedder`,
the prompt unit of the `edit` feature); the others are fixed texts that depend only on the number of images
(`ZImageEditTextEmbedder`, edit.py), so a new prompt (validation) is encoded alone and meets any sample's images.
"""

from __future__ import annotations

import torch

from ...core.common_units import PaddedPromptEmbedder
from ...errors import UserError

MAX_SEQUENCE_LENGTH = 512
USER, ASSISTANT, END = "<|im_start|>user\n", "<|im_start|>assistant\n", "<|im_end|>\n"
VISION_START, VISION_END = "<|vision_start|>", "<|vision_end|>"


def plain_text(prompt: str) -> str:
    """One user turn as Qwen3's chat template renders it with `enable_thinking=True` (what the reference asks)."""
    return f"{USER}{prompt}{END}{ASSISTANT}"


def edit_prompt_text(prompt: str) -> str:
    """Omni-Base with edit images: the piece that holds the prompt, after the last image's slot."""
    return f"{VISION_END}{prompt}{END}{ASSISTANT}{VISION_START}"


def edit_fixed_texts(num_images: int) -> list[str]:
    """Omni-Base's fixed pieces for `num_images` edit images: one before each image's slot, then the closing one
    (the prompt's piece goes between the last two)."""
    return ([f"{USER}{VISION_START}"] + [f"{VISION_END}{VISION_START}"] * (num_images - 1)
            + [f"{VISION_END}<|im_end|>"])


def encode_texts(pipe, texts: list[str]) -> list[torch.Tensor]:
    """Each text's second-to-last hidden states over its real tokens (padded to 512 tokens, as diffusers)."""
    if pipe.tokenizer is None:
        raise UserError("no tokenizer: pass --tokenizer_path (the model's tokenizer/ folder) to encode prompts")
    tokens = pipe.tokenizer(texts, padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                            return_tensors="pt")
    ids = tokens.input_ids.to(pipe.device)
    mask = tokens.attention_mask.to(pipe.device).bool()
    # The backbone alone (a causal LM's head is never read).
    encoder = getattr(pipe.text_encoder, "model", pipe.text_encoder)
    hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    return [h[m] for h, m in zip(hidden, mask)]


class ZImagePromptEmbedder(PaddedPromptEmbedder):
    """The prompt through Qwen3 (one user turn of its chat template)."""

    template = staticmethod(plain_text)

    def rows(self, pipe, prompts):
        return encode_texts(pipe, [type(self).template(p) for p in prompts])


class ZImageEditPromptEmbedder(ZImagePromptEmbedder):
    """Omni-Base with edit images: the prompt's own piece (after the images' slots)."""

    feature = "edit"
    replaces = ("ZImagePromptEmbedder",)
    template = staticmethod(edit_prompt_text)
