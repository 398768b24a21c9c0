"""A target of several streams (a clip and its sound) logs each stream's loss beside the total, so a run whose
audio loss stops moving shows it: train/loss_<stream> in the trackers, the mean over the step's samples that have
the stream (a clip without sound adds no audio loss)."""

from __future__ import annotations

import json

import support.toys  # noqa: F401  (registers toy_av: a clip with its sound)
from conftest import run_train
from support import tiny_family


def _scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = sorted(folder.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard events under {folder}"
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_each_stream_of_a_clip_with_sound_logs_its_own_loss(tmp_path):
    t = tiny_family("toy_av", tmp_path / "models")
    meta = t.write_dataset(tmp_path / "data")
    run_train("--family", "toy_av", "--model_paths", json.dumps(t.model_paths), "--torch_dtype", "float32",
              "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path", tmp_path / "out",
              "--lora_base_model", t.lora_base_model, "--lora_target_modules", t.lora_target_modules,
              "--learning_rate", 1e-3, "--num_epochs", 1, "--seed", 5, "--no_progress", *t.flags)
    scalars = _scalars(tmp_path / "out")
    total = dict(scalars["train/loss"])
    video, audio = dict(scalars["train/loss_video"]), dict(scalars["train/loss_audio"])
    assert sorted(total) == sorted(video) == sorted(audio) == [1, 2]
    for step in total:  # the two parts are the total (batch 1: each step one sample)
        assert abs(video[step] + audio[step] - total[step]) < 1e-4 * max(1.0, total[step])
        assert video[step] > 0 and audio[step] > 0
