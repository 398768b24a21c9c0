"""Audio as float32 waveforms: decoding audio files and a video file's audio stream with PyAV's bundled FFmpeg.

`read_audio(path, sample_rate=16000)` gives what the reference's audio loader (`librosa.load(path, sr=16000)`)
gives: the channels averaged to mono, then resampled to `sample_rate`, as a 1-D float32 array in [-1, 1]. The
resampler is FFmpeg's (libswresample) rather than librosa's soxr, so values differ by resampling round-off;
the timing (first sample at t = 0, length round(n * rate_out / rate_in)) is the same. `mono=False` keeps the
channels, (channels, samples), for the audio-video families.

Every file that cannot give audio raises `AudioError`, whose message is one line: what is wrong, then the path.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from ..errors import UserError
from ..util import file_problem

AUDIO_EXTENSIONS = (".wav", ".mp3", ".flac", ".ogg", ".oga", ".opus", ".m4a", ".aac", ".wma")
TRUNCATED_SHARE = 0.9  # decoding less than this share of the duration the header gives: a cut-off file


class AudioError(UserError):
    """Audio that cannot be read. `reason` is the problem without the path (the data set puts the row in
    front of it); the message is `reason: path`."""

    def __init__(self, reason: str, path: str = ""):
        self.reason, self.path = " ".join(str(reason).split()), os.fspath(path)
        super().__init__(f"{self.reason}: {self.path}" if self.path else self.reason)


class AudioInfo(NamedTuple):
    sample_rate: int
    channels: int
    duration: float | None  # seconds, as the header says; None where it does not
    codec: str


def _av():
    from .video import _av as load

    return load()


def _reason(err: BaseException) -> str:
    from .video import _ffmpeg_reason  # PyAV's error text, as the video reader words it

    return _ffmpeg_reason(err)


def _open(path: str):
    """(container, its first audio stream); AudioError for whatever keeps the audio from being decoded."""
    av = _av()
    problem = file_problem(path)
    if problem:
        raise AudioError(problem, path)
    short = _wav_shortfall(path)
    if short:
        raise AudioError(f"truncated audio: its WAV header declares {short[0]} bytes of samples, "
                         f"only {short[1]} are in the file", path)
    try:
        container = av.open(path)
    except (av.error.FFmpegError, OSError, ValueError, EOFError) as err:
        raise AudioError(f"unreadable or corrupt audio ({_reason(err)})", path) from None
    if not container.streams.audio:
        what = "only video" if container.streams.video else "no stream at all"
        container.close()
        raise AudioError(f"no audio stream (the file holds {what})", path)
    stream = container.streams.audio[0]
    if stream.codec_context is None:
        container.close()
        raise AudioError("unreadable codec (the FFmpeg bundled with PyAV has no decoder for this audio)", path)
    return container, stream


def _wav_shortfall(path: str) -> tuple[int, int] | None:
    """(bytes the WAV header's data chunk declares, bytes present) when the file is cut short of its data
    chunk (FFmpeg then estimates the duration from the file size, so the header check below cannot see it)."""
    import struct

    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
            return None
        while True:
            chunk = f.read(8)
            if len(chunk) < 8:
                return None
            name, size = chunk[:4], struct.unpack("<I", chunk[4:])[0]
            if name == b"data":
                present = os.path.getsize(path) - f.tell()
                # 0 and 0xFFFFFFFF: written while streaming, size unknown
                return (size, present) if 0 < size < 0xFFFFFFFF and present < size else None
            f.seek(size + (size & 1), 1)


def _duration(container, stream) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def probe_audio(path: str | os.PathLike) -> AudioInfo:
    """Sample rate, channels, duration and codec from the header (no decoding)."""
    path = os.fspath(path)
    container, stream = _open(path)
    with container:
        cc = stream.codec_context
        return AudioInfo(int(cc.sample_rate or 0), int(cc.channels or 0), _duration(container, stream), cc.name)


def _channels(frame) -> np.ndarray:
    """A packed float frame -> (channels, samples)."""
    return frame.to_ndarray().reshape(-1, len(frame.layout.channels)).T


def _decode(path: str, max_seconds: float | None) -> tuple[np.ndarray, int]:
    """The first audio stream as float32 (channels, samples) at its own rate."""
    av = _av()
    container, stream = _open(path)
    chunks: list[np.ndarray] = []
    rate = int(stream.codec_context.sample_rate or 0)
    # every decoded frame to packed float32 in its own layout and rate (so the mixing below is ours); packed, one
    # plane: PyAV's planar frames of 8 or more channels crash in to_ndarray (FFmpeg keeps only 8 plane pointers)
    to_float = av.AudioResampler(format="flt")
    decoded = 0
    with container:
        header = _duration(container, stream)
        try:
            for frame in container.decode(stream):
                rate = frame.sample_rate or rate
                for out in to_float.resample(frame):
                    chunks.append(_channels(out))
                    decoded += out.samples
                if max_seconds is not None and rate and decoded >= max_seconds * rate:
                    break
        except (av.error.FFmpegError, OSError, ValueError, EOFError) as err:
            raise AudioError(f"corrupt audio: decoding stopped after {decoded / max(rate, 1):.2f} s "
                             f"({_reason(err)})", path) from None
        else:
            if max_seconds is None:
                for out in to_float.resample(None):
                    chunks.append(_channels(out))
    if not chunks or sum(c.shape[1] for c in chunks) == 0:
        raise AudioError("no audio (the stream decodes to no samples)", path)
    wave = np.concatenate(chunks, axis=1).astype(np.float32, copy=False)
    bad = ~np.isfinite(wave)
    if bad.any():  # float WAVs can hold NaN; they would reach the loss as NaN features
        first = int(np.argmax(bad.any(axis=0)))
        raise AudioError(f"{int(bad.any(axis=0).sum())} non-finite sample(s) (NaN or infinite) at "
                         f"{first / rate:.3f} s", path)
    seconds = wave.shape[1] / rate
    if max_seconds is None and header and seconds < TRUNCATED_SHARE * header:
        raise AudioError(f"truncated audio: its header gives {header:.2f} s, only {seconds:.2f} s decode", path)
    return wave, rate


def resample(wave: np.ndarray, rate: int, target: int) -> np.ndarray:
    """(channels, samples) float32 from `rate` to `target` Hz with FFmpeg's resampler (libswresample), its
    output aligned to the input's start and flushed, so the length is round(samples * target / rate)."""
    if rate == target:
        return wave
    av = _av()
    channels = wave.shape[0]
    layout = {1: "mono", 2: "stereo"}.get(channels)
    if layout is None:  # resample channel by channel (any channel count)
        return np.stack([resample(wave[c:c + 1], rate, target)[0] for c in range(channels)])
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=target)
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(wave, dtype=np.float32), format="fltp", layout=layout)
    frame.sample_rate = rate
    parts = [f.to_ndarray().reshape(channels, -1) for f in resampler.resample(frame)]
    parts += [f.to_ndarray().reshape(channels, -1) for f in resampler.resample(None)]
    out = np.concatenate(parts, axis=1) if parts else np.zeros((channels, 0), np.float32)
    want = int(round(wave.shape[1] * target / rate))
    if out.shape[1] < want:
        out = np.pad(out, ((0, 0), (0, want - out.shape[1])))
    return np.ascontiguousarray(out[:, :want], dtype=np.float32)


