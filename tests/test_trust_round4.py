"""Trust, round 4 (issue 36): careless and hostile inputs on the newer surface end in one line naming the input,
or train; never a crash, a traceback or a run on wrong data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import wave as wavfile

import numpy as np
import pytest

from difftune.data.operators import DataError
from difftune.errors import UserError


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


# -- defect 1: audio that crashed ----------------------------------------------------------------------------

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


def test_audio_too_short_for_the_encoder_is_one_line_naming_the_file(tmp_path):
    """20 ms of audio reached wav2vec2's first convolution (400 samples wide) and ended in a conv1d traceback."""
    from difftune.families.wan.s2v import WanS2VPipeline
    from difftune.families.wan.s2v.units import S2V_MIN_AUDIO_SECONDS

    class Config:
        dataset_base_path = str(tmp_path)

    path = write_wav(tmp_path / "short.wav", np.full((320, 1), 0.1), 16000)
    op = WanS2VPipeline.data_operators(Config())["input_audio"]
    context = {"where": "row 2", "key": "input_audio"}
    for run in (op.check, op):
        with pytest.raises(DataError) as err:
            run("short.wav", context)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("row 2 'input_audio'") and str(path) in msg
        assert "0.02 s" in msg and f"{S2V_MIN_AUDIO_SECONDS:g} s" in msg
    ok = write_wav(tmp_path / "ok.wav", np.full((800, 1), 0.1), 16000)
    assert op("ok.wav", context).shape == (800,)


def test_s2v_audio_embeds_refuses_a_waveform_shorter_than_the_encoder_takes(tmp_path):
    from difftune.families.wan.s2v.units import load_audio_processor, s2v_audio_embeds
    from support.wan.s2v import WAV2VEC_FOLDER, tiny_wav2vec2, write_tiny_s2v

    repo = write_tiny_s2v(tmp_path / "s2v")
    processor = load_audio_processor(str(repo / WAV2VEC_FOLDER))
    with pytest.raises(UserError, match=r"^input_audio: 320 samples \(0\.02 s\) at 16000 Hz; wav2vec2 needs at "
                                        r"least 400"):
        s2v_audio_embeds(tiny_wav2vec2(), processor, np.zeros(320, np.float32), 5)


# -- defect 4: values checked where they are read --------------------------------------------------------------

class _Pipe:
    device, torch_dtype = "cpu", None


def _camera(speed="0.02", origin=None):
    import torch

    from difftune.families.wan.camera import WanCameraControl

    pipe = _Pipe()
    pipe.torch_dtype = torch.float32
    return WanCameraControl().process(pipe, "Left", speed, origin, 5, 16, 16, 1)


@pytest.mark.parametrize("speed", ["inf", "nan", "-Infinity", float("-inf"), "1e400", 1e400])
def test_non_finite_camera_speed_names_the_column(speed):
    with pytest.raises(UserError, match=r"^camera_control_speed .*: expected a finite number"):
        _camera(speed)
    import torch

    assert torch.isfinite(_camera("0.02")["control_camera_latents"]).all()
    assert torch.isfinite(_camera(None)["control_camera_latents"]).all()  # no value: the default speed
    assert torch.isfinite(_camera(float("nan"))["control_camera_latents"]).all()  # an empty cell, as read


def test_singular_or_non_finite_camera_origin_is_one_line():
    """A pose whose 3 x 4 world-to-camera matrix cannot be inverted raised numpy's LinAlgError."""
    singular = "0 0.53 0.94 0.5 0.5 0 0 " + " ".join(["0"] * 12)
    with pytest.raises(UserError) as err:
        _camera(origin=singular)
    msg = str(err.value)
    assert msg.startswith("camera_control_origin") and "not invertible" in msg and "\n" not in msg
    with pytest.raises(UserError, match=r"^camera_control_origin .*: expected 19 numbers, all finite"):
        _camera(origin="0 0.53 0.94 0.5 0.5 0 0 1 0 0 nan 0 1 0 0 0 0 1 0")


def test_nan_samples_in_a_wav_name_the_file(tmp_path):
    from difftune.data.audio import audio_operator

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


