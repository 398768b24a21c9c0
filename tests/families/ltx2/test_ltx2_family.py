"""The LTX-2 family on tiny models in the layouts users download.

* Recognition: the seven Repackage files of either version, the official single files and JoyAI-Echo's file fill
  the reference's slots with the tiny models' own configs; at the released sizes (meta tensors), the configs read
  from the weights are the releases'.
* Training (`difftune train`, one stage): the sound, the input image and the in-context clip each change the trained
  LoRA alone; the log has each stream's loss (train/loss_video, train/loss_audio), a clip without sound none for
  audio.
* The sound: a track shorter than its clip is padded with a note naming the file, a mono one at 44.1 kHz is
  upmixed and resampled (a note), a file with no sound track is refused in one line naming it; a variable-frame-rate
  clip is resampled to --frame_rate by its timestamps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.errors import UserError
from difftune.families.ltx2 import components as C
from difftune.models.detect import ComponentSpec, detect_components
from support.audio import tone, write_audio, write_clip_with_audio
from support.ltx2 import tiny as T
from support.ltx2.scripts import _tiny_ltx2, write_ltx2_dataset
from support.video import moving_circle_frames

SLOTS = {"transformer.safetensors": "dit", "text_encoder_post_modules.safetensors": "text_encoder_post_modules",
         "video_vae_encoder.safetensors": "video_vae_encoder", "video_vae_decoder.safetensors": "video_vae_decoder",
         "audio_vae_encoder.safetensors": "audio_vae_encoder", "audio_vae_decoder.safetensors": "audio_vae_decoder",
         "audio_vocoder.safetensors": "audio_vocoder"}
PARTS = {"dit": "dit", "text_encoder_post_modules": "connectors", "video_vae_encoder": "video_vae",
         "video_vae_decoder": "video_vae", "audio_vae_encoder": "audio_vae", "audio_vae_decoder": "audio_vae",
         "audio_vocoder": "vocoder"}


def _fits_tiny(found, version):
    """The recognised config describes the tiny model: every value the tiny config sets is the recognised one's."""
    tiny = T.tiny_configs(version)[PARTS[found.name]]
    config = found.config
    for key, value in tiny.items():
        got = config.get(key)
        same = list(got) == list(value) if isinstance(value, (list, tuple)) and got is not None else got == value
        if found.name in ("video_vae_encoder",) and key.startswith(("decoder_", "upsample")):
            continue  # the encoder half has no decoder to describe
        if found.name in ("video_vae_decoder",) and key in ("block_out_channels", "layers_per_block"):
            continue
        if found.name == "dit" and key == "caption_channels" and not config["use_prompt_embeddings"]:
            continue  # 2.3's DiT takes the connectors' per-modality projections: no caption projection to size
        assert same, (found.name, key, got, value)


@pytest.mark.parametrize("version", T.VERSIONS)
def test_the_repackage_files_and_the_official_file_fill_the_reference_slots(tmp_path, version):
    files = T.write_tiny_ltx2_repackage(tmp_path / "repackage", version)
    for name, path in files.items():
        (found,) = detect_components(str(path), C.COMPONENTS)
        assert found.name == SLOTS[name]
        _fits_tiny(found, version)
    single = T.write_tiny_ltx2_official(tmp_path / "official", version)
    assert sorted(f.name for f in detect_components(str(single), C.COMPONENTS)) == sorted(SLOTS.values())


def test_joyai_echo_is_ltx_2_3_in_one_file(tmp_path):
    path = T.write_tiny_joyai_echo(tmp_path)
    found = {f.name: f for f in detect_components(str(path), C.COMPONENTS)}
    assert sorted(found) == sorted(SLOTS.values())
    assert found["dit"].config["gated_attn"] and found["audio_vocoder"].spec is C.VOCODER_23


@pytest.mark.parametrize("version", T.VERSIONS)
@pytest.mark.parametrize("part,infer,known", [
    ("dit", C.dit_config, {"2": C.DIT_CONFIG, "2.3": C.DIT_CONFIG_23}),
    ("connectors", C.connectors_config, {"2": C.CONNECTORS_CONFIG, "2.3": C.CONNECTORS_CONFIG_23}),
    ("video_vae", C.video_vae_config, {"2": C.VIDEO_VAE_CONFIG, "2.3": C.VIDEO_VAE_CONFIG_23}),
])
def test_the_configs_read_from_released_sizes_are_the_releases(version, part, infer, known):
    """The released models built on the meta device: what the weights show gives back the release's config."""
    classes = T.ltx2_classes(version)
    cls = classes[part]
    spec = ComponentSpec(name=part, library=cls.__module__, class_name=cls.__name__)
    shapes = spec.signature(known[version])
    assert infer(shapes) == known[version]