def read_audio(path: str | os.PathLike, sample_rate: int | None = 16000, mono: bool = True,
               max_seconds: float | None = None) -> np.ndarray:
    """The first audio stream of an audio file or a video file: mono (the channels averaged, as librosa does)
    1-D float32, or (channels, samples) with `mono=False`; resampled to `sample_rate` (None: the file's own rate).
    `max_seconds`: decode only the start. AudioError for a file that gives no audio."""
    path = os.fspath(path)
    if sample_rate is not None and int(sample_rate) <= 0:
        raise UserError(f"audio sample rate must be positive, got {sample_rate}")
    wave, rate = _decode(path, max_seconds)
    if mono:
        wave = wave.mean(axis=0, keepdims=True)
    if sample_rate is not None:
        wave = resample(wave, rate, int(sample_rate))
    if max_seconds is not None:
        wave = wave[:, :int(round(max_seconds * (sample_rate or rate)))]
    return wave[0] if mono else wave


def check_audio(path: str | os.PathLike) -> AudioInfo:
    """The cheap check the data set runs on every row before training: the header parses, an audio stream with
    a decoder is there, and its first moments decode."""
    path = os.fspath(path)
    info = probe_audio(path)
    _decode(path, max_seconds=0.1)
    return info


WRITABLE_AUDIO_EXTENSIONS = (".wav", ".flac")


