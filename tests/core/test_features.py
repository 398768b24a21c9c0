"""A feature owns what it does: its units (placed among the base pipeline's), its model slots, its data columns by
kind, its checks, its sampling inputs and negatives, its part of the denoiser call and its finishing step."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from difftune.core.features import ALIGNED_FRAMES, FRAMES, IMAGE, IMAGES, VALUE, Feature, RunContext, compose_units
from difftune.core.pipeline import BasePipeline
from difftune.core.units import PipelineUnit
from difftune.errors import UserError


def unit(name, inputs=(), outputs=(), replaces=(), feature="base", before=()):
    return type(name, (PipelineUnit,), {"inputs": tuple(inputs), "outputs": tuple(outputs),
                                        "replaces": tuple(replaces), "feature": feature, "before": tuple(before)})()


BASE_UNITS = lambda: [unit("Shape", ["h"], ["h"]), unit("Noise", ["h"], ["noise"]),  # noqa: E731
                      unit("Latents", ["noise"], ["latents"]), unit("Prompt", ["prompt"], ["embeds"])]


def names(units):
    return [u.name for u in units]


def test_feature_units_are_placed_among_the_base_units():
    """A stand-in goes right after the unit it replaces; any other unit at the end, in feature order."""
    stand_in = unit("RefNoise", ["h", "refs"], ["noise"], replaces=["Noise"])
    ref_latents = unit("RefLatents", ["noise", "refs"], ["latents"], replaces=["Latents"])
    context = unit("Context", ["video"], ["context"])
    first = Feature("first", columns=("video",), units=(stand_in, ref_latents, context))
    second = Feature("second", columns=("pose",), units=(unit("Pose", ["pose"], ["pose_latents"]),))
    units = compose_units(BASE_UNITS(), [first, second])
    assert names(units) == ["Shape", "Noise", "RefNoise", "Latents", "RefLatents", "Prompt", "Context", "Pose"]
    assert [u.feature for u in units] == ["base", "base", "first", "base", "first", "base", "first", "second"]


def test_a_stand_in_that_reads_a_later_value_goes_at_the_end():
    split = unit("Split", ["pose"], ["pose"])
    inpaint = unit("Inpaint", ["pose"], ["noise"], replaces=["Noise"])
    units = compose_units(BASE_UNITS(), [Feature("a", units=(split,)), Feature("b", units=(inpaint,))])
    assert names(units)[-2:] == ["Split", "Inpaint"]


def test_a_unit_goes_before_the_first_unit_it_names():
    """`before`: right before the first named unit listed so far (a size unit before the shape check, conditions
    before the prompt), in feature order; a name not listed leaves the unit to the other rules."""
    size = type("Size", (PipelineUnit,), {"outputs": ("h",), "before": ("Shape",)})()
    cond_a = type("CondA", (PipelineUnit,), {"inputs": ("a",), "before": ("Prompt",)})()
    cond_b = type("CondB", (PipelineUnit,), {"inputs": ("b",), "before": ("CondA", "Prompt")})()
    late = type("Late", (PipelineUnit,), {"before": ("Missing",)})()
    features = [Feature("a", units=(cond_a,)), Feature("s", units=(size,)), Feature("b", units=(cond_b,)),
                Feature("l", units=(late,))]
    assert names(compose_units(BASE_UNITS(), features)) == ["Size", "Shape", "Noise", "Latents", "CondB", "CondA",
                                                             "Prompt", "Late"]


def test_a_unit_that_must_run_before_others_goes_right_before_the_first_of_them():
    """Encoders of two features ahead of the prompt encoder, in feature order; a stand-in for the prompt encoder
    after it; a `before` naming no unit of the pipeline is at the end."""
    edit = unit("EditImage", ["edit"], ["edit_latents"], before=["Prompt"])
    edit_prompt = unit("EditPrompt", ["prompt", "edit"], ["embeds"], replaces=["Prompt"])
    control = unit("Control", ["control"], ["control_latents"], before=["Missing", "Prompt"])
    stray = unit("Stray", ["x"], ["y"], before=["Missing"])
    units = compose_units(BASE_UNITS(), [Feature("edit", units=(edit, edit_prompt)),
                                         Feature("control", units=(control, stray))])
    assert names(units) == ["Shape", "Noise", "Latents", "EditImage", "Control", "Prompt", "EditPrompt", "Stray"]


def test_a_unit_listed_by_the_pipeline_is_not_added_twice_and_a_foreign_unit_is_refused():
    listed = unit("Context", ["video"], ["context"])
    units = compose_units([*BASE_UNITS(), listed], [Feature("a", units=(unit("Context", ["video"], ["context"]),))])
    assert names(units).count("Context") == 1
    with pytest.raises(TypeError, match="serves 'other'"):
        compose_units(BASE_UNITS(), [Feature("a", units=(unit("X", feature="other"),))])


class _Scaled(Feature):
    def check(self, context, features):
        if context.option("scale_ok") is False:
            raise UserError("scale: refused by its own check")

    def negatives(self, values):
        return {"negative_hint": "nothing"} if values.get("hint") is not None else {}

    def finish(self, pipe, latents, values):
        return latents[:, 1:]


SCALED = _Scaled("scaled", columns=("hint",), units=(unit("Hint", ["hint"], ["hint_embeds"]),), slots=("adapter",),
                 loss_models=("adapter",), needs={"adapter": "the adapter file"},
                 inputs={"hint": VALUE, "clip": FRAMES, "aligned": ALIGNED_FRAMES, "picture": IMAGE,
                         "pictures": IMAGES},
                 call_inputs={"hint": None}, call_settings={"hint_scale": 1.0})


class Toy(BasePipeline):
    model_names = ("denoiser", "encoder")
    loss_models = ("denoiser",)
    features = (SCALED,)

    def __init__(self):
        super().__init__()
        self.units = BASE_UNITS()


class Plain(BasePipeline):
    model_names = ("denoiser", "encoder")
    loss_models = ("denoiser",)


def test_a_pipeline_gets_its_features_slots_units_and_denoiser_models():
    assert Toy.model_names == ("denoiser", "encoder", "adapter")
    assert Toy.loss_models == ("denoiser", "adapter")
    assert names(Toy().all_units) == ["Shape", "Noise", "Latents", "Prompt", "Hint"]
    assert Plain.model_names == ("denoiser", "encoder")  # a class without the feature has none of its slots


def test_checks_name_the_missing_model_and_run_the_feature_check():
    features = frozenset({"base", "scaled"})
    given = RunContext(columns=frozenset({"hint"}), models={"denoiser": {}})
    with pytest.raises(UserError, match=r"^hint: given, but no adapter model is loaded: name the adapter file in "
                                        r"--model_paths"):
        Toy.check_features(given, features)
    # stage 1 (no denoiser named): the adapter is not needed yet
    Toy.check_features(RunContext(columns=frozenset({"hint"})), features)

    class Options:
        scale_ok = False

    with pytest.raises(UserError, match="refused by its own check"):
        Toy.check_features(RunContext(columns=frozenset({"hint"}), models={"denoiser": {}, "adapter": {}},
                                      options=Options()), features)


def test_call_inputs_settings_and_negatives():
    pipe = Toy()
    values, settings = pipe.take_call_inputs({"hint": "up"})
    assert values == {"hint": "up", "negative_hint": "nothing"}
    assert settings == {"hint_scale": 1.0}
    assert pipe.take_call_inputs({"hint_scale": 0.5})[1] == {"hint_scale": 0.5}
    with pytest.raises(TypeError, match=r"unexpected input\(s\) \['hnit'\]; its features take hint, hint_scale"):
        pipe.take_call_inputs({"hnit": 1})


def test_row_columns_by_kind_with_one_line_errors():
    pipe = Toy()
    frame = Image.new("RGB", (8, 8))
    row = {"_row": 3, "hint": float("nan"), "clip": [frame, frame], "aligned": [frame] * 5, "picture": [frame]}
    out = pipe.feature_data(row, num_frames=5)
    assert set(out) == {"clip", "aligned", "picture"}  # an empty CSV cell (NaN) is left out
    assert out["picture"] is frame and len(out["clip"]) == 2
    with pytest.raises(UserError, match=r"^row 4: 'aligned' has 2 frames, the clip 5"):
        pipe.feature_data({**row, "aligned": [frame, frame]}, num_frames=5)
    with pytest.raises(UserError, match=r"^row 4: 'picture' must be an image file"):
        pipe.feature_data({**row, "picture": "not loaded"}, num_frames=5)


def test_a_clip_column_takes_a_list_a_tuple_or_one_image_and_refuses_other_values():
    """The one frames helper (media.image.as_image_list, Wan's too): a tuple is a clip, one image a one-frame clip; a
    value that is no image (a number from a CSV cell) is refused naming the row, not a TypeError."""
    from difftune.media.image import as_image_list

    pipe = Toy()
    frame = Image.new("RGB", (8, 8))
    assert pipe.feature_data({"clip": (frame, frame)})["clip"] == [frame, frame]
    assert pipe.feature_data({"clip": frame})["clip"] == [frame]
    with pytest.raises(UserError, match=r"^row 5: 'clip' must be a clip or an image file"):
        pipe.feature_data({"_row": 4, "clip": 3.0})
    assert as_image_list(None) == [] and as_image_list(frame) == [frame] and as_image_list((frame,)) == [frame]


def test_a_column_of_several_images_is_always_a_list():
    pipe = Toy()
    a, b = Image.new("RGB", (8, 8)), Image.new("RGB", (4, 4))
    assert pipe.feature_data({"pictures": a})["pictures"] == [a]
    assert pipe.feature_data({"pictures": [a, b]})["pictures"] == [a, b]
    with pytest.raises(UserError, match=r"^row 3: 'pictures' must be image file\(s\) listed in --data_file_keys "
                                        r"\(e.g. --data_file_keys image,pictures\), got 'a.png'"):
        pipe.feature_data({"_row": 2, "pictures": "a.png"})


def test_a_list_of_images_column():
    """IMAGES: a list of images as it is, one image as a list of one; anything else is refused naming the row."""
    pipe = Toy()
    a, b = Image.new("RGB", (8, 8)), Image.new("RGB", (4, 4))
    assert pipe.feature_data({"pictures": [a, b]})["pictures"] == [a, b]
    assert pipe.feature_data({"pictures": a})["pictures"] == [a]
    for bad in (["a.png"], [a, "b.png"], []):
        with pytest.raises(UserError, match=r"^row 8: 'pictures' must be image file\(s\)"):
            pipe.feature_data({"_row": 7, "pictures": bad})


def test_finish_runs_for_the_calls_features_only():
    pipe = Toy()
    latents = torch.zeros(1, 4, 2)
    assert pipe.finish(latents, {"hint": "up"}).shape == (1, 3, 2)
    assert pipe.finish(latents, {}).shape == (1, 4, 2)


def test_messages_count_rows_from_one_as_the_metadata_file_does():
    """`_row` is the 0-based index; the data set's messages said "row N" counted from 1 and the pipelines' and
    features' the index itself, so one bad row was named two ways. Every message now counts from 1."""
    from difftune.errors import row_label

    assert row_label({"_row": 0}) == "row 1" and row_label({"_row": 3}) == "row 4"
    assert row_label({}) == "row ?" and row_label({"_row": "?"}) == "row ?" and row_label(5) == "row 6"
