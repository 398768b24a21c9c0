"""The list flags (--data_file_keys, --extra_inputs, --trainable_models, --lora_target_modules) are tuples of names in
the run configuration, parsed once however it is built; what a run records of them (the stage-1 cache's
fingerprint, the resume settings, training_args.json) is their text as before, so existing caches and states stay
valid."""

import json

import pytest

from conftest import make_image_dataset, model_paths_json, run_train, setup_run, train_args
from difftune.errors import UserError
from difftune.training.config import RunConfig
from difftune.training.state import changed_settings

LISTS = ("data_file_keys", "extra_inputs", "trainable_models", "lora_target_modules")


def test_the_list_flags_are_tuples_of_names_from_every_form():
    flags = ["--dataset_base_path", ".", "--data_file_keys", "image, mask,image", "--extra_inputs", "a, b,a,,",
             "--trainable_models", " vae", "--lora_target_modules", "to_q,to_k ,to_q"]
    wanted = {"data_file_keys": ("image", "mask"), "extra_inputs": ("a", "b"), "trainable_models": ("vae",),
              "lora_target_modules": ("to_q", "to_k")}
    from_command_line = RunConfig.from_namespace(train_args(*flags))
    from_shared_flags = RunConfig.parse(flags)
    from_python = RunConfig(dataset_base_path=".", data_file_keys=["image", "mask", "image"], extra_inputs=("a", " b"),
                            trainable_models=["vae"], lora_target_modules=["to_q", "to_k", "to_q"])
    for config in (from_command_line, from_shared_flags, from_python, from_python.replace(seed=3)):
        assert {name: getattr(config, name) for name in LISTS} == wanted
        assert all(type(getattr(config, name)) is tuple for name in LISTS)
    assert from_command_line.fully_trained == ["vae"]


def test_absent_list_flags_are_empty_and_data_file_keys_defaults_to_image_and_video():
    config = RunConfig(dataset_base_path=".")
    assert config.data_file_keys == ("image", "video")
    assert config.extra_inputs == config.trainable_models == config.lora_target_modules == ()
    assert RunConfig(dataset_base_path=".", extra_inputs=None, lora_target_modules="").extra_inputs == ()


def test_the_record_holds_the_flags_text():
    """training_args.json: the text a command line gives (null for an absent list), as before the parsing."""
    record = json.loads(json.dumps(RunConfig.parse(["--dataset_base_path", ".", "--extra_inputs", "a, b"]).record()))
    assert record["extra_inputs"] == "a,b" and record["data_file_keys"] == "image,video"
    assert record["trainable_models"] is None and record["lora_target_modules"] is None


def test_the_stage1_fingerprint_holds_the_flags_text_as_before(tmp_path, tiny_repo):
    """An existing cache keeps its fingerprint: the list flags are in it as the text they were given."""
    from difftune.cache import fingerprint_hash
    from difftune.training.stage1 import stage1_fingerprint

    meta = make_image_dataset(tmp_path / "data", n=2)
    common = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--model_paths",
              model_paths_json(tiny_repo), "--lora_base_model", "dit", "--lora_target_modules", "to_q",
              "--torch_dtype", "float32"]
    plain = stage1_fingerprint(setup_run(*common))["preprocessing"]
    assert plain["data_file_keys"] == "image,video" and plain["extra_inputs"] is None
    given = stage1_fingerprint(setup_run(*common, "--data_file_keys", "image"))
    assert given["preprocessing"]["data_file_keys"] == "image"
    spaced = stage1_fingerprint(setup_run(*common, "--data_file_keys", " image,image"))
    assert fingerprint_hash(spaced) == fingerprint_hash(given)  # the same names: the same cache


def test_a_resume_setting_saved_as_comma_text_is_the_same_as_its_names():
    saved = {"lora_target_modules": "to_q, to_k,to_q", "trainable": ["dit"], "task": "sft"}
    assert changed_settings(saved, {**saved, "lora_target_modules": "to_q,to_k"}) == ([], None)
    changed, _ = changed_settings(saved, {**saved, "lora_target_modules": "to_q"})
    assert changed == ["lora_target_modules ('to_q, to_k,to_q' -> 'to_q')"]
    changed, _ = changed_settings({"task": "sft"}, {"task": " sft"})  # only the list flags are read as names
    assert changed == ["task ('sft' -> ' sft')"]


def test_a_state_saved_with_the_lora_targets_as_given_resumes(tmp_path, tiny_repo):
    """A state saved before the list flags were parsed holds --lora_target_modules as the user wrote it
    ("to_q, to_q"): resuming it with the same targets continues; other targets are refused, as before."""
    meta = make_image_dataset(tmp_path / "data", n=2)
    common = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 2, "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
              "--lora_base_model", "dit", "--lora_rank", 2, "--torch_dtype", "float32", "--no_progress",
              "--save_state_steps", 2]
    run_train(*common, "--lora_target_modules", "to_q", "--max_steps", 2)
    (state,) = (tmp_path / "out" / "state").glob("step-*")
    meta_json = json.loads((state / "state.json").read_text())
    assert meta_json["settings"]["lora_target_modules"] == "to_q"  # the saved JSON as before: the flag's text
    with pytest.raises(UserError, match=r"lora_target_modules \('to_q' -> 'to_q,to_k'\)"):
        run_train(*common, "--lora_target_modules", "to_q,to_k", "--resume_from_checkpoint", "latest")
    meta_json["settings"]["lora_target_modules"] = "to_q, to_q"  # as an earlier difftune saved it
    (state / "state.json").write_text(json.dumps(meta_json))
    summary = run_train(*common, "--lora_target_modules", "to_q", "--resume_from_checkpoint", "latest",
                        "--max_steps", 3)
    assert summary["steps"] == 3
