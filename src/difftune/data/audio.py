"""Audio data operators: an audio file, or a video file's audio stream -> a float32 waveform, with the row and
file named in every error (`media.audio.read_audio`: mono, resampled, as the reference's `LoadAudio(sr=16000)`).

Family-free: a family names its audio columns and rate (Wan2.2-S2V's `input_audio` at 16 kHz); the
audio-video families read theirs through the same operator. `LoadAudioClip` is for models that train on the audio
itself: (channels, samples) at the model's rate, cut to whole units so that samples of one bucket batch together.
"""

from __future__ import annotations

import math
import os

from ..errors import UserError
from ..media.audio import AUDIO_EXTENSIONS, AudioError, check_audio, probe_audio, read_audio
from ..media.video import VIDEO_EXTENSIONS
from .operators import CHECKED, UNKNOWN, DataError, DataOperator, Seconds, ToAbsolutePath, _where

# files an audio column may name: audio files, and clips whose audio stream is read
AUDIO_SOURCE_EXTENSIONS = AUDIO_EXTENSIONS + VIDEO_EXTENSIONS


class LoadAudio(DataOperator):
    """A file -> its first audio stream as a float32 waveform at `sample_rate` Hz: 1-D (the channels averaged)
    with `mono`, else (channels, samples). `min_seconds`: the shortest audio the model reading it takes (an
    encoder's first convolution spans that much)."""

    def __init__(self, sample_rate: int | None = 16000, mono: bool = True, min_seconds: float = 0.0):
        if sample_rate is not None and int(sample_rate) <= 0:
            raise DataError(f"audio sample rate {sample_rate}: must be positive")
        self.sample_rate, self.mono, self.min_seconds = sample_rate, mono, float(min_seconds)

    def _long_enough(self, seconds: float | None, path, context):
        if seconds is not None and seconds < self.min_seconds:
            raise DataError(f"{_where(context)}: {seconds:.2f} s of audio, the model needs at least "
                            f"{self.min_seconds:g} s: {path}")

    def _fail(self, err: AudioError, path, context):
        raise DataError(f"{_where(context)}: {err.reason}: {path}") from None

    def _known(self, path, context):
        if os.path.splitext(path)[1].lower() not in AUDIO_SOURCE_EXTENSIONS:
            raise DataError(f"{_where(context)}: not an audio file (expected one of "
                            f"{', '.join(AUDIO_SOURCE_EXTENSIONS)}): {path}")

    def __call__(self, path, context=None):
        path = os.fspath(path)
        self._known(path, context)
        try:
            wave = read_audio(path, self.sample_rate, self.mono)
        except AudioError as err:
            self._fail(err, path, context)
        if self.sample_rate:
            self._long_enough(wave.shape[-1] / self.sample_rate, path, context)
        return wave

    def check(self, path, context=None):
        """The header, an audio stream with a decoder, and its first moments (a WAV cut short of its
        declared samples is found here too)."""
        path = os.fspath(path)
        self._known(path, context)
        try:
            info = check_audio(path)
        except AudioError as err:
            self._fail(err, path, context)
        self._long_enough(info.duration, path, context)
        return CHECKED

    def extent(self, path, context=None):
        """How long the audio lasts: from the header, or by decoding where the header does not say."""
        path = os.fspath(path)
        self._known(path, context)
        try:
            seconds = probe_audio(path).duration
            if not seconds:
                rate = self.sample_rate or 16000
                seconds = read_audio(path, rate, True).shape[-1] / rate
        except AudioError as err:
            self._fail(err, path, context)
        return Seconds(float(seconds))

    def shape(self, path, context=None):
        """The waveform's length does not shape a sample (audio features are taken per video frame), so every
        audio file batches with every other: its rate and channel rule."""
        return ("audio", self.sample_rate, "mono" if self.mono else "channels")


