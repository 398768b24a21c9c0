"""Validation of an audio family: each prompt's audio beside a picture of its waveform over its spectrogram, and the
audio in every tracker that takes it (TensorBoard's add_audio, W&B's and SwanLab's Audio)."""

from __future__ import annotations

import sys
import types

import numpy as np
from PIL import Image

from difftune.core.target import AudioFiles, AudioStream
from difftune.media.audio import read_audio, spectrogram_picture
from difftune.training.trackers import log_media

RATE = 8000


def _tones():
    t = np.arange(RATE) / RATE
    return [np.stack([np.sin(2 * np.pi * f * t)] * 2).astype(np.float32) * 0.5 for f in (440, 1760)]


def test_the_preview_writes_each_prompts_audio_and_a_waveform_over_a_spectrogram(tmp_path):
    stream = AudioStream(sample_rate=RATE, audio_channels=2)
    grid, media = stream.preview(_tones(), tmp_path / "step-000003.png")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003-0.wav", "step-000003-1.wav",
                                                          "step-000003.png"]
    assert isinstance(media, AudioFiles) and media.sample_rate == RATE and len(media.paths) == 2
    back = read_audio(media.paths[1], RATE, mono=False)
    assert back.shape == (2, RATE) and abs(np.abs(back).max() - 0.5) < 1e-3
    # two rows of a 96 px waveform per channel (stereo) over a 128 px spectrogram
    assert grid.size == (512, 2 * (2 * 96 + 128))


def test_the_spectrogram_shows_the_tone_where_its_frequency_is():
    rows = []
    for tone in _tones():
        picture = np.asarray(spectrogram_picture(tone, RATE, width=64, height=256)).astype(float).sum(axis=(1, 2))
        rows.append(int(np.argmax(picture)))  # the brightest row: the tone (row 0 is the top: high frequencies)
    low, high = rows
    assert high < low  # 1760 Hz sits above 440 Hz
    assert abs((255 - low) / 255 * RATE / 2 - 440) < 80 and abs((255 - high) / 255 * RATE / 2 - 1760) < 80


class _Writer:
    def __init__(self):
        self.calls = []

    def add_image(self, tag, *args, **kwargs):
        self.calls.append(("image", tag))

    def add_audio(self, tag, sound, step, sample_rate):
        self.calls.append(("audio", tag, tuple(sound.shape), sample_rate, float(sound.abs().max())))


class _Tracker:
    def __init__(self, name):
        self.name, self.writer, self.logged = name, _Writer(), []

    def log(self, entries, step):
        self.logged.append((step, entries))


def _fake_service(name, monkeypatch):
    module = types.SimpleNamespace(Image=lambda g: ("image", g.size),
                                   Audio=lambda path, sample_rate: ("audio", path.rsplit("/", 1)[-1], sample_rate),
                                   Video=lambda path, **kw: ("video", path))
    monkeypatch.setitem(sys.modules, name, module)


def test_every_tracker_that_takes_audio_gets_each_prompts_audio(tmp_path, monkeypatch):
    for name in ("wandb", "swanlab"):
        _fake_service(name, monkeypatch)
    _, media = AudioStream(sample_rate=RATE, audio_channels=2).preview(_tones(), tmp_path / "step-000005.png")
    trackers = [_Tracker("tensorboard"), _Tracker("wandb"), _Tracker("swanlab")]
    log_media(types.SimpleNamespace(trackers=trackers), Image.new("RGB", (8, 8)), 5, media)
    tensorboard = trackers[0].writer.calls
    assert tensorboard[0] == ("image", "validation")
    assert [c[:4] for c in tensorboard[1:]] == [("audio", "validation_audio/0", (1, RATE), RATE),
                                                ("audio", "validation_audio/1", (1, RATE), RATE)]
    assert all(abs(c[4] - 0.5) < 1e-3 for c in tensorboard[1:])
    for tracker in trackers[1:]:
        ((step, entries),) = tracker.logged
        assert step == 5 and entries["validation"] == ("image", (8, 8))
        assert entries["validation_audio_1"] == ("audio", "step-000005-1.wav", RATE)


def test_a_clip_animation_still_goes_to_wandb_as_a_video(tmp_path, monkeypatch):
    _fake_service("wandb", monkeypatch)
    tracker = _Tracker("wandb")
    log_media(types.SimpleNamespace(trackers=[tracker]), Image.new("RGB", (8, 8)), 1, tmp_path / "a.gif")
    assert tracker.logged[0][1]["validation_clip"] == ("video", str(tmp_path / "a.gif"))
