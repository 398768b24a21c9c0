"""Clips as lists of PIL frames: reading (PyAV's bundled FFmpeg; GIF through Pillow) and writing (mp4 and
other containers through PyAV, animated GIF/WebP previews through Pillow).

The frame rule follows the reference's video loader: a clip gives its first `num_frames` frames; a clip
with fewer is cut to the largest `factor * k + remainder` it has (4k+1 for Wan's VAE), never padded.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageSequence

from ..errors import UserError
from ..util import file_problem

# Containers PyAV reads (GIF and WebP are read with Pillow: see ANIMATED_IMAGE_EXTENSIONS).
VIDEO_EXTENSIONS = (".mp4", ".mov", ".m4v", ".webm", ".avi", ".mkv", ".wmv", ".flv")
ANIMATED_IMAGE_EXTENSIONS = (".gif", ".webp")  # every frame (a still WebP is a one-frame clip)
PREVIEW_EXTENSIONS = (".gif", ".webp")  # what `write_animation` writes
DEFAULT_FPS = 16  # a preview's frame rate where the caller names none


class VideoError(UserError):
    """A clip that cannot be read. `reason` is the problem without the path, so the data set can put the
    row in front of it; the message is `reason: path`."""

    def __init__(self, reason: str, path: str = ""):
        self.reason, self.path = " ".join(str(reason).split()), os.fspath(path)
        super().__init__(f"{self.reason}: {self.path}" if self.path else self.reason)


class VideoInfo(NamedTuple):
    width: int
    height: int
    frames: int | None  # what the header says; None where the container does not say (webm, mkv)
    fps: float | None
    codec: str


def frames_to_keep(available: int, num_frames: int | None, time_division_factor: int = 1,
                   time_division_remainder: int = 0) -> int:
    """How many leading frames a clip of `available` frames gives: `num_frames` if it has that many, else the
    largest `factor * k + remainder` <= available (1 at least, if it has a frame). `num_frames` None: every
    frame, cut the same way."""
    if available <= 0:
        return 0
    if num_frames is not None and available >= num_frames:
        return num_frames
    n = available
    while n > 1 and n % time_division_factor != time_division_remainder:
        n -= 1
    return n


def _ffmpeg_reason(err: BaseException) -> str:
    # PyAV's messages end with the file name in quotes; the caller names the file itself
    text = getattr(err, "strerror", None) or str(err)
    return " ".join(str(text).split()) or type(err).__name__


def _av():
    try:
        import av
    except ImportError:  # pragma: no cover - a dependency of difftune
        raise UserError("reading and writing video needs PyAV: pip install av") from None
    # PyAV leaves FFmpeg's log off by default; turning it on (av.logging.set_level) installs a Python callback
    # that can deadlock with FFmpeg's decoding threads, so it is never touched here
    return av


def _open(path: str):
    """(container, its first video stream); VideoError for whatever keeps a clip from being decoded."""
    av = _av()
    problem = file_problem(path)
    if problem:
        raise VideoError(problem, path)
    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError, ValueError, EOFError) as err:
        raise VideoError(f"unreadable or corrupt video ({_ffmpeg_reason(err)})", path) from None
    if not container.streams.video:
        what = "only audio" if container.streams.audio else "no stream at all"
        container.close()
        raise VideoError(f"no video stream (the file holds {what}: truncated, or not a video)", path)
    stream = container.streams.video[0]
    if stream.codec_context is None:
        container.close()
        raise VideoError("unreadable codec (the FFmpeg bundled with PyAV has no decoder for this clip's codec)", path)
    stream.thread_type = "AUTO"
    return container, stream


def _rgb(frame) -> Image.Image:
    """A decoded frame as RGB, turned as its display matrix says (a phone's portrait clip stands up)."""
    img = frame.to_image()
    angle = int(getattr(frame, "rotation", 0) or 0)
    return img.rotate(angle, expand=True) if angle % 360 else img  # both counter-clockwise


def probe_video(path: str | os.PathLike) -> VideoInfo:
    """Size, header frame count, frame rate and codec from the header (no decoding); Pillow reads GIFs and stills."""
    path = os.fspath(path)
    if os.path.splitext(path)[1].lower() not in VIDEO_EXTENSIONS:  # GIF, or a still: one frame
        with _open_image(path) as img:
            duration = img.info.get("duration") or 0
            return VideoInfo(img.width, img.height, getattr(img, "n_frames", 1),
                             1000.0 / duration if duration else None, (img.format or "").lower())
    container, stream = _open(path)
    with container:
        cc = stream.codec_context
        rate = stream.average_rate or stream.guessed_rate
        return VideoInfo(cc.width, cc.height, int(stream.frames) or None, float(rate) if rate else None, cc.name)


def _open_image(path: str) -> Image.Image:
    from PIL import UnidentifiedImageError

    problem = file_problem(path)
    if problem:
        raise VideoError(problem, path)
    try:
        return Image.open(path)
    except UnidentifiedImageError:
        raise VideoError("not an image (PIL cannot read its format)", path) from None
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise VideoError(f"unreadable or corrupt image ({' '.join(str(err).split())})", path) from None


def _read_animated(path: str, limit: int | None) -> list[Image.Image]:
    from .image import to_rgb  # one frame reads as the same file read as an image would

    frames = []
    with _open_image(path) as img:
        try:
            for frame in ImageSequence.Iterator(img):
                frames.append(to_rgb(frame.copy(), path))
                if limit is not None and len(frames) >= limit:
                    break
        except (OSError, SyntaxError, ValueError, EOFError) as err:
            raise VideoError(f"corrupt animation: decoding stopped after {len(frames)} frame(s) "
                             f"({' '.join(str(err).split())})", path) from None
    return frames


def _is_animated(path: str) -> bool:
    with _open_image(path) as img:
        return bool(getattr(img, "is_animated", False)) or img.format == "GIF"


def _read_stream(path: str, limit: int | None) -> list[Image.Image]:
    av = _av()
    container, stream = _open(path)
    frames: list[Image.Image] = []
    with container:
        try:
            for frame in container.decode(stream):
                frames.append(_rgb(frame))
                if limit is not None and len(frames) >= limit:
                    return frames
        except (av.error.FFmpegError, OSError, ValueError, EOFError) as err:
            raise VideoError(f"corrupt video: decoding stopped after {len(frames)} frame(s) "
                             f"({_ffmpeg_reason(err)})", path) from None
        listed = int(stream.frames or 0)
    # a header's count can be a frame or two off what decodes (edit lists); more missing is a cut-off file
    if frames and listed - len(frames) > max(2, listed // 20):
        raise VideoError(f"truncated video: its header lists {listed} frames, only {len(frames)} decode", path)
    return frames


def read_video(path: str | os.PathLike, num_frames: int | None = None, time_division_factor: int = 1,
               time_division_remainder: int = 0) -> list[Image.Image]:
    """The clip's leading frames as RGB PIL images (see `frames_to_keep`): a video container by PyAV, an animated
    GIF or WebP by Pillow (every frame), any other image as a one-frame clip. `num_frames` None keeps every frame (cut to
    factor*k+remainder). A clip that cannot be decoded, or has no frame, raises VideoError."""
    path = os.fspath(path)
    if num_frames is not None and num_frames < 1:
        raise UserError(f"num_frames must be at least 1, got {num_frames}")
    ext = os.path.splitext(path)[1].lower()
    if ext in VIDEO_EXTENSIONS:
        frames = _read_stream(path, num_frames)
    elif ext in ANIMATED_IMAGE_EXTENSIONS and _is_animated(path):
        frames = _read_animated(path, num_frames)
    else:  # a still: read exactly as the image path reads it (EXIF orientation, every PIL mode)
        from .image import load_image

        frames = [load_image(path)]
    if not frames:
        raise VideoError("no frames (the file holds no decodable picture)", path)
    return frames[:frames_to_keep(len(frames), num_frames, time_division_factor, time_division_remainder)]


def read_video_at_rate(path: str | os.PathLike, fps: float, num_frames: int | None = None,
                       time_division_factor: int = 1, time_division_remainder: int = 0) -> list[Image.Image]:
    """The clip resampled to `fps`: frame k is the decoded frame whose timestamp is nearest k / fps
    (a variable-frame-rate clip follows its timestamps, a constant one is the reference's round(k * fps /
    fps)), for as many frames as the clip lasts at that rate (`frames_to_keep`). GIFs and stills keep their
    frames as `read_video` reads them."""
    path = os.fspath(path)
    if fps is None or not float(fps) > 0:
        raise UserError(f"frame rate {fps}: must be a positive number of frames per second")
    if os.path.splitext(path)[1].lower() not in VIDEO_EXTENSIONS:
        return read_video(path, num_frames, time_division_factor, time_division_remainder)
    av = _av()
    container, stream = _open(path)
    rate = stream.average_rate or stream.guessed_rate
    step = 1.0 / float(rate) if rate else None
    frames, times = [], []
    wanted = None if num_frames is None else (num_frames - 1) / float(fps)
    with container:
        try:
            for frame in container.decode(stream):
                t = frame.time if frame.time is not None else len(frames) * (step or 1 / float(fps))
                frames.append(_rgb(frame))
                times.append(float(t))
                if wanted is not None and times[-1] - times[0] > wanted + (step or 0):
                    break  # one frame past the last one wanted
        except (av.error.FFmpegError, OSError, ValueError, EOFError) as err:
            raise VideoError(f"corrupt video: decoding stopped after {len(frames)} frame(s) "
                             f"({_ffmpeg_reason(err)})", path) from None
    if not frames:
        raise VideoError("no frames (the file holds no decodable picture)", path)
    start = times[0]
    times = [t - start for t in times]
    if step is None:
        step = (times[-1] / (len(times) - 1)) if len(times) > 1 else 1 / float(fps)
    lasts = times[-1] + step
    available = int(math.floor(lasts * float(fps) + 1e-6))
    keep = frames_to_keep(max(available, 1), num_frames, time_division_factor, time_division_remainder)
    out, j = [], 0
    for k in range(keep):
        target = k / float(fps)
        while j + 1 < len(times) and abs(times[j + 1] - target) <= abs(times[j] - target):
            j += 1
        out.append(frames[j])
    return out


def count_frames(path: str | os.PathLike, limit: int | None = None) -> int:
    """How many frames the clip holds, counting no further than `limit`: from the header where it lists clearly
    more (a container's count can be a frame or two off what decodes), else by decoding without converting the
    frames; a GIF's or WebP's frames from Pillow, a still as one frame. VideoError for a clip that cannot be read."""
    path = os.fspath(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in VIDEO_EXTENSIONS:
        with _open_image(path) as img:
            n = int(getattr(img, "n_frames", 1) or 1)
        return n if limit is None else min(n, limit)
    av = _av()
    container, stream = _open(path)
    with container:
        listed = int(stream.frames or 0)
        if limit is not None and listed >= limit + 2:
            return limit
        n = 0
        try:
            for _ in container.decode(stream):
                n += 1
                if limit is not None and n >= limit:
                    break
        except (av.error.FFmpegError, OSError, ValueError, EOFError) as err:
            raise VideoError(f"corrupt video: decoding stopped after {n} frame(s) ({_ffmpeg_reason(err)})",
                             path) from None
    return n


def check_video(path: str | os.PathLike) -> VideoInfo:
    """The cheap check the data set runs on every row before training: the header parses, a video stream
    with a known codec is there, and its first frame decodes."""
    path = os.fspath(path)
    info = probe_video(path)
    read_video(path, num_frames=1)
    return info


# -- writing ---------------------------------------------------------------------------------------------

def _frames(frames) -> list[Image.Image]:
    frames = [frames] if isinstance(frames, Image.Image) else list(frames)
    if not frames:
        raise UserError("no frames to write")
    first = frames[0].size
    if any(f.size != first for f in frames):
        raise UserError(f"every frame of a clip must have one size, got {sorted({f.size for f in frames})}")
    return [f if f.mode == "RGB" else f.convert("RGB") for f in frames]


def write_animation(frames: Sequence[Image.Image], path: str | os.PathLike, fps: float = DEFAULT_FPS) -> Path:
    """An animated GIF or WebP (by extension) that loops: a preview any browser or TensorBoard shows."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext not in PREVIEW_EXTENSIONS:
        raise UserError(f"{path}: an animated preview is .gif or .webp, not '{ext or '(no extension)'}'")
    frames = _frames(frames)
    path.parent.mkdir(parents=True, exist_ok=True)
    duration = max(1, round(1000 / fps))  # GIF stores hundredths: 16 fps is 60 ms a frame
    options = {"lossless": False, "quality": 90} if ext == ".webp" else {}
    tmp = path.with_name(f".{path.name}.partial{ext}")  # a crash leaves no half-written preview under the name
    frames[0].save(tmp, save_all=True, append_images=frames[1:], duration=duration, loop=0, **options)
    os.replace(tmp, path)
    return path


# container extension -> codecs to try, best first; mpeg4 is FFmpeg's own, so always there
_CODECS = {".mp4": ("libx264", "mpeg4"), ".m4v": ("libx264", "mpeg4"), ".mov": ("libx264", "mpeg4"),
           ".mkv": ("libx264", "mpeg4"), ".avi": ("mpeg4",), ".webm": ("libvpx-vp9", "libvpx")}
WRITABLE_EXTENSIONS = (*_CODECS, *PREVIEW_EXTENSIONS)  # what `write_video` writes


def video_codec(ext: str) -> str:
    """The codec `write_video` uses for a container extension (H.264 where the bundled FFmpeg has libx264)."""
    av = _av()
    for codec in _CODECS.get(ext.lower(), ()):
        if codec in av.codecs_available:
            return codec
    raise UserError(f"cannot write '{ext}' video: none of {', '.join(_CODECS.get(ext.lower(), ()))} is in PyAV's "
                    f"FFmpeg (write .mp4, .mkv, .mov, .avi, .webm, or a .gif / .webp preview)")


def _even(img: Image.Image) -> Image.Image:
    # 4:2:0 chroma needs even sides: repeat the last row/column rather than drop picture
    w, h = img.size
    if w % 2 == 0 and h % 2 == 0:
        return img
    out = Image.new("RGB", (w + w % 2, h + h % 2))
    out.paste(img, (0, 0))
    if w % 2:
        out.paste(img.crop((w - 1, 0, w, h)), (w, 0))
    if h % 2:
        out.paste(out.crop((0, h - 1, w + w % 2, h)), (0, h))
    return out


def write_video(frames: Sequence[Image.Image], path: str | os.PathLike, fps: float = DEFAULT_FPS,
                quality: float = 9, audio=None) -> Path:
    """Write a clip. .mp4/.mov/.mkv/.m4v: H.264 (yuv420p, plays everywhere; FFmpeg's mpeg4 if the bundled
    FFmpeg lacks libx264), .avi: mpeg4, .webm: VP9, .gif/.webp: an animated preview (`write_animation`).
    `quality` 0..10 as the reference's save_video (10 best; H.264 CRF = (1 - quality/10) * 51). Frames with
    an odd side get one repeated row/column (4:2:0 needs even sides). `audio`: (waveform (channels, samples) in
    [-1, 1], sample rate), muxed in as the clip's sound track (AAC; Opus in .webm)."""
    path = Path(path)
    ext = path.suffix.lower()
    if ext in PREVIEW_EXTENSIONS:
        return write_animation(frames, path, fps)
    if ext not in _CODECS:
        raise UserError(f"{path}: cannot write video as '{ext or '(no extension)'}' "
                        f"(use {', '.join(WRITABLE_EXTENSIONS)})")
    if not 0 <= quality <= 10:
        raise UserError(f"video quality {quality}: must be 0..10 (10 best)")
    frames = [_even(f) for f in _frames(frames)]
    av = _av()
    codec = video_codec(ext)
    from fractions import Fraction

    rate = Fraction(fps).limit_denominator(1001)
    width, height = frames[0].size
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial{ext}")  # a crash leaves no half-written clip under the name
    crf = int((1 - quality / 10) * 51)
    with av.open(str(tmp), "w") as out:
        if codec == "libx264":
            options = {"crf": str(crf)}
        elif codec.startswith("libvpx"):
            options = {"crf": str(min(63, crf + 10)), "b": "0"}
        else:  # mpeg4: a fixed quantiser 2 (best) .. 31, in FFmpeg's lambda units (118 per step)
            options = {"flags": "+qscale", "global_quality": str(118 * max(2, min(31, round(31 - quality * 2.9))))}
        stream = out.add_stream(codec, rate=rate, options=options)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        sound = _add_audio(out, audio, ext) if audio is not None else None
        for img in frames:
            for packet in stream.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
        if sound is not None:
            _mux_audio(out, sound, audio)
    os.replace(tmp, path)
    return path


def _add_audio(out, audio, ext: str):
    wave, rate = audio
    channels = 1 if np.ndim(wave) == 1 else int(np.shape(wave)[0])
    if channels not in (1, 2):
        raise UserError(f"a clip's sound track is mono or stereo, got {channels} channels")
    sound = out.add_stream("libopus" if ext == ".webm" else "aac", rate=int(rate))
    sound.layout = "mono" if channels == 1 else "stereo"
    return sound


def _mux_audio(out, sound, audio) -> None:
    """The waveform as planar float frames of the encoder's frame size, then the encoder flushed."""
    av = _av()
    wave = np.clip(np.asarray(audio[0], dtype=np.float32).reshape(-1 if np.ndim(audio[0]) == 1 else
                                                                  np.shape(audio[0])[0], -1), -1, 1)
    wave = wave.reshape(1, -1) if wave.ndim == 1 else wave
    size = sound.codec_context.frame_size or 1024
    layout = "mono" if wave.shape[0] == 1 else "stereo"
    for start in range(0, wave.shape[1], size):
        chunk = np.ascontiguousarray(wave[:, start:start + size])
        frame = av.AudioFrame.from_ndarray(chunk, format="fltp", layout=layout)
        frame.sample_rate, frame.pts = int(audio[1]), start
        for packet in sound.encode(frame):
            out.mux(packet)
    for packet in sound.encode():
        out.mux(packet)


def save_video(frames: Sequence[Image.Image], save_path: str | os.PathLike, fps: float = DEFAULT_FPS,
               quality: float = 9) -> Path:
    """The reference's `save_video(frames, save_path, fps, quality)`: `write_video`."""
    return write_video(frames, save_path, fps=fps, quality=quality)


def tensor_to_clips(x) -> list[list[Image.Image]]:
    """Float tensor (B, 3, F, H, W) in [-1, 1] (a video VAE's output) -> one list of PIL frames per sample."""
    from .image import tensor_to_images

    if x.dim() != 5:
        raise ValueError(f"expected clips (B, 3, F, H, W), got a tensor of shape {tuple(x.shape)}")
    return [tensor_to_images(clip.transpose(0, 1)) for clip in x]


def frame_grid(frames: Sequence[Image.Image], columns: int | None = None, max_frames: int = 16) -> Image.Image:
    """Up to `max_frames` frames, evenly spread over the clip (first and last included), tiled in one picture
    (for TensorBoard, which shows still images)."""
    frames = _frames(frames)
    if len(frames) > max_frames:
        step = (len(frames) - 1) / (max_frames - 1)
        frames = [frames[round(i * step)] for i in range(max_frames)]
    columns = columns or math.ceil(math.sqrt(len(frames)))
    rows = math.ceil(len(frames) / columns)
    w, h = frames[0].size
    grid = Image.new("RGB", (columns * w, rows * h))
    for i, frame in enumerate(frames):
        grid.paste(frame, ((i % columns) * w, (i // columns) * h))
    return grid


__all__ = ["ANIMATED_IMAGE_EXTENSIONS", "DEFAULT_FPS", "PREVIEW_EXTENSIONS", "VIDEO_EXTENSIONS",
           "WRITABLE_EXTENSIONS",
           "VideoError", "VideoInfo", "check_video", "count_frames", "frame_grid", "frames_to_keep", "probe_video", "read_video",
           "read_video_at_rate",
           "save_video", "tensor_to_clips", "video_codec", "write_animation", "write_video"]