class AudioPath(LoadAudio):
    """A file -> its path, checked like `LoadAudio` checks it (header, stream, first moments) but not decoded: for
    a model whose own feature extractor reads the file (Wan-Dancer's music features)."""

    def __init__(self):
        super().__init__(sample_rate=None)

    def __call__(self, path, context=None):
        path = os.fspath(path)
        self._known(path, context)
        return path

    def shape(self, path, context=None):
        return ("audio file",)


SHORTFALL_SECONDS = 0.1  # decoded audio may fall this much short of its header (encoder padding); padded with zeros


class LoadAudioClip(LoadAudio):
    """An audio file (or a clip's audio stream) -> float32 tensor (channels, samples) at `sample_rate` Hz, for a model
    that trains on the audio itself. Decoded by PyAV's FFmpeg and resampled with FFmpeg's libswresample
    (`media.audio.read_audio`). Mono is upmixed to stereo (`channels=2`) and stereo averaged to mono (`channels=1`),
    each with a note; more channels are refused. Audio over `max_seconds` is cut to it (a note), then to a whole
    number of `unit_seconds` (floor), the length the header promises, so that `shape` buckets files by it. Notes go
    through `log`, once per file; `max_flag` is the flag named in the cut note."""

    def __init__(self, sample_rate: int, channels: int = 2, max_seconds: float | None = None,
                 unit_seconds: float = 1.0, log=print, max_flag: str = "the longest length"):
        if sample_rate is None:
            raise DataError("audio clips need a sample rate")
        if channels not in (1, 2):
            raise DataError(f"audio channels {channels}: audio clips are mono (1) or stereo (2)")
        if not unit_seconds > 0:
            raise DataError(f"audio unit {unit_seconds} s: must be positive")
        if max_seconds is not None and max_seconds < unit_seconds:
            raise UserError(f"{max_flag} {max_seconds:g} s is shorter than the {unit_seconds:g} s of audio this model "
                            f"trains on")
        super().__init__(int(sample_rate), mono=channels == 1, min_seconds=unit_seconds)
        self.channels, self.unit_seconds, self.log, self.max_flag = channels, float(unit_seconds), log, max_flag
        self.max_seconds = None if max_seconds is None else float(max_seconds)
        self._noted: set[tuple[str, str]] = set()

    def _note(self, path: str, kind: str, text: str):
        if (path, kind) not in self._noted:
            self._noted.add((path, kind))
            self.log(f"note: {path}: {text}")

    def _count(self, seconds: float) -> int:
        return int(math.floor(seconds / self.unit_seconds + 1e-9))  # 1e-9: 0.3 / 0.1 is 2.9999...

    def _units(self, seconds: float, path: str, context, note: bool = True) -> int:
        """Whole units of `seconds`, after the cut to `max_seconds`; refuses audio shorter than one unit."""
        n = self._count(seconds)
        if self.max_seconds is not None and n > self._count(self.max_seconds):
            n = self._count(self.max_seconds)
            if note:  # only where the flag takes away audio the model would train on
                self._note(path, "cut", f"{seconds:.1f} s of audio, cut to {self.max_flag} {self.max_seconds:g} s")
        if n < 1:
            raise DataError(f"{_where(context)}: {seconds:.2f} s of audio, shorter than the {self.unit_seconds:g} s "
                            f"this model trains on: {path}")
        return n

    def _channel_rule(self, count: int, path: str, context):
        if count > 2:
            raise DataError(f"{_where(context)}: has {count} audio channels; this model takes mono or stereo: {path}")
        if count < self.channels:
            self._note(path, "channels", "mono audio, upmixed to stereo")
        elif count > self.channels:
            self._note(path, "channels", "stereo audio, averaged to mono")

    def _header(self, path: str, context):
        try:
            return probe_audio(path)
        except AudioError as err:
            self._fail(err, path, context)

    def __call__(self, path, context=None):
        import numpy as np
        import torch

        path = os.fspath(path)
        self._known(path, context)
        info = self._header(path, context)
        if info.channels:  # refused before decoding
            self._channel_rule(info.channels, path, context)
        rate, header = self.sample_rate, info.duration or None
        target = limit = None
        if header:
            target = round(self._units(header, path, context) * self.unit_seconds * rate)
            limit = target / rate + SHORTFALL_SECONDS  # a little past the cut: the resampler's tail is real audio
        try:
            wave = read_audio(path, rate, mono=False, max_seconds=limit)
        except AudioError as err:
            self._fail(err, path, context)
        self._channel_rule(wave.shape[0], path, context)
        if wave.shape[0] < self.channels:
            wave = np.repeat(wave, self.channels, axis=0)
        elif wave.shape[0] > self.channels:
            wave = wave.mean(axis=0, keepdims=True)
        if target is None:  # no duration in the header: as long as it decodes
            target = round(self._units(wave.shape[1] / rate, path, context) * self.unit_seconds * rate)
        missing = target - wave.shape[1]
        if missing > SHORTFALL_SECONDS * rate:
            raise DataError(f"{_where(context)}: its header gives {header:.2f} s of audio, only "
                            f"{wave.shape[1] / rate:.2f} s decode (header and content disagree): {path}")
        if missing > 0:  # the promised length, so that the bucket's shapes agree
            wave = np.pad(wave, ((0, 0), (0, missing)))
        return torch.from_numpy(np.ascontiguousarray(wave[:, :target], dtype=np.float32))

    def check(self, path, context=None):
        """As `LoadAudio.check` (header, an audio stream, its first moments), and the channel count and length."""
        path = os.fspath(path)
        self._known(path, context)
        try:
            info = check_audio(path)
        except AudioError as err:
            self._fail(err, path, context)
        if info.channels:
            self._channel_rule(info.channels, path, context)
        if info.duration:
            self._units(info.duration, path, context)
        return CHECKED

    def shape(self, path, context=None):
        """("audio", rate, channels, units) from the header; UNKNOWN where the header gives no duration."""
        path = os.fspath(path)
        self._known(path, context)
        info = self._header(path, context)
        if not info.duration:
            return UNKNOWN
        return ("audio", self.sample_rate, self.channels, self._units(info.duration, path, context, note=False))


