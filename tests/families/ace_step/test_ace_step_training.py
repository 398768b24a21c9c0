"""`difftune train` and `difftune sample` on the tiny ACE-Step release: what each data column does to the trained
LoRA, bad audio refused in one line with nothing written lost, notes for mono and over-long clips, wav out."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from conftest import run_train
from difftune.errors import UserError
from difftune.media.audio import probe_audio, write_audio
from support.ace_step import ace_step_model_paths, write_tiny_ace_step_hub

RATE = 48000
LORA = ("--lora_base_model", "dit", "--lora_target_modules", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "--lora_rank", "4", "--learning_rate", "1e-3", "--num_epochs", "1")


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_ace_step_hub(tmp_path_factory.mktemp("hub"))


def _clip(path, seconds=1.2, channels=2):
    t = np.arange(int(seconds * RATE)) / RATE
    wave = np.stack([np.sin(2 * np.pi * 220 * (c + 1) * t) for c in range(channels)]) * 0.4
    write_audio(wave.astype(np.float32), path, RATE)


def _data(root, rows, seconds=1.2, channels=2):
    root.mkdir(parents=True, exist_ok=True)
    for row in rows:
        if not (root / row["audio"]).exists():
            _clip(root / row["audio"], seconds, channels)
    (root / "metadata.json").write_text(json.dumps(rows))
    return ["--dataset_base_path", str(root), "--dataset_metadata_path", str(root / "metadata.json")]


def _train(repo, data, out, *more):
    run_train("--model_paths", json.dumps(ace_step_model_paths(repo)), "--data_file_keys", "audio", *data,
              "--output_path", str(out), *LORA, *more)
    return load_file(str(out / "epoch-0.safetensors"))


ROW = {"audio": "a.wav", "prompt": "warm synth pop", "lyrics": "[verse]\nla la", "bpm": 110}


def test_the_lyrics_the_prompt_or_a_metadata_column_alone_changes_the_lora(repo, tmp_path):
    base = _train(repo, _data(tmp_path / "d0", [ROW]), tmp_path / "o0")
    again = _train(repo, _data(tmp_path / "d1", [ROW]), tmp_path / "o1")
    assert all(np.array_equal(base[k].numpy(), again[k].numpy()) for k in base)  # a run is repeatable
    assert len(base) == 2 * 22  # lora_A/B of the 22 modules the reference's targets name on the tiny DiT
    for i, change in enumerate(({"lyrics": "[verse]\nho ho"}, {"prompt": "cold techno"}, {"bpm": 140},
                                {"keyscale": "F# minor"}), 2):
        other = _train(repo, _data(tmp_path / f"d{i}", [{**ROW, **change}]), tmp_path / f"o{i}")
        assert any(not np.array_equal(base[k].numpy(), other[k].numpy()) for k in base), change


@pytest.mark.parametrize("case, name, says", [pytest.param(*p, id=p[0]) for p in (
    ("eight_channels", "bad.wav", "has 8 audio channels; this model takes mono or stereo"),
    ("no_audio_stream", "bad.mp4", "no audio stream (the file holds only video)"),
    ("too_short", "bad.wav", "0.40 s of audio, shorter than the 1 s this model trains on"),
    ("broken", "bad.wav", "unreadable or corrupt audio"),
)])
def test_bad_audio_is_refused_in_one_line_and_nothing_written_is_lost(repo, tmp_path, case, name, says):
    from support.video import write_tiny_clip

    root = tmp_path / "data"
    root.mkdir()
    bad = root / name
    if case == "eight_channels":
        _clip(bad, channels=8)
    elif case == "no_audio_stream":
        write_tiny_clip(bad, num_frames=4, size=(16, 16))
    elif case == "too_short":
        _clip(bad, seconds=0.4)
    else:
        bad.write_bytes(b"RIFF" + bytes(range(256)) * 4)
    out = tmp_path / "out"
    out.mkdir()
    (out / "epoch-0.safetensors").write_bytes(b"an earlier run's file")
    with pytest.raises(UserError) as err:
        _train(repo, _data(root, [{**ROW, "audio": name}]), out)
    message = str(err.value)
    assert says in message and name in message and "\n" not in message
    assert sorted(p.name for p in out.iterdir()) == ["epoch-0.safetensors"]
    assert (out / "epoch-0.safetensors").read_bytes() == b"an earlier run's file"


def test_a_mono_clip_is_upmixed_and_a_long_one_cut_with_a_note(repo, tmp_path, capsys):
    data = _data(tmp_path / "data", [{**ROW, "audio": "mono.wav"}], seconds=3.0, channels=1)
    _train(repo, data, tmp_path / "out", "--max_audio_duration", "2")
    printed = capsys.readouterr().out
    assert "mono.wav: mono audio, upmixed to stereo" in printed
    assert "mono.wav: 3.0 s of audio, cut to --max_audio_duration 2 s" in printed


def _dit_without_silence(repo, folder, silence: bytes | None = None):
    """The release's DiT file in a folder of its own, beside no silence latent or beside `silence`."""
    import shutil

    from support.ace_step import DIT_FILE

    folder.mkdir()
    shutil.copy(repo / DIT_FILE, folder / "model.safetensors")
    if silence is not None:
        (folder / "silence_latent.pt").write_bytes(silence)
    return [str(folder / "model.safetensors"), *ace_step_model_paths(repo)[1:]]


