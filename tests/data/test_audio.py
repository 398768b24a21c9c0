"""The audio data path: audio files and a clip's audio stream as mono 16 kHz float32 waveforms, and one-line
errors naming the file for every file that gives no audio."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from difftune.data.audio import LoadAudio, audio_operator
from difftune.data.operators import CHECKED, DataError
from difftune.media.audio import AudioError, check_audio, probe_audio, read_audio
from support.audio import tone, write_audio, write_clip_with_audio, write_float_wav, write_wav


def expected(n, rate=16000, parts=((440.0, 0.5), (660.0, 0.3))):
    """The stereo tone averaged to mono, sampled at `rate` (what resampling the file must give)."""
    t = np.arange(n) / rate
    return sum(a * np.sin(2 * np.pi * f * t) for f, a in parts) / len(parts)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("audio")
    stereo = tone((440.0, 660.0), seconds=0.5, rate=44100, amplitudes=(0.5, 0.3))
    out = {ext: write_audio(root / f"tone{ext}", stereo, 44100) for ext in (".wav", ".flac", ".mp3")}
    frames = [Image.new("RGB", (32, 32), (40 * i, 0, 0)) for i in range(5)]
    out["clip"] = write_clip_with_audio(root / "clip.mp4", frames, tone((300.0,), seconds=0.3125, rate=16000), 16)
    out["silent_clip"] = write_clip_with_audio(root / "silent.mp4", frames, None, 16)
    out["root"] = root
    return out


@pytest.mark.parametrize("ext", [".wav", ".flac"])
def test_lossless_files_resample_to_the_tone(files, ext):
    wave = read_audio(files[ext], 16000)
    assert wave.dtype == np.float32 and wave.ndim == 1
    assert len(wave) == 8000  # 0.5 s at 16 kHz
    ref = expected(len(wave))
    # the resampler's filter settles within a few samples of the ends; inside, the tone to 16-bit round-off
    assert np.abs(wave - ref)[64:-64].max() < 2e-4
    assert np.abs(wave - ref).max() < 0.05


def test_mp3_decodes_to_the_tone(files):
    wave = read_audio(files[".mp3"], 16000)
    ref = expected(len(wave))
    assert abs(len(wave) - 8000) <= 1200  # an MP3 frame of encoder padding at most
    # lossy: compare the shape of the signal, not the samples
    inner = slice(1600, 6400)
    corr = np.corrcoef(wave[inner], ref[inner])[0, 1]
    assert corr > 0.98, corr


def test_channels_kept_and_native_rate(files):
    wave = read_audio(files[".wav"], None, mono=False)
    assert wave.shape == (2, 22050)
    t = np.arange(22050) / 44100
    assert np.abs(wave[0] - 0.5 * np.sin(2 * np.pi * 440 * t)).max() < 1e-4
    assert np.abs(wave[1] - 0.3 * np.sin(2 * np.pi * 660 * t)).max() < 1e-4
    assert probe_audio(files[".flac"])[:2] == (44100, 2)


def test_a_clips_audio_stream(files):
    wave = read_audio(files["clip"], 16000)
    assert wave.dtype == np.float32 and 4000 <= len(wave) <= 7000
    t = np.arange(len(wave)) / 16000
    inner = slice(1200, 4000)
    assert np.corrcoef(wave[inner], 0.5 * np.sin(2 * np.pi * 300 * t[inner]))[0, 1] > 0.95


def _bad_files(root, files):
    data = files[".wav"].read_bytes()
    (root / "cut.wav").write_bytes(data[: len(data) // 3])
    flac = files[".flac"].read_bytes()
    (root / "cut.flac").write_bytes(flac[: 2 * len(flac) // 3])
    mp3 = files[".mp3"].read_bytes()
    (root / "cut.mp3").write_bytes(mp3[: len(mp3) // 3])
    (root / "noise.wav").write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    (root / "empty.flac").write_bytes(b"")
    (root / "folder.wav").mkdir(exist_ok=True)
    return {
        "cut.wav": "truncated audio: its WAV header declares",
        "cut.flac": "corrupt audio: decoding stopped after",
        "cut.mp3": "truncated audio: its header gives",
        "noise.wav": "unreadable or corrupt audio",
        "empty.flac": "file is empty (0 bytes)",
        "folder.wav": "is a folder, not a file",
        "missing.wav": "file not found",
        "silent.mp4": "no audio stream (the file holds only video)",
    }


def test_bad_files_are_one_line_naming_the_file(files):
    root = files["root"]
    for name, reason in _bad_files(root, files).items():
        path = root / name
        with pytest.raises(AudioError) as err:
            read_audio(path)
        message = str(err.value)
        assert "\n" not in message and message.startswith(reason) and message.endswith(str(path)), message


def test_operator_names_row_and_column(files):
    root = files["root"]
    _bad_files(root, files)
    op = audio_operator(root)
    context = {"where": "row 3", "key": "input_audio"}
    wave = op("tone.wav", dict(context))
    assert wave.shape == (8000,)
    assert op.check("tone.flac", dict(context)) is CHECKED
    assert op.shape("tone.mp3", dict(context)) == ("audio", 16000, "mono")
    # the pre-check (header + first moments) already refuses what cannot be opened or is cut short by its header
    for name in ("noise.wav", "empty.flac", "missing.wav", "silent.mp4", "cut.wav"):
        with pytest.raises(DataError) as err:
            op.check(name, dict(context))
        message = str(err.value)
        assert message.startswith("row 3 'input_audio': ") and message.endswith(str(root / name)), message
    # what only decoding finds: at load
    for name in ("cut.flac", "cut.mp3"):
        with pytest.raises(DataError, match=r"^row 3 'input_audio': (corrupt|truncated) audio"):
            op(name, dict(context))
    with pytest.raises(DataError, match=r"row 3 'input_audio': not an audio file .*: .*notes\.txt$"):
        op.check("notes.txt", dict(context))


def test_stereo_operator_and_rate_checks(files):
    wave = LoadAudio(sample_rate=22050, mono=False)(str(files[".flac"]))
    assert wave.shape == (2, 11025)
    with pytest.raises(DataError, match="sample rate 0"):
        LoadAudio(sample_rate=0)
    assert check_audio(files["clip"]).sample_rate == 16000


# -- the data set's audio columns ---------------------------------------------------------------------------------

def _metadata(root, rows, name="metadata.csv"):
    import csv

    path = root / name
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    return path


def test_an_audio_column_loads_checks_and_fingerprints_its_files(files, tmp_path):
    """An audio column named only in --extra_inputs is a file column: loaded by the operator declared for it, its
    files among the row's source files (the cache's fingerprint), checked before the first step."""
    import shutil

    from difftune.data import UnifiedDataset
    from difftune.data.audio import audio_path_operator

    shutil.copy(files[".wav"], tmp_path / "a.wav")
    shutil.copy(files["clip"], tmp_path / "b.mp4")
    meta = _metadata(tmp_path, [{"prompt": "x", "input_audio": "a.wav", "music": "a.wav"},
                                {"prompt": "y", "input_audio": "b.mp4", "music": "a.wav"}])
    ops = {"input_audio": audio_operator(tmp_path, 16000), "music": audio_path_operator(tmp_path)}
    data = UnifiedDataset(tmp_path, meta, data_file_keys=(), extra_inputs=("input_audio", "music"),
                          special_operator_map=ops)
    assert data.data_file_keys == ["input_audio", "music"]
    first, second = data[0], data[1]
    assert first["input_audio"].shape == (8000,) and first["music"] == str(tmp_path / "a.wav")
    # the clip's audio track, 0.3125 s (AAC pads its last 1024-sample frame)
    assert second["input_audio"].ndim == 1 and 5000 <= len(second["input_audio"]) <= 5000 + 1024
    assert data.source_files(1) == [str(tmp_path / "b.mp4"), str(tmp_path / "a.wav")]
    # a bad audio file stops the run before training, in one line naming the row, the column and the file
    (tmp_path / "bad.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEjunk")
    bad = _metadata(tmp_path, [{"prompt": "x", "input_audio": "bad.wav"}], "bad.csv")
    with pytest.raises(DataError) as err:
        UnifiedDataset(tmp_path, bad, data_file_keys=("input_audio",), special_operator_map=ops)
    assert "row 1 'input_audio'" in str(err.value) and "bad.wav" in str(err.value) and "\n" not in str(err.value)
    silent = _metadata(tmp_path, [{"prompt": "x", "music": "../" + files["silent_clip"].parent.name + "/silent.mp4"}],
                       "silent.csv")
    with pytest.raises(DataError, match="no audio stream"):  # the clip sits in a sibling folder: allowed here
        UnifiedDataset(tmp_path, silent, data_file_keys=("music",), special_operator_map=ops, allow_paths_outside=True)


def test_an_audio_file_where_no_part_reads_audio_is_named_as_such(files, tmp_path):
    import shutil

    from difftune.data import UnifiedDataset

    shutil.copy(files[".wav"], tmp_path / "a.wav")
    meta = _metadata(tmp_path, [{"prompt": "x", "video": "a.wav"}])
    with pytest.raises(DataError, match=r"'video': an audio file \('\.wav'\) where this run reads .*a\.wav"):
        UnifiedDataset(tmp_path, meta, data_file_keys=("video",),
                       main_data_operator=UnifiedDataset.default_video_operator(tmp_path, num_frames=5))


@pytest.mark.parametrize("channels", [8, 12])
def test_many_channel_wav_reads_and_downmixes(tmp_path, channels):
    """8 channels crashed PyAV's planar float frames (a segfault); read in a child process so a crash fails the
    test instead of killing pytest."""
    t = np.arange(4000) / 16000
    samples = np.stack([0.05 * (c + 1) * np.sin(2 * np.pi * 300 * t) for c in range(channels)], axis=1)
    path = write_wav(tmp_path / f"ch{channels}.wav", samples, 16000)
    code = ("import sys, numpy as np; from difftune.media.audio import read_audio\n"
            "w = read_audio(sys.argv[1], 8000); k = read_audio(sys.argv[1], None, mono=False)\n"
            "print(w.shape[0], k.shape[0], k.shape[1], float(np.abs(k[-1]).max()), float(np.abs(w).max()))")
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n, ch, m, last_peak, mono_peak = proc.stdout.split()
    assert (int(n), int(ch), int(m)) == (2000, channels, 4000)
    assert abs(float(last_peak) - 0.05 * channels) < 1e-3  # the channels keep their order and values
    mean_amp = 0.05 * (channels + 1) / 2
    assert abs(float(mono_peak) - mean_amp) < 0.01  # the mean of the channels


def test_nan_samples_in_a_wav_name_the_file(tmp_path):
    samples = np.full((1600, 1), 0.1, np.float32)
    samples[1200] = np.nan
    path = write_float_wav(tmp_path / "nan.wav", samples)
    op = audio_operator(tmp_path, 16000)
    with pytest.raises(DataError) as err:
        op("nan.wav", {"where": "row 3", "key": "input_audio"})
    msg = str(err.value)
    assert msg == f"row 3 'input_audio': 1 non-finite sample(s) (NaN or infinite) at 0.075 s: {path}"
    clean = write_float_wav(tmp_path / "ok.wav", np.full((1600, 1), 0.1, np.float32))
    assert np.isfinite(op(clean.name, {})).all()
