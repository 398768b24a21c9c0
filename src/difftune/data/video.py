"""Video data operators: a clip file -> a list of PIL frames, with the row and file named in every error.

A video family's data operator routes by extension: a video container or a GIF gives its leading frames
(`media.video.read_video`: `num_frames`, or the largest 4k+1 a shorter clip has), a still image gives a
one-frame clip, and then `ImageCropAndResize` treats each frame as it treats an image.
"""

from __future__ import annotations

import os

from ..media.video import (ANIMATED_IMAGE_EXTENSIONS, VIDEO_EXTENSIONS, VideoError, count_frames,
                           frames_to_keep, probe_video, read_video, read_video_at_rate)
from .operators import (CHECKED, IMAGE_EXTENSIONS, UNKNOWN, DataError, DataOperator, Frames, ImageCropAndResize,
                        LoadImage, RouteByExtension, ToAbsolutePath, _where)

CLIP_EXTENSIONS = VIDEO_EXTENSIONS + ANIMATED_IMAGE_EXTENSIONS  # read as several frames
STILL_EXTENSIONS = tuple(e for e in IMAGE_EXTENSIONS if e not in ANIMATED_IMAGE_EXTENSIONS)  # one-frame clips
HEADER_SLACK = 2  # frames a container's listed count may exceed what decodes (edit lists, a dropped last frame)


class LoadVideo(DataOperator):
    """A clip file -> its leading frames (RGB PIL images): `num_frames` of them, or, from a shorter clip, the
    largest `time_division_factor * k + time_division_remainder` it has. `num_frames` None: every frame.
    `fps`: the clip resampled to that rate first (`media.video.read_video_at_rate`: by the frames'
    timestamps, so a variable-frame-rate clip keeps its timing), for a model that trains at one rate."""

    def __init__(self, num_frames: int | None = None, time_division_factor: int = 1,
                 time_division_remainder: int = 0, fps: float | None = None):
        if num_frames is not None and num_frames < 1:
            raise DataError(f"--num_frames {num_frames}: must be at least 1 frame")
        self.num_frames = num_frames
        self.time_division_factor, self.time_division_remainder = time_division_factor, time_division_remainder
        self.fps = fps

    def _fail(self, err: VideoError, path, context):
        raise DataError(f"{_where(context)}: {err.reason}: {path}") from None

    def __call__(self, path, context=None):
        path = os.fspath(path)
        try:
            if self.fps:
                return read_video_at_rate(path, self.fps, self.num_frames, self.time_division_factor,
                                          self.time_division_remainder)
            return read_video(path, self.num_frames, self.time_division_factor, self.time_division_remainder)
        except VideoError as err:
            self._fail(err, path, context)

    def check(self, path, context=None):
        """The header, a video stream with a decoder, and the first frame: one frame's decode per row."""
        path = os.fspath(path)
        try:
            read_video(path, num_frames=1)
        except VideoError as err:
            self._fail(err, path, context)
        return CHECKED

    def shape(self, path, context=None):
        """(width, height, num_frames) from the header where it lists clearly more frames than asked (mp4, mov,
        avi, GIF); else UNKNOWN (webm and mkv list none; a header's count can be a frame or two off what
        decodes, which matters only for a clip cut short): the data set then loads the clip to see."""
        try:
            info = probe_video(os.fspath(path))
        except Exception:  # the pre-check and the load report what is wrong with the file
            return UNKNOWN
        frames = info.frames
        if self.fps and frames:  # what the clip lasts at the training rate
            frames = int(frames / info.fps * self.fps) if info.fps else None
        if self.num_frames is None or not frames or frames < self.num_frames + HEADER_SLACK:
            return UNKNOWN
        return (info.width, info.height, self.num_frames)

    def extent(self, path, context=None):
        """The frames the file holds (counted up to `num_frames`) and the frames it loads."""
        path = os.fspath(path)
        try:
            if self.fps:
                available = len(read_video_at_rate(path, self.fps, self.num_frames))
            else:
                available = count_frames(path, self.num_frames)
        except VideoError as err:
            self._fail(err, path, context)
        return Frames(available, frames_to_keep(available, self.num_frames, self.time_division_factor,
                                                self.time_division_remainder))


class ToClip(DataOperator):
    """One image -> a one-frame clip (a still in a video column, as the reference reads it)."""

    def __call__(self, value, context=None):
        return value if isinstance(value, list) else [value]

    def extent(self, value, context=None):
        return value

    def shape(self, value, context=None):
        return (*value, 1) if isinstance(value, tuple) and len(value) == 2 else value


def video_operator(base_path, height: int | None = None, width: int | None = None, max_pixels: int = 1024 * 1024,
                   height_division_factor: int = 16, width_division_factor: int = 16,
                   num_frames: int | None = None, time_division_factor: int = 1,
                   time_division_remainder: int = 0, fps: float | None = None) -> DataOperator:
    """Path -> list of RGB frames, each cropped and resized as an image would be (fixed size, or dynamic
    under max_pixels): clips and GIFs by `LoadVideo` (at `fps` when given), stills as one-frame clips."""
    load = LoadVideo(num_frames, time_division_factor, time_division_remainder, fps)
    return (ToAbsolutePath(base_path)
            >> RouteByExtension({CLIP_EXTENSIONS: load,
                                 STILL_EXTENSIONS: LoadImage() >> ToClip()})
            >> ImageCropAndResize(height, width, max_pixels, height_division_factor, width_division_factor))


__all__ = ["CLIP_EXTENSIONS", "STILL_EXTENSIONS", "LoadVideo", "ToClip", "video_operator"]