def _train_refused(paths, tmp_path) -> str:
    out = tmp_path / "out"
    out.mkdir()
    (out / "epoch-0.safetensors").write_bytes(b"an earlier run's file")
    with pytest.raises(UserError) as err:
        run_train("--model_paths", json.dumps(paths), "--data_file_keys", "audio", *_data(tmp_path / "d", [ROW]),
                  "--output_path", str(out), *LORA)
    assert sorted(p.name for p in out.iterdir()) == ["epoch-0.safetensors"]
    assert (out / "epoch-0.safetensors").read_bytes() == b"an earlier run's file"
    message = str(err.value)
    assert "\n" not in message
    return message


def test_a_missing_silence_latent_is_one_line_naming_the_flag(repo, tmp_path):
    message = _train_refused(_dit_without_silence(repo, tmp_path / "dit"), tmp_path)
    assert "no silence_latent.pt beside the DiT's weights: pass --silence_latent_path" in message
    assert str(tmp_path / "dit") in message


def test_a_hostile_silence_latent_is_refused_without_running_it(repo, tmp_path):
    import pickle

    ran = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    message = _train_refused(_dit_without_silence(repo, tmp_path / "dit", pickle.dumps(Hostile())), tmp_path)
    assert str(tmp_path / "dit" / "silence_latent.pt") in message
    assert not ran.exists()


def test_difftune_sample_writes_stereo_48khz_wav(repo, tmp_path):
    from difftune.cli.main import main

    out = tmp_path / "song.wav"
    code = main(["sample", "--model_paths", json.dumps(ace_step_model_paths(repo)), "--prompt", "a waltz",
                 "--lyrics", "[verse]\nla", "--duration", "1", "--bpm", "90", "--num_inference_steps", "2",
                 "--seed", "0", "--output", str(out)])
    assert code in (0, None)
    info = probe_audio(out)
    assert info.sample_rate == RATE and info.channels == 2 and abs(info.duration - 1.0) < 1e-3


def test_a_full_checkpoint_saves_in_the_release_names_on_request(repo, tmp_path):
    from safetensors.torch import load_file as load

    from support.ace_step import DIT_FILE

    data = _data(tmp_path / "data", [ROW])
    args = ("--model_paths", json.dumps(ace_step_model_paths(repo)), "--data_file_keys", "audio", *data,
            "--trainable_models", "dit", "--learning_rate", "1e-5", "--num_epochs", "1",
            "--remove_prefix_in_ckpt", "pipe.dit.")
    run_train(*args, "--output_path", str(tmp_path / "diffusers"))
    run_train(*args, "--output_path", str(tmp_path / "original"), "--full_format", "original")
    ours = load(str(tmp_path / "diffusers" / "epoch-0.safetensors"))
    original = load(str(tmp_path / "original" / "epoch-0.safetensors"))
    release = {k for k in load(str(repo / DIT_FILE)) if k.startswith("decoder.")}
    assert "proj_in_conv.weight" in ours and "layers.0.self_attn.to_q.weight" in ours
    assert set(original) == release  # the DiT as the release's single file names it
    assert np.array_equal(original["decoder.layers.0.self_attn.q_proj.weight"].numpy(),
                          ours["layers.0.self_attn.to_q.weight"].numpy())
