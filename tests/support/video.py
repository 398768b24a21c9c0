"""Tiny clips and video data sets for tests (and for the video families' tiny repositories)."""

from __future__ import annotations

import os
from pathlib import Path

from PIL import Image, ImageDraw

_COLORS = [("red", (220, 40, 40)), ("blue", (40, 60, 220)), ("green", (40, 180, 70)), ("yellow", (230, 220, 50))]


def moving_circle_frames(num_frames: int, size: tuple[int, int] = (64, 64), color=(220, 40, 40),
                         background=(40, 60, 220)) -> list[Image.Image]:
    """A circle moving left to right over a plain background: every frame differs, so a reader that drops or
    repeats frames is caught (and a GIF writer does not merge them)."""
    w, h = size
    r = max(2, min(w, h) // 4)
    frames = []
    for i in range(num_frames):
        cx = r + (w - 2 * r) * i // max(1, num_frames - 1)
        img = Image.new("RGB", (w, h), background)
        ImageDraw.Draw(img).ellipse((cx - r, h // 2 - r, cx + r, h // 2 + r), fill=color)
        frames.append(img)
    return frames


def write_tiny_clip(path: str | os.PathLike, num_frames: int = 9, size: tuple[int, int] = (64, 64),
                    color=(220, 40, 40), background=(40, 60, 220), fps: float = 16) -> Path:
    """One short clip (`moving_circle_frames`) in the format its extension names (mp4, gif, ...)."""
    from difftune.media.video import write_video

    return write_video(moving_circle_frames(num_frames, size, color, background), path, fps=fps)


def write_example_video_dataset(root: str | os.PathLike, n: int = 2, num_frames: int = 9,
                                size: tuple[int, int] = (64, 64)) -> Path:
    """A tiny video data set in the reference's layout: video_<i>.mp4 (H.264, `num_frames` frames of `size`
    (width, height)) and metadata.csv (video,prompt). Returns the metadata file."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lines = ["video,prompt"]
    for i in range(n):
        name, rgb = _COLORS[i % len(_COLORS)]
        back_name, back = _COLORS[(i + 1) % len(_COLORS)]
        write_tiny_clip(root / f"video_{i + 1}.mp4", num_frames, size, rgb, back)
        lines.append(f'video_{i + 1}.mp4,"a {name} ball rolling across a {back_name} background"')
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


__all__ = ["moving_circle_frames", "write_example_video_dataset", "write_tiny_clip"]
