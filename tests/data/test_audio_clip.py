"""`LoadAudioClip`: audio a model trains on as (channels, samples) float32 at its rate, cut to whole units as the
header promises (`shape` buckets by it), with one-line refusals naming the file and one note per file."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

import difftune.data.audio as data_audio
from difftune.data.audio import LoadAudioClip, audio_clip_operator
from difftune.data.operators import CHECKED, UNKNOWN, DataError, Seconds
from difftune.errors import UserError
from difftune.media.audio import AudioInfo, probe_audio, write_audio
from support.audio import write_clip_with_audio

RATE = 48000
CONTEXT = {"where": "metadata.csv row 2", "key": "audio"}


def sine(seconds, rate, channels=2, freq=1000.0, amplitude=0.3):
    t = np.arange(int(round(seconds * rate))) / rate
    wave = amplitude * np.sin(2 * np.pi * freq * t)
    return np.stack([wave * (1 - 0.2 * c) for c in range(channels)]).astype(np.float32)


def encode(path, wave, rate, codec):
    """A lossy file written with PyAV (float input, packed or planar as the encoder takes it)."""
    import av

    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=rate)
        stream.layout = "stereo"
        fmt = next(f.name for f in stream.codec_context.codec.audio_formats if f.name in ("fltp", "flt"))
        stream.format = fmt
        size = stream.codec_context.frame_size or 1024
        for start in range(0, wave.shape[1], size):
            part = wave[:, start:start + size]
            part = part if fmt.endswith("p") else part.T.reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(part, np.float32), format=fmt, layout="stereo")
            frame.sample_rate, frame.pts = rate, start
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    return str(path)


class Log(list):
    def __call__(self, text):
        self.append(text)


def clip(**kw):
    log = Log()
    return LoadAudioClip(RATE, log=log, **{"max_flag": "--max_audio_duration", **kw}), log


def refusal(fn, *args) -> str:
    with pytest.raises(DataError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("metadata.csv row 2 'audio': "), msg
    return msg


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("clips")


def test_stereo_44k_wav_is_resampled_and_cut_to_whole_seconds(root):
    path = write_audio(sine(2.5, 44100), root / "a.wav", 44100)
    op, log = clip()
    assert op.check(path, dict(CONTEXT)) is CHECKED
    wave = op(path, dict(CONTEXT))
    assert isinstance(wave, torch.Tensor) and wave.dtype == torch.float32 and wave.shape == (2, 96000)
    assert op.shape(path, CONTEXT) == ("audio", RATE, 2, 2)
    assert op.extent(path, CONTEXT) == Seconds(2.5)
    assert log == []


def test_flac_at_48k(root):
    path = write_audio(sine(3.2, RATE), root / "b.flac", RATE)
    op, _ = clip()
    assert op(path).shape == (2, 144000) and op.shape(path) == ("audio", RATE, 2, 3)


def test_resampling_keeps_a_1khz_sine_at_1khz(root):
    path = write_audio(sine(2.0, 44100, channels=1), root / "tone.wav", 44100)
    op, _ = clip(channels=1)
    wave = op(path)[0].numpy()
    spectrum = np.abs(np.fft.rfft(wave * np.hanning(len(wave))))
    peak = np.fft.rfftfreq(len(wave), 1 / RATE)[int(np.argmax(spectrum))]
    assert abs(peak - 1000.0) <= 0.5, peak


def test_mono_is_upmixed_with_one_note(root):
    path = write_audio(sine(1.5, RATE, channels=1), root / "mono.wav", RATE)
    op, log = clip()
    op.check(path, dict(CONTEXT))
    wave = op(path, dict(CONTEXT))
    op(path, dict(CONTEXT))
    assert wave.shape == (2, RATE) and torch.equal(wave[0], wave[1]) and wave.abs().max() > 0.2
    assert log == [f"note: {path}: mono audio, upmixed to stereo"]


def test_stereo_is_averaged_for_a_mono_model(root):
    path = write_audio(sine(1.0, RATE), root / "st.wav", RATE)
    op, log = clip(channels=1)
    both = LoadAudioClip(RATE, log=Log())(path)
    wave = op(path)
    assert wave.shape == (1, RATE) and torch.allclose(wave[0], both.mean(0), atol=1e-6)
    assert log == [f"note: {path}: stereo audio, averaged to mono"]
    assert op.shape(path) == ("audio", RATE, 1, 1)


def test_eight_channels_are_refused(root):
    path = write_audio(np.tile(sine(1.2, RATE, channels=1), (8, 1)), root / "surround.wav", RATE)
    op, _ = clip()
    for fn in (op.check, op):
        msg = refusal(fn, path, dict(CONTEXT))
        assert msg.endswith(f"has 8 audio channels; this model takes mono or stereo: {path}"), msg


def test_shorter_than_one_unit_is_refused(root):
    path = write_audio(sine(0.4, 44100), root / "short.wav", 44100)
    op, _ = clip()
    for fn in (op.check, op, op.shape):
        msg = refusal(fn, path, dict(CONTEXT))
        assert msg.endswith(f"0.40 s of audio, shorter than the 1 s this model trains on: {path}"), msg


def test_longer_than_max_seconds_is_cut_with_one_note(root):
    path = write_audio(sine(3.0, RATE, amplitude=0.01), root / "long.wav", RATE)
    op, log = clip(max_seconds=2)
    op.check(path)
    assert op.shape(path) == ("audio", RATE, 2, 2)
    assert op(path).shape == (2, 96000) and op(path).shape == (2, 96000)
    assert log == [f"note: {path}: 3.0 s of audio, cut to --max_audio_duration 2 s"]
    other, log = clip(max_seconds=2.5, max_flag="--max_seconds")
    assert other(path).shape == (2, 96000)
    assert log == [f"note: {path}: 3.0 s of audio, cut to --max_seconds 2.5 s"]
    # a cut the unit rounding makes anyway is not worth a note
    quiet, log = clip(max_seconds=2.5)
    assert quiet(write_audio(sine(2.7, RATE), root / "2.7.wav", RATE)).shape == (2, 96000) and log == []


def test_cut_and_random_files_are_refused_in_one_line(root):
    whole = write_audio(sine(2.0, RATE), root / "whole.wav", RATE)
    cut = root / "cut.wav"
    data = open(whole, "rb").read()
    cut.write_bytes(data[:len(data) // 2])
    noise = root / "noise.wav"
    noise.write_bytes(np.random.default_rng(0).bytes(4096))
    op, _ = clip()
    for path, why in ((cut, "truncated audio"), (noise, "unreadable or corrupt audio")):
        for fn in (op.check, op):
            msg = refusal(fn, str(path), dict(CONTEXT))
            assert why in msg and msg.endswith(str(path)), msg


def test_no_audio_stream_is_refused(root):
    frames = [Image.new("RGB", (32, 32), (60 * i, 0, 0)) for i in range(4)]
    path = str(write_clip_with_audio(root / "silent.mp4", frames, None, 16))
    op, _ = clip()
    for fn in (op.check, op):
        assert "no audio stream" in refusal(fn, path, dict(CONTEXT))


def test_equal_buckets_load_to_equal_shapes(root):
    op, _ = clip()
    lengths = {"x22.wav": (2.2, 44100), "x29.flac": (2.9, RATE), "x10.wav": (1.0, 44100), "x31.wav": (3.1, 22050)}
    shapes = {}
    for name, (seconds, rate) in lengths.items():
        path = write_audio(sine(seconds, rate), root / name, rate)
        key, wave = op.shape(path), op(path)
        assert key == ("audio", RATE, 2, int(seconds)) and wave.shape == (2, key[3] * RATE), (name, key, wave.shape)
        shapes[name] = (key, wave.shape)
    assert shapes["x22.wav"] == shapes["x29.flac"]


@pytest.mark.parametrize("codec, ext, rate", [
    ("libmp3lame", ".mp3", 44100), ("libmp3lame", ".mp3", 48000),
    ("libvorbis", ".ogg", 44100), ("libvorbis", ".ogg", 48000),
    ("libopus", ".opus", 48000),
])
def test_lossy_files_load_to_the_promised_shape(root, codec, ext, rate):
    import av

    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV build has no {codec} encoder")
    op, _ = clip()
    for seconds in (2.2, 2.996):  # opus's header gives 3.0025 s for 2.996 s: 4 ms of zeros fill the last unit
        path = encode(root / f"l{rate}_{seconds}{ext}", sine(seconds, rate), rate, codec)
        key = op.shape(path)
        assert op.check(path) is CHECKED
        wave = op(path)
        units = int(probe_audio(path).duration)
        assert key == ("audio", RATE, 2, units) and wave.shape == (2, units * RATE), (key, wave.shape)
        assert wave[:, RATE // 2:RATE].abs().max() > 0.1  # the tone, not padding


def _header(monkeypatch, duration):
    real = data_audio.probe_audio

    def probe(path):
        info = real(path)
        return AudioInfo(info.sample_rate, info.channels, duration, info.codec)

    monkeypatch.setattr(data_audio, "probe_audio", probe)


def test_a_little_short_of_the_header_is_padded(root, monkeypatch):
    path = write_audio(sine(1.97, RATE), root / "padded.wav", RATE)
    _header(monkeypatch, 2.0)
    op, _ = clip()
    wave = op(path)
    assert op.shape(path) == ("audio", RATE, 2, 2) and wave.shape == (2, 96000)
    assert wave[:, -1000:].abs().max() == 0 and wave[:, 90000:94000].abs().max() > 0.1


def test_far_short_of_the_header_is_refused(root, monkeypatch):
    path = write_audio(sine(2.5, RATE), root / "liar.wav", RATE)
    _header(monkeypatch, 3.0)
    op, _ = clip()
    msg = refusal(op, path, dict(CONTEXT))
    assert "its header gives 3.00 s of audio, only 2.50 s decode (header and content disagree)" in msg, msg
    assert msg.endswith(path)


def test_no_duration_in_the_header(root, monkeypatch):
    path = write_audio(sine(2.5, RATE), root / "streamed.wav", RATE)
    _header(monkeypatch, None)
    op, _ = clip()
    assert op.shape(path) is UNKNOWN
    assert op(path).shape == (2, 96000)


def test_the_operator_resolves_the_data_set_path(root):
    write_audio(sine(1.2, RATE), root / "rel.wav", RATE)
    log = Log()
    op = audio_clip_operator(str(root), RATE, channels=2, max_seconds=None, unit_seconds=0.5, log=log)
    context = dict(CONTEXT)
    assert op("rel.wav", context).shape == (2, RATE) and context["file"] == os.path.join(str(root), "rel.wav")
    assert op.shape("rel.wav", dict(CONTEXT)) == ("audio", RATE, 2, 2)


def test_settings_are_checked():
    with pytest.raises(UserError, match="--max_audio_duration 0.5 s is shorter than the 1 s"):
        LoadAudioClip(RATE, max_seconds=0.5, max_flag="--max_audio_duration")
    with pytest.raises(DataError, match="mono \\(1\\) or stereo \\(2\\)"):
        LoadAudioClip(RATE, channels=6)