def _lora_file(path, alpha=4.0, bad=None):
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    tensors = {"diffusion_model.blocks.0.attn.to_q.lora_down.weight": torch.randn(4, 16, generator=g),
               "diffusion_model.blocks.0.attn.to_q.lora_up.weight": torch.randn(16, 4, generator=g),
               "diffusion_model.blocks.0.attn.to_q.alpha": torch.tensor(alpha)}
    if bad:
        tensors[bad] = tensors[bad].clone()
        tensors[bad].view(-1)[0] = float("nan")
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("bad", ["diffusion_model.blocks.0.attn.to_q.alpha",
                                 "diffusion_model.blocks.0.attn.to_q.lora_up.weight"])
def test_nan_in_a_lora_file_names_the_tensor(tmp_path, bad):
    from difftune.lora.formats import load_lora_file

    load_lora_file(_lora_file(tmp_path / "ok.safetensors"))
    path = _lora_file(tmp_path / "bad.safetensors", bad=bad)
    with pytest.raises(UserError) as err:
        load_lora_file(path)
    assert str(err.value) == f"{path}: tensor '{bad}' holds 1 NaN and 0 infinite value(s)"


# -- defect 8: smaller ones -------------------------------------------------------------------------------------

def test_csv_with_a_duplicated_column_is_refused_naming_it(tmp_path):
    from difftune.data.dataset import read_metadata

    path = tmp_path / "meta.csv"
    path.write_text("image,prompt,prompt,video\na.png,a cat,a dog,v.mp4\n")
    with pytest.raises(DataError) as err:
        read_metadata(path)
    assert str(err.value) == f"{path}: the column 'prompt' appears 2 times; name each column once"
    path.write_text("image,prompt\na.png,a cat\n")
    assert read_metadata(path) == [{"image": "a.png", "prompt": "a cat"}]


_TRACKER_RUN = '''
import sys
from pathlib import Path
from PIL import Image
from accelerate import PartialState
from difftune.training.trackers import log_media, start

PartialState()

class Accel:
    is_main_process = True
    trackers = []

class Config:
    enable_wandb_log, enable_swanlab_log, wandb_project, output_path = True, False, "p", sys.argv[1]

    def record(self):
        return {"lr": 1.0}

accel = Accel()
start(accel, Config(), "run")
accel.trackers[0].log({"loss": 0.5}, step=1)
log_media(accel, Image.new("RGB", (16, 16), (200, 10, 10)), 1)
accel.trackers[0].finish()
'''


def _tracker_env(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "XDG_"))}
    env.update(HOME=str(home), WANDB_MODE="offline", WANDB_SILENT="true")
    return env


def test_wandb_offline_writes_only_under_the_output_folder(tmp_path):
    """W&B offline also wrote under ~/.cache/wandb (and its settings under ~/.config/wandb): with HOME a fresh
    folder, nothing of W&B's lands there; the run's files are under <output_path>/wandb_log."""
    pytest.importorskip("wandb")
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    proc = subprocess.run([sys.executable, "-c", _TRACKER_RUN, str(out)], env=_tracker_env(home), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*") if "wandb" in str(p).lower())
    assert written == []
    assert list((out / "wandb_log").rglob("run-*.wandb"))
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "artifacts").exists()


def test_tracker_folder_that_is_a_file_is_one_line(tmp_path):
    from difftune.training.trackers import start

    class Accel:
        is_main_process = True
        trackers = []

    class Config:
        enable_wandb_log, enable_swanlab_log, wandb_project, output_path = True, False, "p", str(tmp_path / "out")

        def record(self):
            return {}

    pytest.importorskip("wandb")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "wandb_log").write_text("not a folder")
    with pytest.raises(UserError) as err:
        start(Accel(), Config(), "run")
    assert str(err.value) == (f"--enable_wandb_log: {tmp_path / 'out' / 'wandb_log'} is a file, not a folder; "
                              f"move it or choose another --output_path")


def test_random_bytes_named_as_the_ip_adapter_are_one_line(tmp_path):
    """Recognition of a file it cannot read ends in one line naming the file, whichever family tries it first."""
    from difftune.core.family import recognise
    from difftune.models.detect import as_model_config

    path = tmp_path / "FLUX.1-dev-IP-Adapter" / "ip-adapter.bin"
    path.parent.mkdir()
    path.write_bytes(np.random.RandomState(0).bytes(5000))
    with pytest.raises(UserError) as err:
        recognise([as_model_config(str(path))])
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{path}: not a plain tensor state dict")


# -- defects 5 and 6: the cache ---------------------------------------------------------------------------------

