"""Regional attention (EliGen): which [text, image] tokens may attend to which, from text segments and the image
tokens each segment covers. Family-free: FLUX and Qwen-Image lay their text segments out differently, and both
hand this the result.

A text token attends to its own segment's text tokens and to the image tokens of its segment's region; an image
token attends to every image token and to the text tokens of every segment whose region holds it. Invalid text
tokens (padding) attend only to themselves and are seen by none.
"""

from __future__ import annotations

import torch


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


__all__ = ["segment_attention_mask"]
