"""ERNIE-Image's prompt through Ministral-3: the second-to-last hidden states of the prompt's tokens (<s> and the
text, no chat template, no padding), each prompt encoded alone as diffusers' `ErnieImagePipeline.encode_prompt` and
the reference's prompt embedder do. An empty prompt is the <s> token alone."""

from __future__ import annotations

import torch

from ...core.batch import Pad
from ...core.units import PipelineUnit
from ...errors import UserError


def encode_prompt(pipe, prompt: str) -> torch.Tensor:
    """One prompt -> (tokens, hidden) second-to-last hidden states."""
    if pipe.tokenizer is None:
        raise UserError("no tokenizer: pass --tokenizer_path (the model's tokenizer/ folder) to encode prompts")
    ids = pipe.tokenizer(prompt, add_special_tokens=True, truncation=True, padding=False)["input_ids"]
    if not ids:
        bos = pipe.tokenizer.bos_token_id
        ids = [bos if bos is not None else 0]
    ids = torch.tensor([ids], device=pipe.device)
    return pipe.text_encoder(input_ids=ids, output_hidden_states=True).hidden_states[-2][0]


def padded(rows: list[torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    """Rows of different lengths -> (B, L, D) zero-padded and the (B, L) mask of real tokens."""
    length = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, length - r.shape[0])) for r in rows])
    mask = torch.stack([torch.arange(length, device=embeds.device) < r.shape[0] for r in rows]).long()
    return {"prompt_embeds": embeds.to(dtype), "prompt_embeds_mask": mask}


def _prompts(prompt) -> list[str]:
    return [prompt] if isinstance(prompt, str) else ["" if p is None else str(p) for p in prompt]


class ErnieImagePromptEmbedder(PipelineUnit):
    """The prompt (and the negative prompt) through Ministral-3."""

    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds"),
                   "prompt_embeds_mask": ("prompt_embeds_mask", "negative_prompt_embeds_mask")}
    models = ("text_encoder",)
    batching = {"prompt_embeds": Pad("prompt_embeds_mask")}

    def process(self, pipe, prompt):
        if prompt is None:
            return {}
        return padded([encode_prompt(pipe, p) for p in _prompts(prompt)], pipe.torch_dtype)