def _cache(root):
    import torch

    from difftune.cache import CacheManifest, CacheWriter

    manifest = CacheManifest.new(family="toy", fingerprint={"units": ["U@1"]}, frontier=None,
                                 expected_ids=["a", "b"])
    with CacheWriter(root, manifest=manifest) as w:
        for i, sid in enumerate(["a", "b"]):
            w.write(sid, {"latents": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + i, "prompt": sid})
    (index,) = [p for p in root.rglob("*.json") if json.loads(p.read_text()).get("tensor_file")]
    return index, index.parent / json.loads(index.read_text())["tensor_file"]


def test_cached_latent_reshaped_with_the_same_bytes_is_refused_by_stage_2(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from difftune.cache import CacheReader
    from difftune.cache.verify import verify_cache

    index, tensors = _cache(tmp_path / "cache")
    with safe_open(str(tensors), framework="pt") as f:
        meta, values = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = next(iter(values))
    values[key] = values[key].reshape(4, 3, 2)  # the same bytes, another shape
    save_file(values, str(tensors), metadata=meta)
    assert not verify_cache(tmp_path / "cache").ok
    reader = CacheReader(tmp_path / "cache", log=None)
    with pytest.raises(DataError) as err:
        for i in range(len(reader)):
            reader[i]
    msg = str(err.value)
    assert "\n" not in msg and str(tensors) in msg and "stored as float32[4, 3, 2], index says float32[2, 3, 4]" in msg


def test_cache_index_pointing_outside_the_cache_is_refused(tmp_path):
    import shutil

    from difftune.cache import CacheReader
    from difftune.cache.verify import verify_cache

    index, tensors = _cache(tmp_path / "cache")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tensors, outside)
    data = json.loads(index.read_text())
    for target in (os.path.relpath(outside, index.parent), str(outside)):
        data["tensor_file"] = target
        index.write_text(json.dumps(data))
        report = verify_cache(tmp_path / "cache")
        assert any("outside the cache folder" in p and str(index) in p for p in report.problems), report.problems
        with pytest.raises(UserError, match="outside the cache folder"):
            CacheReader(tmp_path / "cache", log=None)
    os.remove(tensors)
    os.symlink(outside, tensors)  # a link out of the cache, under the expected name
    data["tensor_file"] = tensors.name
    index.write_text(json.dumps(data))
    with pytest.raises(UserError, match="outside the cache folder"):
        CacheReader(tmp_path / "cache", log=None)


# -- defect 6: damaged training state ---------------------------------------------------------------------------

@pytest.fixture
def saved_state(tmp_path, tiny_repo):
    from conftest import make_image_dataset, model_paths_json, run_train

    meta = make_image_dataset(tmp_path / "data", n=2)
    common = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 2, "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
              "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype",
              "float32", "--no_progress", "--save_state_steps", 2, "--num_epochs", 2]
    run_train(*common, "--max_steps", 2)
    (state,) = (tmp_path / "out" / "state").glob("step-*")
    return {"common": common, "state": state, "out": tmp_path / "out"}


def _resume(saved, *extra):
    from conftest import run_train

    return run_train(*saved["common"], "--resume_from_checkpoint", "latest", *extra)


def _damage(path, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, values = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = sorted(k for k in values if values[k].is_floating_point())[0]
    values[key] = edit(values[key].clone())
    save_file(values, str(path), metadata=meta)
    return key


@pytest.mark.parametrize("name", ["optimizer.safetensors", "weights.safetensors"])
def test_nan_in_a_saved_state_is_refused_naming_the_file(saved_state, name):
    path = saved_state["state"] / name
    key = _damage(path, lambda t: t.view(-1).fill_(float("nan")).view(t.shape))
    before = {p: p.read_bytes() for p in saved_state["out"].glob("*.safetensors")}
    with pytest.raises(UserError) as err:
        _resume(saved_state)
    import re

    assert re.fullmatch(rf"{re.escape(str(path))}: tensor '{re.escape(key)}' holds [1-9]\d* NaN and 0 infinite "
                        rf"value\(s\)", str(err.value)), str(err.value)
    assert {p: p.read_bytes() for p in saved_state["out"].glob("*.safetensors")} == before  # no NaN LoRA saved


def test_global_step_past_the_end_is_refused_and_replaces_nothing(saved_state):
    state_json = saved_state["state"] / "state.json"
    meta = json.loads(state_json.read_text())
    meta["position"]["global_step"] = 999
    state_json.write_text(json.dumps(meta))
    args = saved_state["out"] / "training_args.json"
    before = args.read_bytes()
    with pytest.raises(UserError) as err:
        _resume(saved_state)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--resume_from_checkpoint {saved_state['state']}: its global_step 999 "
                                              f"is at or past this run's last step (8)")
    assert args.read_bytes() == before