def write_audio(wave, path: str | os.PathLike, sample_rate: int) -> str:
    """A waveform ((channels, samples) or 1-D, in [-1, 1]) as a 16-bit WAV or FLAC (by extension), atomically."""
    import soundfile

    from ..io import atomic_write

    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in WRITABLE_AUDIO_EXTENSIONS:
        raise UserError(f"{path}: audio is written as {'/'.join(WRITABLE_AUDIO_EXTENSIONS)}, not "
                        f"'{ext or '(no extension)'}'")
    data = np.clip(np.asarray(wave, dtype=np.float32), -1, 1)
    data = data.T if data.ndim == 2 else data  # soundfile takes (samples, channels)
    fmt = "FLAC" if ext == ".flac" else "WAV"
    atomic_write(path, lambda tmp: soundfile.write(str(tmp), data, int(sample_rate), subtype="PCM_16", format=fmt))
    return os.fspath(path)


def waveform_picture(wave, width: int = 512, height: int = 96):
    """A waveform as a picture (its min and max per column, each channel a band): what validation shows of audio."""
    from PIL import Image, ImageDraw

    data = np.asarray(wave, dtype=np.float32)
    data = data.reshape(1, -1) if data.ndim == 1 else data
    picture = Image.new("RGB", (width, height * len(data)), "white")
    draw = ImageDraw.Draw(picture)
    for c, channel in enumerate(data):
        cols = np.array_split(np.clip(channel, -1, 1), width) if channel.size >= width else [channel] * width
        mid = c * height + height / 2
        for x, col in enumerate(cols):
            lo, hi = (float(col.min()), float(col.max())) if col.size else (0.0, 0.0)
            draw.line([(x, mid - hi * height / 2), (x, mid - lo * height / 2)], fill=(40, 90, 200))
    return picture


def spectrogram_picture(wave, sample_rate: int, width: int = 512, height: int = 128, window: int = 1024):
    """The channels' mean as a log-magnitude spectrogram (low frequencies at the bottom, 80 dB of range): what
    validation shows of music beside its waveform."""
    from PIL import Image

    data = np.asarray(wave, dtype=np.float32)
    mono = data.mean(axis=0) if data.ndim == 2 else data.reshape(-1)
    window = max(16, min(window, 1 << int(np.log2(max(mono.size, 16)))))
    hop = max(1, (mono.size - window) // max(1, width - 1)) if mono.size > window else 1
    starts = np.arange(0, max(1, mono.size - window + 1), hop)[:width]
    frames = np.stack([np.pad(mono[s:s + window], (0, max(0, window - mono[s:s + window].size))) for s in starts])
    power = np.abs(np.fft.rfft(frames * np.hanning(window), axis=1)) ** 2
    db = 10 * np.log10(power + 1e-10)
    db = np.clip((db - (db.max() - 80)) / 80, 0, 1).T[::-1]  # (frequency, time), high frequencies on top
    colours = np.stack([db ** 0.5, db ** 1.5, 0.4 + 0.6 * db * (1 - db)], axis=-1)  # dark blue -> yellow-white
    picture = Image.fromarray((colours * 255).astype(np.uint8), "RGB")
    return picture.resize((width, height), Image.BILINEAR)


__all__ = ["AUDIO_EXTENSIONS", "WRITABLE_AUDIO_EXTENSIONS", "spectrogram_picture", "waveform_picture", "write_audio", "AudioError", "AudioInfo", "check_audio", "probe_audio", "read_audio", "resample"]