class ToWaveform(DataOperator):
    """A waveform -> a float32 tensor (channels, samples), cut to a whole number of `step` samples (a latent step of
    the audio VAE) and to at most `max_samples`."""

    def __init__(self, step: int = 1, max_samples: int | None = None):
        self.step, self.max_samples = int(step), max_samples

    def __call__(self, wave, context=None):
        import numpy as np
        import torch

        wave = torch.from_numpy(np.ascontiguousarray(wave, dtype=np.float32))
        wave = wave[None] if wave.dim() == 1 else wave
        n = wave.shape[-1] if self.max_samples is None else min(wave.shape[-1], self.max_samples)
        n -= n % self.step
        if n <= 0:
            raise DataError(f"{_where(context)}: shorter than one latent step ({self.step} samples)")
        return wave[:, :n]


def audio_operator(base_path, sample_rate: int | None = 16000, mono: bool = True,
                   min_seconds: float = 0.0) -> DataOperator:
    """A path relative to the data set -> waveform (`LoadAudio`)."""
    return ToAbsolutePath(base_path) >> LoadAudio(sample_rate, mono, min_seconds)


def audio_clip_operator(base_path, sample_rate: int, channels: int = 2, max_seconds: float | None = None,
                        unit_seconds: float = 1.0, log=print, max_flag: str = "the longest length") -> DataOperator:
    """A path relative to the data set -> (channels, samples) float32 tensor (`LoadAudioClip`)."""
    return ToAbsolutePath(base_path) >> LoadAudioClip(sample_rate, channels, max_seconds, unit_seconds, log, max_flag)


def audio_path_operator(base_path) -> DataOperator:
    """A path relative to the data set -> the audio file's absolute path, checked (`AudioPath`)."""
    return ToAbsolutePath(base_path) >> AudioPath()


__all__ = ["AUDIO_SOURCE_EXTENSIONS", "AudioPath", "LoadAudio", "LoadAudioClip", "ToWaveform", "audio_clip_operator",
           "audio_operator", "audio_path_operator"]