def test_cut_weights_file_in_a_state_names_the_file(saved_state):
    path = saved_state["state"] / "weights.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 100])
    with pytest.raises(UserError) as err:
        _resume(saved_state)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and "truncated" in msg


# -- defect 5: files outside the data set ------------------------------------------------------------------------

def test_metadata_paths_outside_the_data_set_are_refused_unless_allowed(tmp_path):
    from PIL import Image

    from difftune.data.dataset import UnifiedDataset

    data, other = tmp_path / "data", tmp_path / "other"
    data.mkdir(), other.mkdir()
    Image.new("RGB", (16, 16), "red").save(data / "in.png")
    Image.new("RGB", (16, 16), "blue").save(other / "out.png")
    os.symlink(other / "out.png", data / "link.png")
    for value in ("../other/out.png", str(other / "out.png"), "link.png"):
        meta = data / "meta.csv"
        meta.write_text(f"image,prompt\nin.png,a\n{value},b\n")
        with pytest.raises(DataError) as err:
            UnifiedDataset(data, meta, progress=False)
        assert str(err.value) == (f"{meta} row 2 'image': {value} resolves to {other / 'out.png'}, outside the data "
                                  f"set folder {data}; pass --allow_paths_outside_dataset to read files there")
        ds = UnifiedDataset(data, meta, progress=False, allow_paths_outside=True)
        assert len(ds) == 2 and ds[1]["image"].getpixel((0, 0)) == (0, 0, 255)


def test_allow_paths_outside_dataset_is_a_train_flag():
    from difftune.cli.args import training_parser

    # the parser `difftune train` reads its flags with (in this process: no interpreter start, ~8 s of imports)
    parser = training_parser()
    assert "--allow_paths_outside_dataset" in parser.format_help()
    args = parser.parse_args(["--dataset_base_path", "d", "--allow_paths_outside_dataset"])
    assert args.allow_paths_outside_dataset


# -- defect 3: late and wrong row errors --------------------------------------------------------------------------

def test_flux_eligen_prompts_and_masks_are_counted_up_front_naming_the_row(tmp_path):
    """FLUX.1 EliGen with 3 prompts and 2 masks named no row (it failed in the denoiser); the prompts may be a JSON
    list written in a CSV cell."""
    from PIL import Image

    from difftune.core.family import get_family
    from difftune.data import UnifiedDataset

    for name in ("a.png", "m1.png", "m2.png"):
        Image.new("RGB", (32, 32)).save(tmp_path / name)
    rows = [{"image": "a.png", "prompt": "two", "eligen_entity_prompts": ["a", "b"],
             "eligen_entity_masks": ["m1.png", "m2.png"]},
            {"image": "a.png", "prompt": "three", "eligen_entity_prompts": ["a", "b", "c"],
             "eligen_entity_masks": ["m1.png", "m2.png"]}]
    (tmp_path / "meta.json").write_text(json.dumps(rows))
    pairs = get_family("flux").pipeline.paired_columns()
    assert ("eligen_entity_prompts", "eligen_entity_masks") in pairs
    keys = dict(data_file_keys=("image", "eligen_entity_masks"),
                extra_inputs=("eligen_entity_prompts", "eligen_entity_masks"), paired_columns=pairs)
    with pytest.raises(DataError, match=r"meta.json row 2: 'eligen_entity_prompts' has 3 entries and "
                                        r"'eligen_entity_masks' 2; they go in pairs"):
        UnifiedDataset(tmp_path, tmp_path / "meta.json", **keys)
    (tmp_path / "meta.csv").write_text('image,prompt,eligen_entity_prompts,eligen_entity_masks\n'
                                       'a.png,one,"[""a"", ""b""]",m1.png\n')
    with pytest.raises(DataError, match=r"meta.csv row 1: 'eligen_entity_prompts' has 2 entries and "
                                        r"'eligen_entity_masks' 1"):
        UnifiedDataset(tmp_path, tmp_path / "meta.csv", **keys)


