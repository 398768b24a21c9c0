"""Small audio files for tests, written with PyAV: tones in WAV / FLAC / MP3 / ..., and clips with an audio track."""

from __future__ import annotations

import os
import wave as wavfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image

# extension -> (codec, sample format the encoder takes)
_CODECS = {".wav": ("pcm_s16le", "s16"), ".flac": ("flac", "s16"), ".mp3": ("libmp3lame", "fltp"),
           ".ogg": ("libopus", "flt"), ".m4a": ("aac", "fltp")}


def tone(frequencies: Sequence[float] = (440.0,), seconds: float = 0.5, rate: int = 44100,
         amplitudes: Sequence[float] | None = None) -> np.ndarray:
    """(channels, samples) float32: one sine per channel."""
    t = np.arange(int(round(seconds * rate))) / rate
    amplitudes = amplitudes or [0.5] * len(frequencies)
    return np.stack([a * np.sin(2 * np.pi * f * t) for f, a in zip(frequencies, amplitudes)]).astype(np.float32)


def _encode(out, stream, wave: np.ndarray, rate: int, fmt: str) -> None:
    import av

    layout = {1: "mono", 2: "stereo"}[wave.shape[0]]
    if fmt == "s16":  # packed: one row of interleaved samples
        data = (np.clip(wave, -1, 1).T.reshape(1, -1) * 32767).astype(np.int16)
    elif fmt == "flt":
        data = np.ascontiguousarray(wave.T.reshape(1, -1), dtype=np.float32)
    else:
        data = np.ascontiguousarray(wave, dtype=np.float32)
    frame_size = stream.codec_context.frame_size or wave.shape[1]
    packed = wave.shape[0] if fmt in ("s16", "flt") else 1  # packed formats interleave the channels in one row
    for start in range(0, wave.shape[1], frame_size):  # encoders with a fixed frame size take one at a time
        part = data[:, start * packed:(start + frame_size) * packed]
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(part), format=fmt, layout=layout)
        frame.sample_rate, frame.pts = rate, start
        for packet in stream.encode(frame):
            out.mux(packet)
    for packet in stream.encode(None):
        out.mux(packet)


def write_audio(path: str | os.PathLike, wave: np.ndarray, rate: int = 44100) -> Path:
    """(channels, samples) float32 in [-1, 1] -> an audio file, its codec by extension (.wav, .flac, .mp3, ...)."""
    import av

    path = Path(path)
    codec, fmt = _CODECS[path.suffix.lower()]
    wave = np.asarray(wave, np.float32)
    wave = wave[None] if wave.ndim == 1 else wave
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = {1: "mono", 2: "stereo"}[wave.shape[0]]
        _encode(out, stream, wave, rate, fmt)
    return path


def write_clip_with_audio(path: str | os.PathLike, frames: Sequence[Image.Image], wave: np.ndarray | None,
                          fps: int = 16, rate: int = 16000) -> Path:
    """An mp4 (mpeg4 video) with an AAC audio track of `wave` ((channels, samples) float32), or none."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        video = out.add_stream("mpeg4", rate=fps)
        video.width, video.height = frames[0].size
        video.pix_fmt = "yuv420p"
        audio = None
        if wave is not None:
            wave = np.asarray(wave, np.float32)
            wave = wave[None] if wave.ndim == 1 else wave
            audio = out.add_stream("aac", rate=rate)
            audio.layout = {1: "mono", 2: "stereo"}[wave.shape[0]]
        for img in frames:
            for packet in video.encode(av.VideoFrame.from_image(img.convert("RGB"))):
                out.mux(packet)
        for packet in video.encode(None):
            out.mux(packet)
        if audio is not None:
            _encode(out, audio, wave, rate, "fltp")
    return path


def write_wav(path, samples: np.ndarray, rate: int = 16000):
    """(samples, channels) float in [-1, 1] -> 16-bit PCM WAV (the stdlib writer: any channel count)."""
    data = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    with wavfile.open(str(path), "wb") as w:
        w.setnchannels(samples.shape[1])
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(data.tobytes())
    return path


def write_float_wav(path, samples: np.ndarray, rate: int = 16000):
    """(samples, channels) float32 -> an IEEE-float WAV (format 3), written by hand: NaN samples stay NaN."""
    import struct

    data = np.ascontiguousarray(samples, dtype="<f4").tobytes()
    ch = samples.shape[1]
    fmt = struct.pack("<HHIIHH", 3, ch, rate, rate * ch * 4, ch * 4, 32)
    with open(path, "wb") as f:
        f.write(b"RIFF" + struct.pack("<I", 4 + 8 + len(fmt) + 8 + len(data)) + b"WAVE")
        f.write(b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data)
    return path


__all__ = ["tone", "write_audio", "write_clip_with_audio", "write_float_wav", "write_wav"]
