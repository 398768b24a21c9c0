"""Insert-Anything (FLUX.1 Fill + Redux): insert the object of a reference image into a source image's masked region.

As the reference's `FluxImageUnit_InsertAnything` (which uses OpenCV; this is the same geometry in numpy and PIL):

* the reference object is cut out by its mask's bounding box (outside the mask white), padded by 30 % and to a
  square; it becomes the Redux image and the diptych's left half;
* the source mask is dilated (a 7 x 7 square, twice), its bounding box grown (more for small boxes) and then
  doubled into a square crop of the source, padded to a square; that crop is the diptych's right half;
* both halves are resized to 768 x 768: the diptych (1536 x 768) is the Fill image, the Fill mask is the source
  mask's crop on the right half (the left half is kept);
* in training the diptych itself is the target (the source image already shows the object); after sampling, the
  right half is resized back and pasted into the source image (`paste_back`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageFilter

from ...core.features import IMAGE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from .fill import IMAGE_COLUMN as FILL_IMAGE, MASK_COLUMN as FILL_MASK
from .redux import COLUMN as REDUX_IMAGE

SIZE = 768  # each half of the diptych, as the reference


@dataclass
class Crop:
    """What pasting a sampled diptych back into the source needs."""

    source: np.ndarray  # the source image (H, W, 3) uint8
    box: tuple[int, int, int, int]  # y1, y2, x1, x2 of the square crop in the source
    crop_size: tuple[int, int]  # the crop's (height, width) before padding
    square: int  # its side after padding


def _binary(mask: Image.Image) -> np.ndarray:
    return (np.asarray(mask.convert("L")) > 128).astype(np.uint8)


def _bbox(mask: np.ndarray) -> tuple[int, int, int, int]:
    """y1, y2, x1, x2 (inclusive ends) of the mask's pixels; the whole image for an (almost) empty mask."""
    h, w = mask.shape
    if mask.sum() < 10:
        return 0, h, 0, w
    rows, cols = np.flatnonzero(mask.any(axis=1)), np.flatnonzero(mask.any(axis=0))
    return int(rows[0]), int(rows[-1]), int(cols[0]), int(cols[-1])


def _grow(shape, box) -> tuple[int, int, int, int]:
    """The box scaled about its centre so that it covers a share r' of the image: r' = 0.1 + 1.5 r below r = 0.6
    (small objects get more context), the whole image above; clipped to the image."""
    y1, y2, x1, x2 = box
    h_img, w_img = shape[:2]
    share = (y2 - y1 + 1) * (x2 - x1 + 1) / (h_img * w_img)
    target = 0.1 + (1 - 0.1) / 0.6 * share if share < 0.6 else 1.0
    ratio = math.sqrt(target / share)
    yc, xc = 0.5 * (y1 + y2), 0.5 * (x1 + x2)
    h, w = ratio * (y2 - y1 + 1), ratio * (x2 - x1 + 1)
    return (max(0, int(yc - h * 0.5)), min(h_img, int(yc + h * 0.5)),
            max(0, int(xc - w * 0.5)), min(w_img, int(xc + w * 0.5)))


def _square_box(shape, box) -> tuple[int, int, int, int]:
    """The box widened along its shorter side to a square about its centre, clipped to the image."""
    h_img, w_img = shape[:2]
    y1, y2, x1, x2 = box
    cy, cx = (y1 + y2) // 2, (x1 + x2) // 2
    h, w = y2 - y1, x2 - x1
    if h >= w:
        x1, x2 = cx - h // 2, cx + h // 2
    else:
        y1, y2 = cy - w // 2, cy + w // 2
    return max(0, y1), min(h_img, y2), max(0, x1), min(w_img, x2)


def _pad_square(a: np.ndarray, value: int) -> np.ndarray:
    """Centred padding of the shorter side to a square (the extra pixel after)."""
    h, w = a.shape[:2]
    if h == w:
        return a
    before = abs(h - w) // 2
    after = abs(h - w) - before
    pad = [(0, 0), (before, after)] if h > w else [(before, after), (0, 0)]
    return np.pad(a, pad + [(0, 0)] * (a.ndim - 2), constant_values=value)


