"""Audio data operators: an audio file, or a video file's audio stream -> a float32 waveform, with the row and
file named in every error (`media.audio.read_audio`: mono, resampled, as the reference's `LoadAudio(sr=16000)`).

Family-free: a family names its audio columns and rate (Wan2.2-S2V's `input_audio` at 16 kHz); the
audio-video families read theirs through the same operator.
"""

from __future__ import annotations

import os

from ..media.audio import AUDIO_EXTENSIONS, AudioError, check_audio, probe_audio, read_audio
from ..media.video import VIDEO_EXTENSIONS
from .operators import CHECKED, DataError, DataOperator, Seconds, ToAbsolutePath, _where

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


def audio_path_operator(base_path) -> DataOperator:
    """A path relative to the data set -> the audio file's absolute path, checked (`AudioPath`)."""
    return ToAbsolutePath(base_path) >> AudioPath()


__all__ = ["AUDIO_SOURCE_EXTENSIONS", "AudioPath", "LoadAudio", "ToWaveform", "audio_operator", "audio_path_operator"]
