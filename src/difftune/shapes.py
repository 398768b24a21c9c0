"""Procedural captioned images: flat coloured shapes on coloured backgrounds, e.g. "a red circle on a blue
background". The bundled tiny base model is trained on these (`scripts/make_base_model.py`) and the demo
fine-tunes it on a shape it never saw (a star) and measures the result against rendered references.

Everything is drawn with PIL at 4x and downsampled (anti-aliased edges), from a `random.Random`, so a
seed gives the same images on every machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

COLORS = {
    "red": (220, 40, 40), "green": (40, 170, 70), "blue": (40, 70, 220), "yellow": (240, 215, 40),
    "white": (245, 245, 245), "black": (25, 25, 25),
}
BASE_SHAPES = ("circle", "square", "triangle")
SIZE = 64
_SS = 4  # supersampling factor


@dataclass(frozen=True)
class ShapeSpec:
    shape: str
    color: str
    background: str
    cx: float = SIZE / 2
    cy: float = SIZE / 2
    radius: float = 18.0

    @property
    def prompt(self) -> str:
        return f"a {self.color} {self.shape} on a {self.background} background"


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]] | None:
    """Vertices of `shape` centred at (cx, cy) with circumradius-like size `r`; None for a circle."""
    if shape == "circle":
        return None
    if shape == "square":
        h = r * 0.85
        return [(cx - h, cy - h), (cx + h, cy - h), (cx + h, cy + h), (cx - h, cy + h)]
    if shape == "triangle":  # upright, centroid at the centre
        r *= 1.2  # about the area of the other shapes at the same r
        return [(cx + r * math.cos(a), cy + r * math.sin(a))
                for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if shape == "star":  # five points up, inner radius 0.45 r
        return [(cx + (r if i % 2 == 0 else 0.45 * r) * math.cos(-math.pi / 2 + i * math.pi / 5),
                 cy + (r if i % 2 == 0 else 0.45 * r) * math.sin(-math.pi / 2 + i * math.pi / 5)) for i in range(10)]
    raise ValueError(f"unknown shape {shape!r}")


def render_mask(shape: str, cx: float, cy: float, r: float, size: int = SIZE) -> Image.Image:
    """An anti-aliased "L" mask of the shape (255 inside)."""
    big = Image.new("L", (size * _SS, size * _SS), 0)
    draw = ImageDraw.Draw(big)
    poly = shape_polygon(shape, cx * _SS, cy * _SS, r * _SS)
    if poly is None:
        s = r * _SS
        draw.ellipse((cx * _SS - s, cy * _SS - s, cx * _SS + s, cy * _SS + s), fill=255)
    else:
        draw.polygon(poly, fill=255)
    return big.resize((size, size), Image.BOX)


def render(spec: ShapeSpec, size: int = SIZE) -> Image.Image:
    background = Image.new("RGB", (size, size), COLORS[spec.background])
    foreground = Image.new("RGB", (size, size), COLORS[spec.color])
    return Image.composite(foreground, background, render_mask(spec.shape, spec.cx, spec.cy, spec.radius, size))


def random_spec(rng: random.Random, shapes=BASE_SHAPES, colors=None, jitter: float = 6.0,
                radius: tuple[float, float] = (13.0, 20.0)) -> ShapeSpec:
    """A random shape, colour pair (foreground != background), position jitter and size."""
    names = list(colors or COLORS)
    color, background = rng.sample(names, 2)
    return ShapeSpec(rng.choice(list(shapes)), color, background, SIZE / 2 + rng.uniform(-jitter, jitter),
                     SIZE / 2 + rng.uniform(-jitter, jitter), rng.uniform(*radius))


def random_vae_image(rng: random.Random, size: int = SIZE) -> Image.Image:
    """A generic image for training the VAE: one to three random polygons (convex or not) or ellipses in
    the palette's colours, anywhere in the frame (not the demo's star), so the autoencoder learns flat
    regions and edges of any outline."""
    names = list(COLORS)
    big = Image.new("RGB", (size * _SS, size * _SS), COLORS[rng.choice(names)])
    draw = ImageDraw.Draw(big)
    for _ in range(rng.randint(1, 3)):
        fill = COLORS[rng.choice(names)]
        cx, cy = rng.uniform(4, size - 4) * _SS, rng.uniform(4, size - 4) * _SS
        r = rng.uniform(5, 24) * _SS
        if rng.random() < 0.3:
            draw.ellipse((cx - r, cy - r * rng.uniform(0.5, 1.0), cx + r, cy + r * rng.uniform(0.5, 1.0)), fill=fill)
        else:
            n = rng.randint(3, 9)
            start = rng.uniform(0, 2 * math.pi)
            pts = [(cx + r * rng.uniform(0.4, 1.0) * math.cos(start + 2 * math.pi * i / n),
                    cy + r * rng.uniform(0.4, 1.0) * math.sin(start + 2 * math.pi * i / n)) for i in range(n)]
            draw.polygon(pts, fill=fill)
    return big.resize((size, size), Image.BOX)


# -- measuring how much an image looks like a shape -----------------------------------------------------

def foreground_mask(image: Image.Image, color: str, background: str) -> np.ndarray:
    """Boolean (H, W): pixels nearer (RGB distance) to the foreground colour than to the background's."""
    a = np.asarray(image.convert("RGB"), dtype=np.float32)
    fg = np.asarray(COLORS[color], dtype=np.float32)
    bg = np.asarray(COLORS[background], dtype=np.float32)
    return ((a - fg) ** 2).sum(-1) < ((a - bg) ** 2).sum(-1)


def _unit_area(shape: str) -> float:
    """Area of `shape` at radius 1 (analytically, from its polygon)."""
    poly = shape_polygon(shape, 0.0, 0.0, 1.0)
    if poly is None:
        return math.pi
    xs, ys = zip(*poly)
    return 0.5 * abs(sum(xs[i] * ys[i - 1] - xs[i - 1] * ys[i] for i in range(len(xs))))


def aligned_iou(mask: np.ndarray, shape: str) -> float:
    """IoU of `mask` with `shape` drawn at the mask's centroid with the mask's area (0 for an empty mask).

    Position and size are factored out, so what remains is how much the region looks like the shape:
    a rendered star scores about 0.95 as a star and about 0.7 as a circle.
    """
    area = float(mask.sum())
    if area < 4:
        return 0.0
    ys, xs = np.nonzero(mask)
    # A polygon drawn at (cx, cy) covers pixel (x, y) around (x + 0.5, y + 0.5).
    cx, cy = xs.mean() + 0.5, ys.mean() + 0.5
    r = math.sqrt(area / _unit_area(shape))
    ref = np.asarray(render_mask(shape, cx, cy, r, mask.shape[0])) >= 128
    union = (ref | mask).sum()
    return float((ref & mask).sum() / union) if union else 0.0


def classify_shape(mask: np.ndarray, shapes=BASE_SHAPES + ("star",)) -> str:
    """The shape whose aligned IoU with `mask` is highest."""
    return max(shapes, key=lambda s: aligned_iou(mask, s))