def _pad_around(a: np.ndarray, ratio: float, value: int) -> np.ndarray:
    h, w = a.shape[:2]
    dh, dw = int(h * ratio) - h, int(w * ratio) - w
    pad = [(dh // 2, dh - dh // 2), (dw // 2, dw - dw // 2)] + [(0, 0)] * (a.ndim - 2)
    return np.pad(a, pad, constant_values=value)


def _resize(a: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(width, height), bilinear (OpenCV's default interpolation)."""
    return np.asarray(Image.fromarray(a).resize(size, Image.BILINEAR))


def _dilate(mask: np.ndarray, size: int = 7, times: int = 2) -> np.ndarray:
    image = Image.fromarray(mask * 255)
    for _ in range(times):
        image = image.filter(ImageFilter.MaxFilter(size))
    return (np.asarray(image) > 127).astype(np.uint8)


def prepare(source_image: Image.Image, source_mask: Image.Image, ref_image: Image.Image, ref_mask: Image.Image,
            size: int = SIZE) -> tuple[dict, Crop]:
    """The Fill and Redux inputs of one insertion (their image, mask and image columns, height, width) and what
    `paste_back` needs."""
    ref = np.asarray(ref_image.convert("RGB"))
    source = np.asarray(source_image.convert("RGB"))
    ref_m = _binary(ref_mask)
    if ref_m.shape != ref.shape[:2]:
        raise UserError(f"insert_anything_ref_mask: {ref_m.shape[1]}x{ref_m.shape[0]} pixels, the reference image "
                        f"{ref.shape[1]}x{ref.shape[0]}: they must have one size")
    src_m = _resize(_binary(source_mask), (source.shape[1], source.shape[0]))
    # the reference object, white around it, with a margin, on a square
    y1, y2, x1, x2 = _bbox(ref_m)
    keep = ref_m[..., None]
    obj = (ref * keep + 255 * (1 - keep)).astype(np.uint8)[y1:y2, x1:x2]
    obj = _pad_square(_pad_around(obj, 1.3, 255), 255)
    # the source's region, with context, on a square
    src_m = _dilate(src_m)
    box = _square_box(source.shape, _grow(source.shape, _grow(src_m.shape, _bbox(src_m))))  # grown twice, as the reference
    y1, y2, x1, x2 = box
    crop, crop_m = source[y1:y2, x1:x2], src_m[y1:y2, x1:x2]
    crop_m = _resize(_pad_square(crop_m, 0), (size, size))
    square = _pad_square(crop, 255)
    left = _resize(obj, (size, size))
    right = _resize(square, (size, size))
    diptych = np.concatenate([left, right], axis=1)
    mask = np.concatenate([np.zeros_like(crop_m), crop_m], axis=1)
    mask = np.repeat((mask > 0).astype(np.uint8)[..., None] * 255, 3, axis=-1)
    inputs = {FILL_IMAGE: Image.fromarray(diptych), FILL_MASK: Image.fromarray(mask),
              REDUX_IMAGE: Image.fromarray(left), "height": size, "width": 2 * size}
    return inputs, Crop(source.copy(), box, crop.shape[:2], square.shape[0])


def paste_back(image: Image.Image, crop: Crop, margin: int = 2) -> Image.Image:
    """The sampled diptych's right half, resized to the crop's padded square, unpadded and pasted into the source
    (a `margin` of pixels at the crop's border left as they were)."""
    w, h = image.size
    pred = np.asarray(image.crop((w // 2, 0, w, h)).convert("RGB").resize((crop.square, crop.square), Image.BILINEAR))
    ch, cw = crop.crop_size
    if ch != cw:  # remove the padding that made the crop square
        pad = crop.square - min(ch, cw)
        before = pad // 2
        pred = pred[:, before:before + cw] if ch > cw else pred[before:before + ch]
    out = crop.source.copy()
    y1, y2, x1, x2 = crop.box
    m = margin
    out[y1 + m:y2 - m, x1 + m:x2 - m] = pred[m:pred.shape[0] - m, m:pred.shape[1] - m]
    return Image.fromarray(out)


def _per_sample(value, n: int, name: str) -> list:
    items = value if isinstance(value, list) else [value]
    if len(items) == 1:
        return items * n
    if len(items) != n:
        raise UserError(f"{name}: {len(items)} images for {n} sample(s)")
    return items


class FluxInsertAnything(PipelineUnit):
    """The four Insert-Anything images -> the Fill image and mask (a 1536 x 768 diptych; `--insert_anything_size`
    sets the side of a half), the Redux image, the size;
    in training the diptych is also the target (`input_image`). The Fill and Redux units then do the rest."""

    feature = "insert_anything"
    before = ("FluxShapeChecker",)  # it gives the size
    inputs = ("insert_anything_source_image", "insert_anything_source_mask", "insert_anything_ref_image",
              "insert_anything_ref_mask", "insert_anything_size", "batch_size")
    outputs = (FILL_IMAGE, FILL_MASK, REDUX_IMAGE, "height", "width", "input_image")

    def process(self, pipe, insert_anything_source_image, insert_anything_source_mask, insert_anything_ref_image,
                insert_anything_ref_mask, insert_anything_size, batch_size):
        given = {"insert_anything_source_image": insert_anything_source_image,
                 "insert_anything_source_mask": insert_anything_source_mask,
                 "insert_anything_ref_image": insert_anything_ref_image,
                 "insert_anything_ref_mask": insert_anything_ref_mask}
        if all(v is None for v in given.values()):
            return {}
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise UserError(f"Insert-Anything needs all four of {', '.join(given)}; {', '.join(missing)} missing")
        n = int(batch_size or 1)
        size = SIZE if insert_anything_size is None else int(insert_anything_size)
        parts = [prepare(*images, size=size)[0] for images in zip(*(_per_sample(v, n, k) for k, v in given.items()))]
        out = {k: [p[k] for p in parts] if n > 1 else parts[0][k]
               for k in (FILL_IMAGE, FILL_MASK, REDUX_IMAGE)}
        out.update(height=parts[0]["height"], width=parts[0]["width"])
        if pipe.scheduler.training:  # the diptych is what the model learns to produce
            out["input_image"] = out[FILL_IMAGE]
        return out



INPUTS = ("insert_anything_source_image", "insert_anything_source_mask", "insert_anything_ref_image",
          "insert_anything_ref_mask")


class _InsertAnything(Feature):
    unit_settings = ("insert_anything_size",)

    def prepare_call(self, pipe, values, cfg_scale, state):
        """The diptych made here (Fill's and Redux's inputs and the size), its half pasted back after sampling."""
        parts = [values.pop(name, None) for name in INPUTS]
        size = values.pop("insert_anything_size", None)
        if parts[0] is None:
            return
        if any(p is None for p in parts):
            raise UserError("Insert-Anything needs insert_anything_source_image, _source_mask, _ref_image and "
                            "_ref_mask")
        inputs, state["insert_anything_crop"] = prepare(*parts, size=SIZE if size is None else size)
        values.update(inputs)

    def finish_output(self, images, output_type, state):
        crop = state.get("insert_anything_crop")
        if crop is None or output_type != "pil":
            return images
        return [paste_back(image, crop) for image in images]


INSERT_ANYTHING = _InsertAnything(
    "insert_anything", columns=INPUTS[:1], requires=("fill", "redux"), data_inputs=INPUTS,
    units=(FluxInsertAnything(),), inputs=dict.fromkeys(INPUTS, IMAGE),
    call_inputs={**dict.fromkeys(INPUTS), "insert_anything_size": None},
    flags={INPUTS[0]: sample_input("Insert-Anything: the image to insert into.", load="RGB"),
           INPUTS[1]: sample_input("Insert-Anything: where to insert (light).", load="RGB"),
           INPUTS[2]: sample_input("Insert-Anything: the image of the object.", load="RGB"),
           INPUTS[3]: sample_input("Insert-Anything: the object in its image (light).", load="RGB")},
    description="Insert-Anything: a reference object inserted by Fill + Redux on a diptych")

__all__ = ["INSERT_ANYTHING", "Crop", "FluxInsertAnything", "SIZE", "paste_back", "prepare"]