@pytest.mark.parametrize("extra_row", [1, 2])
def test_a_csv_row_with_an_extra_field_is_named(tmp_path, extra_row):
    """A first row with an extra field shifted every value one column left (pandas read the first column as an index)
    and was blamed on the next row's empty prompt; a later one was 'line 3' of the file."""
    from difftune.data.dataset import read_metadata

    rows = ["a.png,a dog", "b.png,a cat", "c.png,a bird"]
    rows[extra_row - 1] += ",extra"
    (tmp_path / "m.csv").write_text("\n".join(["image,prompt", *rows]) + "\n")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'm.csv'} row {extra_row}: 3 fields, the header names 2 "
                                        rf"columns \(image, prompt\); quote a value with a comma in it"):
        read_metadata(tmp_path / "m.csv")
    (tmp_path / "m.csv").write_text('image,prompt\n\na.png,"a dog, running"\n')
    assert read_metadata(tmp_path / "m.csv") == [{"image": "a.png", "prompt": "a dog, running"}]


# -- left from the last round -------------------------------------------------------------------------------------

@pytest.mark.parametrize("slot", ["controlnet", "value_controller"])
def test_a_fully_trained_controlnet_or_value_controller_saves_in_names_that_load_back(slot):
    """`--full_format original` writes the released file's names (`models.0.` / `encoders.0.` dropped); the default
    writes the slot's names, `pipe.<slot>.` less --remove_prefix_in_ckpt, as the reference's trained files. Either
    loads back as the model it was; before, `--full_format original` was refused for both."""
    import torch

    from difftune.core.family import get_family
    from difftune.models.detect import match_header
    from difftune.training.config import RunConfig
    from difftune.training.stages import full_converters

    family = get_family("flux")
    spec = next(c for c in family.components if c.name == slot)
    label, config = next(iter(spec.known_configs.items()))
    state = {k: torch.empty(s, device="meta") for k, s in spec.signature(config).items()}
    native = family.full_native_keys[slot](state)
    assert not any(k.startswith(("models.0.", "encoders.0.")) for k in native)
    for saved in ({k: tuple(v.shape) for k, v in native.items()},  # --full_format original
                  {f"{slot}.{k}": tuple(v.shape) for k, v in state.items()},  # --remove_prefix_in_ckpt pipe.
                  {f"pipe.{slot}.{k}": tuple(v.shape) for k, v in state.items()}):
        match = match_header(saved, [spec])
        assert match is not None and match.label == label
    run = RunConfig(trainable_models=slot, full_format="original")
    assert full_converters(run, family) == {slot: family.full_native_keys[slot]}


def test_difftune_sample_takes_insert_anything_size_with_the_training_default():
    from difftune.cli.sample import family_inputs, sample_parser
    from difftune.core.family import get_family
    from difftune.families.flux.insert_anything import SIZE

    flux = get_family("flux")
    options, call = family_inputs(sample_parser().parse_args(["--prompt", "p", "--insert_anything_size", "512"]), flux)
    assert options.insert_anything_size == 512 and call["insert_anything_size"] == 512
    options, call = family_inputs(sample_parser().parse_args(["--prompt", "p"]), flux)
    assert "insert_anything_size" not in call  # unset: the pipeline's default, which is the training flag's
    assert options.insert_anything_size == SIZE == 768
    with pytest.raises(UserError, match="--insert_anything_size 500: a multiple of 16"):
        family_inputs(sample_parser().parse_args(["--prompt", "p", "--insert_anything_size", "500"]), flux)
    # a training-and-sampling flag that is no call input (a tokenizer path) is still not handed to the call
    _, call = family_inputs(sample_parser().parse_args(["--prompt", "p", "--tokenizer_1_path", "x"]), flux)
    assert "tokenizer_1_path" not in call


def test_step1x_samples_at_the_reference_images_size_in_the_cli_as_in_python():
    """`difftune sample` passed the family's 1024 x 1024 where the Python call takes the reference image's size."""
    import inspect

    from difftune.families.flux.step1x import Step1XEditPipeline

    params = inspect.signature(Step1XEditPipeline.__call__).parameters
    accepted = {*params, *Step1XEditPipeline.call_inputs(), *Step1XEditPipeline.call_settings()}
    cli = {k: v for k, v in Step1XEditPipeline.call_defaults.items() if k in accepted}  # as `difftune sample`
    assert cli["height"] is None and cli["width"] is None
    assert all(params[k].default == v for k, v in cli.items())
