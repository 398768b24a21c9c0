"""EliGen (entity-level control): each entity is a prompt and a mask image. What its families share: the entity
prompts and masks of each sample, checked one prompt per mask; each entity's 2x2 patch tokens; and which
[text, image] tokens may attend to which (regional attention), from text segments and the image tokens each covers.
Each family lays its text segments out its own way and hands the result to `segment_attention_mask`.

A text token attends to its own segment's text tokens and to the image tokens of its segment's region; an image
token attends to every image token and to the text tokens of every segment whose region holds it. Invalid text
tokens (padding) attend only to themselves and are seen by none.
"""

from __future__ import annotations

import torch
from PIL import Image

from ..errors import UserError
from ..media.image import as_image_list
from ..media.masks import mask_values


def _per_sample(value, n: int, what: str) -> list:
    """A sample's value, or a stage-1 batch's list of them, as one list per sample."""
    if n == 1 and (isinstance(value, (str, Image.Image)) or (isinstance(value, list) and value and
                                                              not isinstance(value[0], list))):
        return [value]
    if not isinstance(value, list) or len(value) != n:
        raise UserError(f"{what}: expected a list per sample")
    return value


def entity_samples(prompts, masks, n: int, prompts_name: str, masks_name: str) -> list[tuple[list, list]]:
    """(entity prompts, entity mask images) of each of `n` samples, one prompt (text) per mask; `prompts_name` and
    `masks_name` are the family's columns, named in errors."""
    if masks is None:
        raise UserError(f"{prompts_name} are given without {masks_name}")
    out = []
    for p, m in zip(_per_sample(prompts, n, prompts_name), _per_sample(masks, n, masks_name)):
        p, m = ([p] if isinstance(p, str) else list(p)), as_image_list(m)
        if not p or len(p) != len(m) or not all(isinstance(x, str) for x in p):
            raise UserError(f"EliGen needs one entity prompt (text) per entity mask, got {len(p)} prompt(s) and "
                            f"{len(m)} mask(s)")
        out.append((p, m))
    return out


def entity_token_masks(masks, height: int, width: int, vae_scale: int, patch: int = 2) -> torch.Tensor:
    """Entity mask images -> (N, (h/patch) * (w/patch)) float token masks in the DiT's row-major token order (1: the
    token is inside the entity). A mask is taken at latent resolution (nearest), a pixel counting where its
    colour channels average above mid-grey; a patch token is inside when any of its latent pixels is."""
    out = []
    h, w = height // vae_scale, width // vae_scale
    for mask in masks:
        inside = mask_values(mask, (w, h), resample=Image.NEAREST) > 0
        out.append(inside.view(h // patch, patch, w // patch, patch).any(dim=3).any(dim=1).flatten())
    return torch.stack(out).float()


def segment_attention_mask(valid: torch.Tensor, segment: torch.Tensor, regions: torch.Tensor,
                           image_len: int | None = None) -> torch.Tensor:
    """(B, 1, S + I, S + I) bool (True: may attend) over [text (S), image (I)].

    `valid` (B, S) bool: real text tokens; `segment` (S,) long: each text position's segment; `regions`
    (B, segments, T) bool: the image tokens each segment covers. `image_len` (default T) may be a multiple of T:
    further images of the output's size (context / edit images) repeat the region."""
    b, s = valid.shape
    t = regions.shape[-1]
    image_len = t if image_len is None else image_len
    if image_len % t:
        raise ValueError(f"{image_len} image tokens are not a multiple of the regions' {t}")
    regions = regions.bool()
    region = regions.repeat(1, 1, image_len // t)[torch.arange(b)[:, None], segment[None, :].expand(b, s)]  # (B,S,I)
    txt_txt = (segment[:, None] == segment[None, :])[None] & valid[:, None, :] & valid[:, :, None]
    txt_img = region & valid[:, :, None]
    img_txt = region.transpose(1, 2) & valid[:, None, :]
    img_img = torch.ones(b, image_len, image_len, dtype=torch.bool, device=valid.device)
    mask = torch.cat([torch.cat([txt_txt, txt_img], 2), torch.cat([img_txt, img_img], 2)], 1)
    mask |= torch.eye(s + image_len, dtype=torch.bool, device=valid.device)  # padding rows attend to themselves
    return mask[:, None]


__all__ = ["entity_samples", "entity_token_masks", "segment_attention_mask"]
