"""The stage-1/stage-2 split computed from unit declarations."""

from difftune.core.units import PipelineUnit
from difftune.core.graph import split_units
from difftune.families.qwen_image import QwenImagePipeline

SFT_LOSS_READS = ("input_latents", "prompt_embeds", "prompt_embeds_mask", "edit_latents")


def U(name, reads=(), writes=(), models=()):
    return type(name, (PipelineUnit,), {"inputs": tuple(reads), "outputs": tuple(writes), "models": tuple(models)})()


def qwen_split(trainable):
    pipe = QwenImagePipeline()
    return split_units(pipe.units, trainable, SFT_LOSS_READS, settings=pipe.settings, loss_models=("dit",))


def names(units):
    return [u.name for u in units]


def test_lora_on_dit_puts_every_unit_in_stage_1():
    s = qwen_split(["dit"])
    assert names(s.stage2) == []
    assert len(s.stage1) == 8
    # only what the loss reads is cached; noise, latents, images, settings are not
    assert s.frontier == ("edit_latents", "input_latents", "prompt_embeds", "prompt_embeds_mask")
    assert s.stage1_models == ("text_encoder", "vae") and s.stage2_models == ("dit",)


def test_lora_on_text_encoder_moves_prompt_encoding_and_caches_the_prompt():
    s = qwen_split(["dit", "text_encoder"])
    assert names(s.stage2) == ["QwenImageEntityControl", "QwenImagePromptEmbedder"]
    # the prompt string (data) and the resized edit image (stage-1 output) are cached instead of embeddings;
    # EliGen's entity prompts and masks too, with the size their masks are taken at
    assert s.frontier == ("edit_image", "edit_latents", "eligen_entity_masks", "eligen_entity_prompts", "height",
                          "input_latents", "prompt", "width")
    assert s.stage2_models == ("dit", "text_encoder")
    assert s.stage1_models == ("vae",)


def test_trainable_vae_moves_encoders_and_their_readers():
    s = qwen_split(["vae"])
    # the prompt embedder reads edit_image, which the (now stage-2) edit embedder writes
    assert names(s.stage2) == ["QwenImageInputImageEmbedder", "QwenImageEditImageEmbedder",
                               "QwenImageContextImageEmbedder", "QwenImageBlockwiseControlNetEmbedder",
                               "QwenImagePromptEmbedder"]
    assert "input_image" in s.frontier and "noise" in s.frontier and "prompt" in s.frontier
    assert "rand_device" not in s.frontier and "edit_image_auto_resize" not in s.frontier


def test_write_after_read_forces_stage_2():
    units = [U("A", reads=["x"], writes=["y"], models=["m"]), U("B", reads=["z"], writes=["x"])]
    s = split_units(units, ["m"], loss_reads=["y"])
    # B overwrites x, which stage-2 A reads first: running B in stage 1 would hand A the wrong x
    assert names(s.stage2) == ["A", "B"]
    assert s.frontier == ("x", "z")


def test_write_after_write_forces_stage_2():
    units = [U("A", writes=["x"], models=["m"]), U("B", writes=["x"])]
    s = split_units(units, ["m"], loss_reads=["x"])
    assert names(s.stage2) == ["A", "B"]


def test_independent_later_unit_stays_in_stage_1():
    units = [U("A", reads=["p"], writes=["e"], models=["m"]), U("B", reads=["img"], writes=["lat"])]
    s = split_units(units, ["m"], loss_reads=["e", "lat"])
    assert names(s.stage1) == ["B"] and names(s.stage2) == ["A"]
    assert s.frontier == ("lat", "p")


def test_transitive_readers_iterate_to_fixed_point():
    units = [U("A", reads=["i"], writes=["a"], models=["m"]), U("B", reads=["a"], writes=["b"]),
             U("C", reads=["b"], writes=["c"]), U("D", reads=["i"], writes=["d"])]
    s = split_units(units, ["m"], loss_reads=["c", "d"])
    assert names(s.stage2) == ["A", "B", "C"] and names(s.stage1) == ["D"]
    assert s.frontier == ("d", "i")


def test_settings_are_never_cached():
    units = [U("A", reads=["x", "use_ckpt"], writes=["y"], models=["m"])]
    s = split_units(units, ["m"], loss_reads=["y", "use_ckpt"], settings=["use_ckpt"])
    assert s.frontier == ("x",)
