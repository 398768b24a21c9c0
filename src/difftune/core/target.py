"""What a family generates: a `Target` of one or more `Stream`s and the prediction type its denoiser learns.

A stream owns one generated modality end to end: the data column it trains on and the value it becomes, its size and
time rules (the crop division, a clip's frame counts, an audio clip's seconds), its latent maths (channels, scale,
patching, the noise shape, the sequence length the denoiser sees, the positions check, the loss mask), its decoding
and its outputs (`write`: the files `difftune sample` makes; `preview`: what validation shows). Shared code asks the
target and never branches on a family's kind of output.

A target with several streams (a video and its sound) trains one loss per stream and steps each with its scheduler;
`model_fn` then returns one prediction per stream (a dict by stream name)."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError, row_label

# What a stream's data column loads.
IMAGE, FRAMES, AUDIO = "image", "frames", "audio"
# What the denoiser predicts: the flow (noise - x0), the noise (epsilon) or the velocity (v = a * noise - s * x0).
FLOW, EPSILON, V_PREDICTION = "flow", "epsilon", "v_prediction"
PREDICTIONS = (FLOW, EPSILON, V_PREDICTION)


@dataclass(frozen=True)
class FrameRule:
    """A clip trains on `default` frames unless told, a count of `factor * k + remainder` (a video VAE's)."""

    default: int
    factor: int = 1
    remainder: int = 0


@dataclass(frozen=True, eq=False)
class Stream:
    """One generated modality. Subclasses say how it is loaded, decoded and written; a family may subclass one for
    its own latent rules (e.g. a VAE whose scales come from its config)."""

    name: str = "image"
    column: str = "image"  # the data column a training row gives it in
    input: str = "input_image"  # the value the row (or a call) gives: what the units encode
    latents: str = "latents"  # the noisy latents model_fn takes
    input_latents: str = "input_latents"  # the clean latents the loss noises
    channels: int = 4
    scale: int = 1  # output samples (pixels) per latent element along a side
    patch: int = 1  # latent elements per token along a side
    division: int = 1  # sizes are cropped to multiples of this
    decoder: Callable | None = None  # (pipe, latents) -> decoded tensor in [-1, 1]
    decode_models: tuple[str, ...] = ("vae",)
    kind: str = IMAGE
    extension: str = ".png"  # what `difftune sample` writes by default
    what: str = "images"  # what it is called in messages
    required: bool = False  # every training row must give it (else a row without it takes its size from the data)
    frames: FrameRule | None = None  # a clip's frame rule (None: no frames)
    # --extra_inputs taken from a clip's frames when the metadata has no such column: name -> (clip column, index)
    frame_inputs: Mapping[str, tuple[str, int]] = field(default_factory=dict)
    # the columns a row's training clip comes from, the first the row has
    clip_columns: tuple[str, ...] = ()

    # -- latent maths ------------------------------------------------------------------------------------
    def seq_len(self, latents: torch.Tensor) -> int:
        """Tokens the denoiser sees for these latents (what a dynamic time shift depends on)."""
        tokens = 1
        for side in latents.shape[-2:]:
            tokens *= side // self.patch
        return tokens * (latents.shape[2] if latents.dim() == 5 else 1)

    def size_seq_len(self, values: Mapping[str, Any]) -> int:
        """Tokens of an output of the size the values ask for, before any latents exist."""
        f = self.division
        return (-(-int(values["height"]) // f)) * (-(-int(values["width"]) // f))

    def noise_shape(self, pipe, height: int, width: int) -> tuple[int, ...]:
        """One sample's initial noise for an output of this size (validation draws it)."""
        return (self.channels, height // self.scale, width // self.scale)

    def size_of(self, pipe, latents: torch.Tensor) -> dict[str, int]:
        """The output size these latents decode to."""
        return {"height": int(latents.shape[-2]) * self.scale, "width": int(latents.shape[-1]) * self.scale}

    def loss_mask(self, pipe, values: Mapping[str, Any]) -> torch.Tensor | None:
        """Which latent elements count in the loss (broadcast against the latents); None: all of them."""
        return None

    def check_positions(self, pipe, latents: torch.Tensor) -> None:
        """A latent grid longer, along a side, than a denoiser's table of positions (a diffusers config's
        `rope_max_seq_len`) fails deep in its forward with a reshape error: one line naming the size and the limit
        instead. Called before the denoiser runs, in training and sampling."""
        for name in pipe.loss_models:
            config = getattr(pipe.models.get(name), "config", None)
            limit = getattr(config, "rope_max_seq_len", None)
            if not limit:
                continue
            sides = tuple(latents.shape[2:])  # ([frames,] height, width) of the latents
            patch = getattr(config, "patch_size", None)
            patch = tuple(patch)[-len(sides):] if isinstance(patch, (list, tuple)) and len(patch) >= len(sides) \
                else (1,) * (len(sides) - 2) + (self.patch,) * 2
            for side, p, what in zip(sides, patch, ("frames", "height", "width")[-len(sides):]):
                if side // p > limit:
                    size = self.size_of(pipe, latents)
                    shown = f"{size.get('width')}x{size.get('height')} px" + (
                        f", {size['num_frames']} frames" if "num_frames" in size else "")
                    most = limit * p * (self.scale if what != "frames" else 1)
                    raise UserError(f"a sample of {shown} is {side // p} positions along its {what}, more than the "
                                    f"{limit} of {type(pipe.models[name]).__name__}'s positional table "
                                    f"(rope_max_seq_len in its config): keep the {what} at most {most}"
                                    f"{' latent frames' if what == 'frames' else ' px'} (--max_pixels, --height / "
                                    f"--width{', --num_frames' if what == 'frames' else ''})")

    # -- decoding and outputs ----------------------------------------------------------------------------
    def decode(self, pipe, latents: torch.Tensor) -> torch.Tensor:
        if self.decoder is None:
            raise NotImplementedError(f"{type(pipe).__name__} cannot decode its {self.name} latents")
        return self.decoder(pipe, latents)

    def postprocess(self, pipe, latents: torch.Tensor, output_type: str = "pil"):
        """"latent": the latents; "pt": decoded, in [0, 1]; "pil": one output per sample."""
        if output_type == "latent":
            return latents
        decoded = pipe.decode(latents, self)  # the pipeline's hook: a family may decode its own way
        if output_type == "pt":
            return (decoded.float() / 2 + 0.5).clamp(0, 1)
        return self.to_outputs(decoded)

    def to_outputs(self, decoded: torch.Tensor) -> list:
        from ..media.image import tensor_to_images

        return tensor_to_images(decoded)

    def output_fps(self, call) -> float:
        """The rate a written clip plays at for this sampling call (a still image: unused)."""
        return float(getattr(self, "fps", None) or 16)

    def check_output(self, path: str, family: str) -> str:
        """A `difftune sample --output` name checked against what this stream makes (its extension added)."""
        from ..media.video import VIDEO_EXTENSIONS

        ext = os.path.splitext(path)[1].lower()
        if ext in VIDEO_EXTENSIONS:
            raise UserError(f"--output {path}: the {family} family makes images: name an image file (.png, .jpg, ...)")
        return path if ext else path + self.extension

    def write(self, output, path: str, **options) -> list[str]:
        """One sample's output as the file(s) `path` names; returns what was written."""
        from ..io import atomic_save_image

        atomic_save_image(output, path)  # in the format the name's extension says
        return [path]

    def preview(self, outputs: list, path: Path) -> tuple[Any, Any]:
        """Validation's view of one output per prompt, written at `path` (.png): (the picture, its media: a clip's
        animation, the audio files, or None)."""
        from ..io import atomic_save_image

        grid = make_grid(outputs)
        atomic_save_image(grid, path)
        return grid, None

    # -- data ------------------------------------------------------------------------------------------
    def operator(self, size: Mapping[str, Any], frames=None):
        """The data operator of the stream's column (size: base_path, height, width, max_pixels, division)."""
        from ..data import UnifiedDataset

        return UnifiedDataset.default_image_operator(**size)

    def row_value(self, data: Mapping[str, Any]):
        """The training row's value of this stream (None when the row has none), checked."""
        from PIL import Image

        value = data.get(self.column)
        if (value is not None or self.required) and not isinstance(value, Image.Image):
            raise UserError(f"{row_label(data)}: '{self.column}' must be an image file listed in "
                            f"--data_file_keys")
        return value

    def row_size(self, value) -> dict[str, Any]:
        return {"height": value.size[1], "width": value.size[0]} if value is not None else {}

    def signature(self, value):
        """What samples encoded as one stage-1 batch must share."""
        return getattr(value, "size", value)

    def row_signature(self, sample: Mapping[str, Any]) -> tuple:
        """A sample's part of its stage-1 batch signature: its value's, and which frame inputs it gives."""
        value = next((sample.get(c) for c in (self.clip_columns or (self.column,)) if sample.get(c) is not None),
                     None)
        return (self.signature(value), *(sample.get(n) is not None for n in self.frame_inputs))

    def frame_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """The row's `frame_inputs` as images: a column read as a clip gives its frame (one-line errors)."""
        from PIL import Image

        out = {}
        for name, (_, index) in self.frame_inputs.items():
            value = data.get(name)
            if isinstance(value, (list, tuple)) and value and all(isinstance(f, Image.Image) for f in value):
                value = value[index]
            if value is not None and not isinstance(value, Image.Image):
                raise UserError(f"{row_label(data)}: '{name}' must be an image (an image file, or a frame "
                                f"of the clip)")
            out[name] = value
        return out


@dataclass(frozen=True, eq=False)
class ImageStream(Stream):
    pass


@dataclass(frozen=True, eq=False)
class VideoStream(Stream):
    """Clips: (C, F, h, w) latents, `temporal` frames per latent frame after the first."""

    name: str = "video"
    column: str = "video"
    input: str = "input_video"
    kind: str = FRAMES
    extension: str = ".mp4"
    what: str = "clips"
    temporal: int = 4
    fps: float = 16.0  # what validation's animation plays at
    owner: str = "the family"  # who needs the frame rule, as messages name it ("<owner> needs 4k+1")

    def scales(self, pipe) -> tuple[int, int, int]:
        """(channels, spatial, temporal) of the latents (a family whose VAE says them overrides it)."""
        return self.channels, self.scale, self.temporal

    def noise_shape(self, pipe, height: int, width: int, num_frames: int = 1) -> tuple[int, ...]:
        channels, spatial, temporal = self.scales(pipe)
        return (channels, (int(num_frames) - 1) // temporal + 1, height // spatial, width // spatial)

    def size_of(self, pipe, latents):
        _, spatial, temporal = self.scales(pipe)
        return {"height": int(latents.shape[-2]) * spatial, "width": int(latents.shape[-1]) * spatial,
                "num_frames": (int(latents.shape[2]) - 1) * temporal + 1}

    def postprocess(self, pipe, latents, output_type="pil"):
        """Per sample a clip (a list of frames); "pt": (B, 3, F, H, W) in [0, 1], a one-frame clip included."""
        if output_type == "latent":
            return latents
        video = pipe.decode(latents, self)
        video = video if video.dim() == 5 else video.unsqueeze(2)
        if output_type == "pt":
            return (video.float() / 2 + 0.5).clamp(0, 1)
        from ..media.video import tensor_to_clips

        return tensor_to_clips(video)

    def check_output(self, path: str, family: str) -> str:
        from ..media.video import WRITABLE_EXTENSIONS

        if os.path.splitext(path)[1].lower() not in WRITABLE_EXTENSIONS:
            raise UserError(f"--output {path}: the {family} family makes clips: name a "
                            f"{'/'.join(WRITABLE_EXTENSIONS)} file")
        return path

    def write(self, output, path: str, fps: float = 16, audio=None, **options) -> list[str]:
        from ..media.video import write_video

        write_video(output, path, fps=fps, **({"audio": audio} if audio is not None else {}))
        return [path]

    def preview(self, outputs, path):
        """A row of frames per prompt (TensorBoard shows stills), and an animated GIF of the prompts side by side."""
        from ..io import atomic_save_image
        from ..media.video import frame_grid, write_animation

        animation = None
        frames = min(len(c) for c in outputs)
        if frames > 1:
            animation = write_animation([make_grid([c[t] for c in outputs]) for t in range(frames)],
                                        path.with_suffix(".gif"), fps=self.fps)
        grid = make_grid([frame_grid(c, columns=min(len(c), 8), max_frames=8) for c in outputs], columns=1)
        atomic_save_image(grid, path)
        return grid, animation

    def operator(self, size, frames=None):
        from ..data import UnifiedDataset

        return UnifiedDataset.default_video_operator(**size, **(frames.as_dict() if frames is not None else {}))

    def row_value(self, data):
        from PIL import Image

        from ..media.image import as_image_list

        row = row_label(data)
        value = next((data.get(c) for c in (self.clip_columns or (self.column,)) if data.get(c) is not None), None)
        frames = as_image_list(value)
        if not frames or not all(isinstance(f, Image.Image) for f in frames):
            raise UserError(f"{row}: no clip: {' or '.join(repr(c) for c in self.clip_columns or (self.column,))} "
                            f"must be a file listed in --data_file_keys")
        rule = self.frames
        if rule is not None and len(frames) % rule.factor != rule.remainder % rule.factor:
            raise UserError(f"{row}: the clip has {len(frames)} frames; {self.owner} needs {rule.factor}k+"
                            f"{rule.remainder} (e.g. --num_frames {rule.default})")
        return frames

    def row_size(self, value):
        width, height = value[0].size
        return {"height": height, "width": width, "num_frames": len(value)}

    def signature(self, value):
        return (value[0].size, len(value)) if value else None


@dataclass(frozen=True, eq=False)
class AudioStream(Stream):
    """Audio: (C, T) latents from an audio VAE of `scale` samples per latent step; waveforms (channels, samples) at
    `sample_rate` in and out (wav or flac through soundfile)."""

    name: str = "audio"
    column: str = "audio"
    input: str = "input_audio"
    kind: str = AUDIO
    extension: str = ".wav"
    what: str = "audio"
    sample_rate: int = 16000
    audio_channels: int = 1
    default_seconds: float = 10.0
    fps: float | None = None  # the frame rate of the clip it is the sound of (a joint target): its length follows
    output_rate: int | None = None  # the rate decoded audio comes out at, where it is not `sample_rate` (a vocoder's)

    @property
    def rate_out(self) -> int:
        return int(self.output_rate or self.sample_rate)

    def seq_len(self, latents):
        return int(latents.shape[-1]) // self.patch

    def size_seq_len(self, values):
        seconds = self.seconds_of(values.get("seconds"), values.get("num_frames"))
        return self.samples_of(seconds) // (self.scale * self.patch)

    def samples_of(self, seconds: float) -> int:
        """Waveform samples of a clip of `seconds`, cut to a whole number of latent steps."""
        step = self.scale * self.patch
        return max(step, int(round(float(seconds) * self.sample_rate)) // step * step)

    def seconds_of(self, seconds: float | None = None, num_frames: int | None = None) -> float:
        """How long a sample is: as asked, else as long as `num_frames` frames of its clip, else the default."""
        if seconds is None and num_frames is not None and self.fps:
            seconds = int(num_frames) / self.fps
        return float(seconds if seconds is not None else self.default_seconds)

    def noise_shape(self, pipe, seconds: float | None = None, num_frames: int | None = None, **_) -> tuple[int, ...]:
        return (self.channels, self.samples_of(self.seconds_of(seconds, num_frames)) // self.scale)

    def size_of(self, pipe, latents):
        return {"seconds": int(latents.shape[-1]) * self.scale / self.sample_rate}

    def check_positions(self, pipe, latents):
        return None

    def postprocess(self, pipe, latents, output_type="pil"):
        """"pt": the waveforms (B, channels, samples) in [-1, 1] (a picture's [-1, 1] -> [0, 1] is no sound's)."""
        if output_type != "pt":
            return super().postprocess(pipe, latents, output_type)
        return pipe.decode(latents, self).float().clamp(-1, 1)

    def to_outputs(self, decoded):
        return [w.float().clamp(-1, 1).cpu().numpy() for w in decoded]  # (channels, samples) per sample

    def check_output(self, path, family):
        ext = os.path.splitext(path)[1].lower()
        if not ext:
            return path + self.extension
        if ext not in AUDIO_EXTENSIONS:
            raise UserError(f"--output {path}: the {family} family makes audio: name a "
                            f"{'/'.join(AUDIO_EXTENSIONS)} file")
        return path

    def write(self, output, path, **options):
        from ..media.audio import write_audio

        write_audio(output, path, self.rate_out)
        return [path]

    def preview(self, outputs, path):
        """Each prompt's waveform above its spectrogram (one row each) and the audio beside them (step-N-<i>.wav,
        the media the trackers that take audio log)."""
        from ..io import atomic_save_image
        from ..media.audio import spectrogram_picture, waveform_picture, write_audio

        files = []
        for i, wave in enumerate(outputs):
            files.append(path.with_name(f"{path.stem}-{i}.wav"))
            write_audio(wave, files[-1], self.rate_out)
        grid = make_grid([_above(waveform_picture(w), spectrogram_picture(w, self.rate_out)) for w in outputs],
                         columns=1)
        atomic_save_image(grid, path)
        return grid, AudioFiles(files, self.rate_out)

    def operator(self, size, frames=None):
        """The file's audio (an audio file, or a clip's sound track) at the stream's rate, cut to whole latent
        steps (and, as the sound of a clip, to the clip's frames)."""
        from ..data.audio import LoadAudio, ToWaveform
        from ..data.operators import ToAbsolutePath

        most = None
        if self.fps and frames is not None:
            most = self.samples_of(self.seconds_of(num_frames=frames.num_frames))
        return (ToAbsolutePath(size["base_path"]) >> LoadAudio(self.sample_rate, mono=self.audio_channels == 1)
                >> ToWaveform(self.scale * self.patch, most))

    def row_value(self, data):
        value = data.get(self.column)
        if value is not None and not (isinstance(value, torch.Tensor) and value.dim() == 2):
            raise UserError(f"{row_label(data)}: '{self.column}' must be an audio file listed in "
                            f"--data_file_keys")
        return value

    def row_size(self, value):
        return {"seconds": value.shape[-1] / self.sample_rate} if value is not None and self.fps is None else {}

    def signature(self, value):
        return tuple(value.shape) if value is not None else None


AUDIO_EXTENSIONS = (".wav", ".flac")


@dataclass(frozen=True)
class AudioFiles:
    """A validation render's audio: one file per prompt, at `sample_rate`."""

    paths: list
    sample_rate: int


@dataclass(frozen=True, eq=False)
class Target:
    """What a family generates: its streams (the first is the primary one: the size of a sample and the data
    operator follow it), the prediction type, and a scheduler factory per stream that does not share the
    pipeline's."""

    streams: tuple[Stream, ...]
    prediction: str = FLOW
    schedulers: Mapping[str, Callable[[], Any]] = field(default_factory=dict)

    def __post_init__(self):
        if not self.streams:
            raise TypeError("a Target has at least one stream")
        if self.prediction not in PREDICTIONS:
            raise TypeError(f"unknown prediction type {self.prediction!r} (one of {', '.join(PREDICTIONS)})")
        names = [s.name for s in self.streams]
        if len(set(names)) != len(names) or len({s.latents for s in self.streams}) != len(names):
            raise TypeError(f"a Target's streams need distinct names and latents: {names}")

    @property
    def primary(self) -> Stream:
        return self.streams[0]

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(s.kind for s in self.streams)

    @property
    def frames(self) -> FrameRule | None:
        """The frame rule of the target's clips (None: it makes no clips)."""
        return next((s.frames for s in self.streams if s.frames is not None), None)

    def describe(self) -> str:
        return " with ".join(s.what for s in self.streams)

    def check_output(self, path: str | None, family: str) -> str:
        return self.primary.check_output(path or f"sample{self.primary.extension}", family)

    def write(self, output, path: str, apart: bool = False, **options) -> list[str]:
        """One sample's output (a dict by stream name for several streams): a clip with sound is one file with
        its audio track muxed in; `apart`, each stream in its own file (NAME-<stream>.EXT: a silent clip and its
        sound)."""
        if len(self.streams) == 1:
            return self.primary.write(output, path, **options)
        audio = next((s for s in self.streams if s.kind == AUDIO), None)
        if not apart and self.primary.kind == FRAMES and audio is not None and len(self.streams) == 2:
            return self.primary.write(output[self.primary.name], path, audio=(output[audio.name], audio.rate_out),
                                      **options)
        root, ext = os.path.splitext(path)  # the primary keeps the extension asked for (a .webm clip stays one)
        return [p for s in self.streams
                for p in s.write(output[s.name], f"{root}-{s.name}{ext if s is self.primary else s.extension}",
                                 **options)]

    def preview(self, outputs: list, path: Path):
        """Validation's view: each stream's preview (the primary's at `path`, the others beside it)."""
        if len(self.streams) == 1:
            return self.primary.preview(outputs, path)
        grid, media = self.primary.preview([o[self.primary.name] for o in outputs], path)
        media = [media] if media is not None else []
        for s in self.streams[1:]:
            _, more = s.preview([o[s.name] for o in outputs], path.with_name(f"{path.stem}-{s.name}.png"))
            media += [more] if more is not None else []
        return grid, (media[0] if len(media) == 1 else media or None)


def takes_frames(stream: Stream) -> bool:
    """Whether the stream's noise takes a frame count (a clip), or it renders stills."""
    return "num_frames" in inspect.signature(stream.noise_shape).parameters


def _above(top, bottom):
    from PIL import Image

    out = Image.new("RGB", (max(top.width, bottom.width), top.height + bottom.height), "white")
    out.paste(top, (0, 0))
    out.paste(bottom, (0, top.height))
    return out


def make_grid(images, columns: int | None = None):
    """Images side by side (`columns` per row) on white; images with alpha are composited over it."""
    from PIL import Image

    columns = columns or len(images)
    rows = -(-len(images) // columns)
    w, h = images[0].size
    grid = Image.new("RGB", (columns * w, rows * h), "white")
    for i, img in enumerate(images):
        box = ((i % columns) * w, (i // columns) * h)
        if img.mode == "RGBA":
            grid.paste(img, box, img)
        else:
            grid.paste(img, box)
    return grid


IMAGE_TARGET = Target((ImageStream(),))

__all__ = ["AUDIO", "AUDIO_EXTENSIONS", "AudioFiles", "AudioStream", "EPSILON", "FLOW", "FRAMES", "FrameRule", "IMAGE",
           "IMAGE_TARGET", "ImageStream", "PREDICTIONS", "Stream", "Target", "V_PREDICTION", "VideoStream",
           "make_grid", "takes_frames"]