# -- training ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _tiny_ltx2(tmp_path_factory.mktemp("ltx2"))


def _train(tiny, meta: Path, out: Path, *more) -> dict:
    run_train("--family", "ltx2", "--model_paths", json.dumps(tiny.model_paths), "--torch_dtype", "float32",
              "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path", out,
              "--lora_base_model", "dit", "--lora_target_modules", tiny.lora_target_modules, "--lora_rank", 4,
              "--learning_rate", 1e-3, "--max_steps", 2, "--seed", 5, "--no_progress", "--task", "sft",
              "--height", 32, "--width", 32, "--num_frames", 9, *more)
    (saved,) = sorted(out.glob("*.safetensors"))
    return load_file(str(saved))


def _differs(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _scalars(folder: Path) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = sorted(folder.rglob("events.out.tfevents.*"))
    acc = EventAccumulator(str(events.parent))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


SOUND = ("--data_file_keys", "video,input_audio", "--extra_inputs", "input_audio")


@pytest.fixture(scope="module")
def sound_run(tiny, tmp_path_factory) -> tuple:
    """The plain run (the clips and their sound) that both LoRA comparisons start from, trained once: (its output
    folder, its LoRA). Each test writes its own copy of the data set (the same files) to change."""
    root = tmp_path_factory.mktemp("ltx2_sound")
    out = root / "a"
    return out, _train(tiny, write_ltx2_dataset(root / "data"), out, *SOUND)


def test_the_sound_alone_changes_the_lora_and_each_stream_logs_its_loss(tiny, sound_run, tmp_path):
    meta = write_ltx2_dataset(tmp_path / "data")
    folder, base = sound_run
    again = _train(tiny, meta, tmp_path / "again", *SOUND)
    assert _differs(base, again) == 0.0  # a repeated run (of another copy of the data set) is the same run
    for i in range(2):  # other tones, the same pictures
        write_audio(meta.parent / f"clip{i}.wav", tone((900.0 + 100 * i, 1200.0), FRAMES_S, 16000), 16000)
    lines = meta.read_text().splitlines()
    meta.write_text("\n".join([lines[0]] + [ln.replace(",clip", ",clip", 1).replace(
        f"clip{i}.mp4,clip{i}.mp4", f"clip{i}.mp4,clip{i}.wav") for i, ln in enumerate(lines[1:])]) + "\n")
    other = _train(tiny, meta, tmp_path / "b", *SOUND)
    assert _differs(base, other) > 0
    scalars = _scalars(folder)
    assert len(scalars["train/loss_video"]) == len(scalars["train/loss_audio"]) == 2
    assert all(v > 0 for v in scalars["train/loss_audio"])


FRAMES_S = 9 / 24


def test_a_clip_without_sound_trains_the_video_stream_alone(tiny, tmp_path):
    meta = write_ltx2_dataset(tmp_path / "data", sound=False)
    _train(tiny, meta, tmp_path / "out", "--data_file_keys", "video")
    scalars = _scalars(tmp_path / "out")
    assert len(scalars["train/loss_video"]) == 2 and "train/loss_audio" not in scalars


def test_the_input_image_and_the_in_context_clip_each_change_the_lora(tiny, sound_run, tmp_path):
    from PIL import Image

    meta = write_ltx2_dataset(tmp_path / "data")
    i2av = (*SOUND[:3], "input_audio,input_image")
    first = _train(tiny, meta, tmp_path / "first", *i2av)  # the clips' first frames
    _, plain = sound_run  # the same data set without the input image
    assert _differs(first, plain) > 0
    for i in range(2):
        Image.new("RGB", (64, 64), (250, 250 - 100 * i, 20)).save(meta.parent / f"still{i}.png")
    lines = meta.read_text().splitlines()
    meta.write_text("\n".join([lines[0] + ",input_image"] + [f"{ln},still{i}.png" for i, ln in
                                                            enumerate(lines[1:])]) + "\n")
    still = _train(tiny, meta, tmp_path / "still", "--data_file_keys", "video,input_audio,input_image",
                   "--extra_inputs", "input_audio,input_image")
    assert _differs(first, still) > 0

    ic = write_ltx2_dataset(tmp_path / "ic", in_context=True)
    flags = ("--data_file_keys", "video,input_audio,in_context_videos", "--extra_inputs",
             "input_audio,in_context_videos,in_context_downsample_factor,frame_rate")
    one = _train(tiny, ic, tmp_path / "ic1", *flags)
    for i in range(2):  # other reference clips
        write_clip_with_audio(ic.parent / "reference" / f"clip{i}.mp4",
                              moving_circle_frames(9, (64, 64), color=(20, 250, 20 + 90 * i)), None, fps=24)
    two = _train(tiny, ic, tmp_path / "ic2", *flags)
    assert _differs(one, two) > 0


# -- the sound's edge cases ------------------------------------------------------------------------------------------

def _stage1(tiny, meta: Path, out: Path, capsys):
    run_train("--family", "ltx2", "--model_paths", json.dumps(tiny.model_paths), "--torch_dtype", "float32",
              "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path", out,
              "--lora_base_model", "dit", "--lora_target_modules", tiny.lora_target_modules, "--no_progress",
              "--task", "sft:data_process", "--height", 32, "--width", 32, "--num_frames", 9, *SOUND)
    return capsys.readouterr().out


def _one_row(folder: Path, audio_name: str) -> Path:
    write_clip_with_audio(folder / "clip.mp4", moving_circle_frames(9, (64, 64)), None, fps=24)
    (folder / "metadata.csv").write_text(f"video,input_audio,prompt\nclip.mp4,{audio_name},a circle\n")
    return folder / "metadata.csv"


def test_a_short_sound_is_padded_with_a_note_and_a_mono_one_upmixed(tiny, tmp_path, capsys):
    meta = _one_row(tmp_path / "short", "short.wav")
    write_audio(meta.parent / "short.wav", tone((440.0, 660.0), 0.1, 16000), 16000)
    out = _stage1(tiny, meta, tmp_path / "c1", capsys)
    # 0.1 s read as whole latent steps (0.04 s each): 0.08 s
    assert "short.wav: the sound lasts 0.08 s, its clip 0.38 s: the rest is padded with silence" in out
    meta = _one_row(tmp_path / "mono", "mono.wav")
    write_audio(meta.parent / "mono.wav", tone((440.0,), 0.5, 44100), 44100)
    out = _stage1(tiny, meta, tmp_path / "c2", capsys)
    assert "mono.wav: mono audio, upmixed to stereo" in out
    cached = load_file(str(next((tmp_path / "c2").rglob("*.safetensors"))))
    latents = next(v for k, v in cached.items() if "audio_input_latents" in k)
    assert latents.shape[-1] == T.LATENT_MEL_BINS and torch.isfinite(latents).all()


def test_a_file_without_a_sound_track_is_refused_naming_it(tiny, tmp_path, capsys):
    meta = _one_row(tmp_path / "silent", "clip.mp4")  # the clip has no audio stream
    with pytest.raises(UserError, match=r"clip\.mp4") as err:
        _stage1(tiny, meta, tmp_path / "c", capsys)
    assert "\n" not in str(err.value) and "input_audio" in str(err.value)


def test_a_variable_frame_rate_clip_is_resampled_by_its_timestamps(tmp_path):
    """Frames shown at 0, 0.1, 0.15, 0.4, 0.45 s: at 10 fps frame k is the one nearest k / 10 s."""
    from fractions import Fraction

    import av

    from difftune.media.video import read_video_at_rate

    path = tmp_path / "vfr.mp4"
    base = Fraction(1, 100)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("libx264", rate=100)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        stream.codec_context.time_base = base
        for i, t in enumerate((0.0, 0.1, 0.15, 0.4, 0.45)):
            frame = av.VideoFrame.from_ndarray(np.full((32, 32, 3), 40 * i, np.uint8), format="rgb24")
            frame.pts, frame.time_base = int(round(t * 100)), base
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode(None):
            out.mux(packet)
    frames = read_video_at_rate(path, 10.0, num_frames=5)
    shades = [round(int(np.asarray(f)[16, 16, 0]) / 40) for f in frames]  # yuv420p shifts a grey a little
    # 0 s -> the frame at 0, 0.1 -> 0.1, 0.2 -> 0.15, 0.3 -> 0.4 (0.1 away; 0.15 is 0.15 away), 0.4 -> 0.4
    assert shades == [0, 1, 2, 3, 3]


@pytest.mark.parametrize("version", T.VERSIONS)
def test_sample_writes_the_clip_with_its_sound_at_the_frame_rate(tmp_path, version):
    """`difftune sample` from the official single file: an mp4 at the call's frame rate with the vocoder's sound
    muxed in, at 48 kHz (2.0's 24 kHz vocoder resampled), as long as the clip."""
    import av

    from difftune.cli.main import main

    single = T.write_tiny_ltx2_official(tmp_path / "official", version)
    gemma = T.write_tiny_gemma3(tmp_path / "gemma")
    paths = [str(single), [str(gemma / s) for s in T.GEMMA3_SHARDS]]
    out = tmp_path / "clip.mp4"
    assert main(["sample", "--model_paths", json.dumps(paths), "--prompt", "a circle", "--height", "64", "--width",
                 "64", "--num_frames", "9", "--num_inference_steps", "2", "--frame_rate", "12", "--output",
                 str(out)]) == 0
    with av.open(str(out)) as clip:
        video, audio = clip.streams.video[0], clip.streams.audio[0]
        frames = sum(1 for _ in clip.decode(video=0))
        assert frames == 9 and abs(float(video.average_rate) - 12) < 1e-6
        assert audio.rate == 48000 and audio.channels == 2
        seconds = float(audio.duration * audio.time_base)
    assert abs(seconds - 9 / 12) < 0.1  # AAC frames of 1024 samples


def test_a_diffusers_repository_samples_what_the_official_file_samples(tmp_path, capsys):
    """--model_dir of a repository in diffusers' layout (vae/ and audio_vae/ whole, each with its config.json;
    tokenizer/ beside text_encoder/) fills every slot from the config.json files and samples the clip and sound the
    official file of the same models samples. --separate_streams writes NAME-video.mp4 without a sound track and
    NAME-audio.wav (48 kHz stereo, as long as the clip) in place of the muxed file."""
    import av
    import soundfile

    from difftune.cli.main import main
    from difftune.core.family import get_family

    repo = T.write_tiny_ltx2_diffusers(tmp_path / "repo", "2")
    upsampler = repo / "latent_upsampler"  # the two-stage upscaler of Lightricks/LTX-2, which no family loads
    upsampler.mkdir()
    (upsampler / "config.json").write_text(json.dumps({"_class_name": "LTX2LatentUpsamplerModel"}))
    weights = next((repo / "vocoder").glob("*.safetensors"))  # any weights: the folder is left out before reading
    (upsampler / "diffusion_pytorch_model.safetensors").write_bytes(weights.read_bytes())
    configs = {"vae": "video_vae", "audio_vae": "audio_vae"}
    for folder, part in configs.items():
        found = detect_components(str(repo / folder), get_family("ltx2").components)
        assert {f.name for f in found} == {f"{part}_encoder", f"{part}_decoder"}
        assert {f.source for f in found} == {str(repo / folder / "config.json")}
    single = T.write_tiny_ltx2_official(tmp_path / "official", "2")
    gemma = T.write_tiny_gemma3(tmp_path / "gemma")
    common = ["--prompt", "a circle", "--height", "64", "--width", "64", "--num_frames", "9",
              "--num_inference_steps", "2", "--frame_rate", "12", "--seed", "5", "--separate_streams"]
    assert main(["sample", "--model_dir", str(repo), *common, "--output", str(tmp_path / "d.mp4")]) == 0
    assert "note: --model_dir: latent_upsampler/ holds a LTX2LatentUpsamplerModel, which no family loads: left out" \
        in capsys.readouterr().out
    paths = [str(single), [str(gemma / s) for s in T.GEMMA3_SHARDS]]
    assert main(["sample", "--model_paths", json.dumps(paths), *common, "--output", str(tmp_path / "o.mp4")]) == 0

    def frames(path):
        with av.open(str(path)) as clip:
            return np.stack([f.to_ndarray(format="rgb24") for f in clip.decode(video=0)])

    assert not (tmp_path / "o.mp4").exists()
    with av.open(str(tmp_path / "o-video.mp4")) as clip:
        assert not clip.streams.audio
    a, b = frames(tmp_path / "d-video.mp4"), frames(tmp_path / "o-video.mp4")
    # H.264 can turn float noise (thread counts) into a few levels at a pixel; another model differs everywhere
    gap = np.abs(a.astype(int) - b.astype(int))
    assert a.shape == (9, 64, 64, 3) and gap.mean() < 0.5 and gap.max() <= 24, (gap.mean(), gap.max())
    wave_d, _ = soundfile.read(str(tmp_path / "d-audio.wav"), always_2d=True)
    wave_o, rate = soundfile.read(str(tmp_path / "o-audio.wav"), always_2d=True)
    assert rate == 48000 and wave_o.shape[1] == 2 and abs(wave_o.shape[0] / rate - 9 / 12) < 0.05
    assert wave_d.shape == wave_o.shape and np.abs(wave_d - wave_o).max() < 1e-3 and np.abs(wave_o).max() > 0
