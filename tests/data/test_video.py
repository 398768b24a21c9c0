"""The video data path: reading clips (PyAV, GIF via Pillow, stills), the --num_frames rule, bad clips' one-line
errors, the video data set (frame inputs, shapes, skipping), the cache fingerprint, and the writers."""

import types

import numpy as np
import pytest
from PIL import Image

from difftune.data import DataError, UnifiedDataset
from difftune.errors import UserError
from difftune.media.video import (VideoError, frame_grid, frames_to_keep, probe_video, read_video, write_animation,
                                  write_video)
from support import moving_circle_frames, write_example_video_dataset, write_tiny_clip

RED, BLUE = (200, 30, 60), (40, 60, 220)
CODEC_TOLERANCE = 12  # per channel, for a flat colour through 4:2:0 H.264/VP9/MPEG-4


CUT_4K1 = {"time_division_factor": 4, "time_division_remainder": 1}  # a VAE that takes 4k+1 frames (Wan's)


def solid(n, size=(64, 48), color=RED):
    return [Image.new("RGB", size, color) for _ in range(n)]


def encode(path, n, size=(64, 48), codec="libx264", options=None, container_options=None):
    """A clip of n flat RED frames written with PyAV directly (independent of write_video)."""
    import av

    with av.open(str(path), "w", options=container_options or {}) as out:
        stream = out.add_stream(codec, rate=8, options=options or {})
        stream.width, stream.height, stream.pix_fmt = size[0], size[1], "yuv420p"
        for _ in range(n):
            frame = av.VideoFrame.from_ndarray(np.full((size[1], size[0], 3), RED, np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def assert_colour(img, color, tol=CODEC_TOLERANCE):
    arr = np.asarray(img, dtype=np.int16)
    assert np.abs(arr - np.array(color)).max() <= tol, (arr.reshape(-1, 3).min(0), arr.reshape(-1, 3).max(0))


def one_line(excinfo, *parts):
    text = str(excinfo.value)
    assert "\n" not in text, text
    for part in parts:
        assert str(part) in text, (part, text)
    return text


# -- reading --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext,codec", [("mp4", "libx264"), ("mov", "libx264"), ("mkv", "libx264"), ("avi", "mpeg4"),
                                       ("webm", "libvpx-vp9")])
def test_a_clip_reads_back_with_its_frame_count_size_and_colour(tmp_path, ext, codec):
    path = encode(tmp_path / f"clip.{ext}", 9, size=(64, 48), codec=codec)
    frames = read_video(path)
    assert len(frames) == 9
    assert all(f.size == (64, 48) and f.mode == "RGB" for f in frames)
    for f in frames:
        assert_colour(f, RED)


def test_a_gif_reads_back_frame_for_frame(tmp_path):
    frames = moving_circle_frames(7, size=(40, 24))
    frames[0].save(tmp_path / "a.gif", save_all=True, append_images=frames[1:], duration=60, loop=0)
    assert len(read_video(tmp_path / "a.gif")) == 7  # no time division asked: every frame
    read = read_video(tmp_path / "a.gif", **CUT_4K1)
    assert len(read) == 5  # 7 frames: the largest 4k+1 is 5
    for want, got in zip(frames, read):  # two colours: a GIF keeps them exactly
        assert got.size == (40, 24) and got.tobytes() == want.tobytes()
    assert len(read_video(tmp_path / "a.gif", num_frames=3)) == 3


def test_a_still_image_is_a_one_frame_clip(tmp_path):
    Image.new("RGB", (30, 20), BLUE).save(tmp_path / "still.png")
    frames = read_video(tmp_path / "still.png", num_frames=81)
    assert len(frames) == 1 and frames[0].size == (30, 20) and frames[0].getpixel((3, 3)) == BLUE
    assert probe_video(tmp_path / "still.png").frames == 1


@pytest.mark.parametrize("available,num_frames,kept", [
    (100, 81, 81), (81, 81, 81), (80, 81, 77), (49, 81, 49), (10, 81, 9), (9, 81, 9), (8, 81, 5), (5, 81, 5),
    (4, 81, 1), (2, 81, 1), (1, 81, 1), (0, 81, 0), (10, 4, 4), (10, None, 9), (3, None, 1)])
def test_frames_to_keep_is_the_prefix_cut_to_4k_plus_1(available, num_frames, kept):
    assert frames_to_keep(available, num_frames, **CUT_4K1) == kept


def test_frames_to_keep_follows_the_time_division():
    assert frames_to_keep(10, 81, time_division_factor=1, time_division_remainder=0) == 10
    assert frames_to_keep(10, 81, time_division_factor=8, time_division_remainder=1) == 9
    assert frames_to_keep(7, 81, time_division_factor=8, time_division_remainder=1) == 1


def test_read_video_takes_the_first_frames(tmp_path):
    frames = moving_circle_frames(12, size=(64, 32))
    path = write_video(frames, tmp_path / "m.mp4", quality=10)
    got = read_video(path, num_frames=5)
    assert len(got) == 5
    # the circle moves left to right: frame i read back is nearest to written frame i, not another one
    for i, img in enumerate(got):
        errors = [np.abs(np.asarray(img, np.int16) - np.asarray(f, np.int16)).mean() for f in frames]
        assert int(np.argmin(errors)) == i
    assert len(read_video(path, num_frames=81, **CUT_4K1)) == 9  # 12 frames: cut to 4k+1
    assert len(read_video(path, num_frames=81)) == 12  # no time division asked: all it has
    assert len(read_video(path, num_frames=12, **CUT_4K1)) == 12  # enough frames: exactly as asked
    with pytest.raises(UserError):
        read_video(path, num_frames=0)


def test_a_rotated_clip_stands_up(tmp_path):
    import av

    with av.open(str(tmp_path / "r.mp4"), "w") as out:
        stream = out.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.set_display_rotation(90)  # counter-clockwise, as a phone records a portrait clip
        arr = np.zeros((32, 64, 3), np.uint8)
        arr[:, :32] = 255  # left half white
        for _ in range(2):
            for packet in stream.encode(av.VideoFrame.from_ndarray(arr, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    frame = read_video(tmp_path / "r.mp4")[0]
    assert frame.size == (32, 64)  # portrait
    arr = np.asarray(frame, np.int16)
    assert arr[48:, :].mean() > 200 and arr[:16, :].mean() < 50  # the left half turned to the bottom


# -- bad clips: one line naming the file (and, in a data set, the row) ------------------------------------
def bad_clip(tmp_path, kind):
    """(file name, words its error must contain)."""
    if kind == "truncated":  # moov at the end (PyAV's default): cut off, the header is gone
        data = encode(tmp_path / "whole.mp4", 9).read_bytes()
        (tmp_path / "bad.mp4").write_bytes(data[: len(data) // 2])
        return "bad.mp4", "no video stream"
    if kind == "truncated_faststart":  # header first: the pictures are cut off
        data = encode(tmp_path / "fs.mp4", 20, container_options={"movflags": "faststart"}).read_bytes()
        (tmp_path / "bad.mp4").write_bytes(data[: len(data) * 2 // 3])
        return "bad.mp4", "corrupt video"
    if kind == "truncated_intra":  # header first, every frame a key frame: it decodes until the cut, then stops
        import av

        with av.open(str(tmp_path / "i.mp4"), "w", options={"movflags": "faststart"}) as out:
            stream = out.add_stream("libx264", rate=8, options={"bf": "0", "g": "1"})
            stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
            for img in moving_circle_frames(40, (64, 48)):
                for packet in stream.encode(av.VideoFrame.from_image(img)):
                    out.mux(packet)
            for packet in stream.encode():
                out.mux(packet)
        data = (tmp_path / "i.mp4").read_bytes()
        (tmp_path / "bad.mp4").write_bytes(data[: len(data) // 2])
        return "bad.mp4", "truncated video: its header lists 40 frames, only"
    if kind == "zero_frames":  # a clip with its header and none of its pictures
        data = encode(tmp_path / "whole.mkv", 9).read_bytes()
        (tmp_path / "bad.mkv").write_bytes(data[: len(data) // 2])
        return "bad.mkv", "no frames"
    if kind == "garbage":
        (tmp_path / "bad.mp4").write_bytes(bytes(range(256)) * 8)
        return "bad.mp4", "unreadable or corrupt video"
    if kind == "unknown_codec":  # a valid AVI whose codec tag no decoder knows
        data = encode(tmp_path / "whole.avi", 9, codec="mpeg4").read_bytes()
        assert data.count(b"FMP4") == 2
        (tmp_path / "bad.avi").write_bytes(data.replace(b"FMP4", b"ZQ9X"))
        return "bad.avi", "unreadable codec"
    if kind == "empty":
        (tmp_path / "bad.mp4").write_bytes(b"")
        return "bad.mp4", "file is empty"
    if kind == "missing":
        return "gone.mp4", "file not found"
    raise AssertionError(kind)


BAD = ["truncated", "truncated_faststart", "truncated_intra", "zero_frames", "garbage", "unknown_codec", "empty",
       "missing"]
FOUND_WHEN_LOADED = ("truncated_intra",)  # its first frame decodes: the cheap pre-check passes it


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_clip_is_one_line_naming_the_file(tmp_path, kind):
    name, reason = bad_clip(tmp_path, kind)
    with pytest.raises(VideoError) as err:
        read_video(tmp_path / name)
    one_line(err, reason, tmp_path / name)
    assert isinstance(err.value, UserError)


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_clip_in_a_data_set_names_the_row_and_is_found_before_training(tmp_path, kind):
    meta = write_example_video_dataset(tmp_path, n=2, num_frames=5)
    name, reason = bad_clip(tmp_path, kind)
    with meta.open("a") as f:
        f.write(f'{name},"a bad clip"\n')
    op = UnifiedDataset.default_video_operator(tmp_path, num_frames=81)
    ds = UnifiedDataset(tmp_path, meta, data_file_keys="video", main_data_operator=op, precheck=False)
    with pytest.raises(DataError) as err:  # when loaded
        ds[2]
    one_line(err, "metadata.csv row 3 'video'", reason, tmp_path / name)
    skipping = UnifiedDataset(tmp_path, meta, data_file_keys="video", main_data_operator=op, on_bad_sample="skip")
    if kind in FOUND_WHEN_LOADED:
        with pytest.warns(UserWarning, match="skipping bad sample"):
            assert skipping.num_rows == 3 and skipping[2] is None  # left out when it fails to load
    else:
        with pytest.raises(DataError) as err:  # the pre-check, before any row is loaded
            UnifiedDataset(tmp_path, meta, data_file_keys="video", main_data_operator=op)
        one_line(err, "metadata.csv row 3 'video'", reason, tmp_path / name)
        assert skipping.num_rows == 2
    assert [b["row"] for b in skipping.bad_samples] == [3]
    assert reason in skipping.bad_samples[0]["reason"] and skipping.bad_samples[0]["key"] == "video"


def test_fewer_frames_than_asked_is_cut_not_refused(tmp_path):
    meta = write_example_video_dataset(tmp_path, n=2, num_frames=7, size=(32, 32))
    ds = UnifiedDataset(tmp_path, meta, data_file_keys="video",
                        main_data_operator=UnifiedDataset.default_video_operator(tmp_path, num_frames=81, **CUT_4K1))
    assert [len(ds[i]["video"]) for i in range(2)] == [5, 5]
    assert ds.bucket_keys() == [((("video", ((32, 32, 5),)),), ())] * 2


# -- the video data set -----------------------------------------------------------------------------------
def test_example_video_dataset_layout(tmp_path):
    meta = write_example_video_dataset(tmp_path, n=3, num_frames=9, size=(48, 32))
    lines = meta.read_text().splitlines()
    assert lines[0] == "video,prompt" and len(lines) == 4 and lines[1].startswith("video_1.mp4,")
    for i in (1, 2, 3):
        info = probe_video(tmp_path / f"video_{i}.mp4")
        assert (info.width, info.height, info.frames, info.codec) == (48, 32, 9, "h264")


def test_frames_are_resized_and_cropped_as_images_are(tmp_path):
    clip = moving_circle_frames(5, size=(96, 64))
    write_video(clip, tmp_path / "v.mp4")
    clip[0].save(tmp_path / "still.png")
    (tmp_path / "m.csv").write_text('video,prompt\nv.mp4,"a"\nstill.png,"b"\n')
    image_op = UnifiedDataset.default_image_operator(tmp_path, height=32, width=32)
    for size in (dict(height=32, width=32), dict(max_pixels=40 * 30)):
        op = UnifiedDataset.default_video_operator(tmp_path, num_frames=5, **size)
        ds = UnifiedDataset(tmp_path, tmp_path / "m.csv", data_file_keys="video", main_data_operator=op)
        video, still = ds[0]["video"], ds[1]["video"]
        want = (32, 32) if "height" in size else (32, 16)  # 96x64 over 1200 px: 42x28 -> rounded down to 16
        assert len(video) == 5 and {f.size for f in video} == {want}
        assert len(still) == 1 and still[0].size == want
        assert ds.bucket_keys()[0] == ((("video", ((*want, 5),)),), ())
        assert ds.bucket_keys()[1] == ((("video", ((*want, 1),)),), ())
    # one frame is treated exactly as the same picture read as an image
    assert still[0].tobytes() == UnifiedDataset.default_image_operator(tmp_path, max_pixels=40 * 30)(
        "still.png").tobytes()
    assert image_op("still.png").size == (32, 32)


def test_header_and_loaded_shapes_agree(tmp_path):
    """mp4 lists its frame count in the header; mkv does not (the row is loaded): the bucket keys agree."""
    write_tiny_clip(tmp_path / "a.mp4", 9, size=(32, 32))
    write_tiny_clip(tmp_path / "b.mkv", 9, size=(32, 32))
    (tmp_path / "m.csv").write_text('video,prompt\na.mp4,"a"\nb.mkv,"b"\n')
    ds = UnifiedDataset(tmp_path, tmp_path / "m.csv", data_file_keys="video",
                        main_data_operator=UnifiedDataset.default_video_operator(tmp_path, num_frames=5))
    assert ds.row_shape(0) == ds.row_shape(1) == (("video", ((32, 32, 5),)),)


FRAME_INPUTS = {"input_image": ("video", 0), "end_image": ("video", -1)}


def test_input_and_end_image_are_the_first_and_last_frames(tmp_path):
    meta = write_example_video_dataset(tmp_path, n=1, num_frames=9, size=(32, 32))
    op = UnifiedDataset.default_video_operator(tmp_path, num_frames=5)
    ds = UnifiedDataset(tmp_path, meta, data_file_keys="video", main_data_operator=op,
                        extra_inputs="input_image,end_image", frame_inputs=FRAME_INPUTS)
    item = ds[0]
    assert len(item["video"]) == 5
    assert item["input_image"].tobytes() == item["video"][0].tobytes()
    assert item["end_image"].tobytes() == item["video"][4].tobytes()
    assert item["input_image"].tobytes() != item["end_image"].tobytes()  # the ball moved
    with pytest.raises(DataError) as err:  # without frame_inputs it is a column the metadata lacks
        UnifiedDataset(tmp_path, meta, data_file_keys="video", main_data_operator=op, extra_inputs="input_image")
    one_line(err, "no column 'input_image'", "--extra_inputs")
    with pytest.raises(DataError) as err:  # the clip it comes from must be loaded
        UnifiedDataset(tmp_path, meta, data_file_keys="image", main_data_operator=op, extra_inputs="input_image",
                       frame_inputs=FRAME_INPUTS, present_keys_only=True)
    one_line(err, "--extra_inputs input_image", "'video'", "--data_file_keys")


def test_an_input_image_column_is_loaded_as_one_frame(tmp_path):
    write_tiny_clip(tmp_path / "v.mp4", 9, size=(32, 32))  # its header says 9 frames: shapes from the header
    Image.new("RGB", (32, 32), BLUE).save(tmp_path / "first.png")
    (tmp_path / "m.csv").write_text('video,input_image,prompt\nv.mp4,first.png,"a"\nv.mp4,v.mp4,"b"\n')
    op = UnifiedDataset.default_video_operator(tmp_path, num_frames=5)
    ds = UnifiedDataset(tmp_path, tmp_path / "m.csv", data_file_keys="video", main_data_operator=op,
                        extra_inputs="input_image", frame_inputs=FRAME_INPUTS)
    item = ds[0]
    assert isinstance(item["input_image"], Image.Image) and item["input_image"].getpixel((1, 1)) == BLUE
    assert ds.row_shape(0) == ds._loaded_shape(0) == (("video", ((32, 32, 5),)), ("input_image", ((32, 32),)))
    with pytest.raises(DataError) as err:
        ds[1]
    one_line(err, "m.csv row 2 'input_image'", "expected one image, got a clip of 5 frames", tmp_path / "v.mp4")


# -- --num_frames and the fingerprint ----------------------------------------------------------------------
def family(data="video", name="tiny_video", factor=4, remainder=1):
    from difftune.core.family import FamilySpec
    from difftune.core.target import FrameRule, ImageStream, Target, VideoStream

    stream = VideoStream(frames=FrameRule(81, factor, remainder), frame_inputs=FRAME_INPUTS, division=16) \
        if data == "video" else ImageStream(division=16)
    pipeline = types.SimpleNamespace(target=Target((stream,)), data_inputs=(), units=[])
    return FamilySpec(name=name, pipeline=types.new_class("TinyVideoPipeline", (), {}, lambda ns: ns.update(
        vars(pipeline))), components=())


def parse(tmp_path, *flags):
    from difftune.cli.args import check_training_args, training_parser

    args = training_parser().parse_args(["--dataset_base_path", str(tmp_path), *flags])
    check_training_args(args)
    return args


def test_num_frames_is_checked_against_the_family(tmp_path):
    from difftune.training.config import FrameSettings, RunConfig, frame_settings

    def settings(*flags, fam=None):
        return frame_settings(RunConfig.from_namespace(parse(tmp_path, *flags)), fam or family())

    assert settings().num_frames == 81  # the family's default (Wan's: the reference's)
    assert settings("--num_frames", "49") == FrameSettings(49, 4, 1)
    with pytest.raises(UserError) as err:
        settings("--num_frames", "48")
    one_line(err, "--num_frames 48", "4k+1", "1, 5, 9")
    with pytest.raises(UserError) as err:
        settings("--num_frames", "49", fam=family(data="image", name="qwen_image"))
    assert str(err.value).startswith("--num_frames: not used: the qwen_image family trains on images")
    assert settings(fam=family(data="image")) is None
    with pytest.raises(UserError) as err:
        parse(tmp_path, "--num_frames", "0")
    one_line(err, "--num_frames 0", "at least 1 frame")


def test_the_cache_fingerprint_holds_the_frame_settings(tmp_path):
    from difftune.cache import fingerprint_hash
    from difftune.training.config import RunConfig, frame_settings
    from difftune.training.stage1 import stage1_fingerprint

    split = types.SimpleNamespace(stage1_models=set(), stage1=[], frontier=[])

    def fingerprint(fam, *flags):
        config = RunConfig.from_namespace(parse(tmp_path, *flags))
        config = config.replace(frames=frame_settings(config, fam), family_options=None)
        run = types.SimpleNamespace(config=config, split=split, family=fam, models=[], features=frozenset({"base"}),
                                    pipeline=types.SimpleNamespace(__name__="TinyVideoPipeline"))
        return stage1_fingerprint(run)

    video = family()
    a, b = fingerprint(video, "--num_frames", "49"), fingerprint(video, "--num_frames", "81")
    assert a["preprocessing"]["num_frames"] == 49 and b["preprocessing"]["num_frames"] == 81
    assert fingerprint_hash(a) != fingerprint_hash(b)
    assert fingerprint_hash(fingerprint(video)) == fingerprint_hash(b)  # the default is 81
    assert fingerprint_hash(fingerprint(video, "--num_frames", "49", "--height", "32", "--width", "32")) != \
        fingerprint_hash(a)
    image = fingerprint(family(data="image"))
    assert "num_frames" not in image["preprocessing"]  # image caches made before keep their fingerprint


# -- writing ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ext", ["mp4", "mkv", "avi", "webm"])
def test_write_video_round_trip(tmp_path, ext):
    frames = moving_circle_frames(9, size=(64, 48))
    path = write_video(frames, tmp_path / f"out.{ext}", fps=8)
    assert path.exists() and not list(tmp_path.glob(".*partial*"))
    read = read_video(path)
    assert len(read) == 9 and read[0].size == (64, 48)
    for want, got in zip(frames, read):
        diff = np.abs(np.asarray(want, np.int16) - np.asarray(got, np.int16))
        assert diff.mean() < 6, (ext, diff.mean())
    info = probe_video(path)
    assert info.fps == 8
    if ext == "mp4":
        assert info.codec == "h264"


def test_write_video_pads_odd_sides_and_refuses_bad_input(tmp_path):
    got = read_video(write_video(solid(5, size=(33, 17)), tmp_path / "odd.mp4"))
    assert len(got) == 5 and got[0].size == (34, 18)
    assert_colour(got[0], RED)
    with pytest.raises(UserError, match="cannot write video as '.xyz'"):
        write_video(solid(2), tmp_path / "a.xyz")
    with pytest.raises(UserError, match="one size"):
        write_video([*solid(1, (8, 8)), *solid(1, (10, 8))], tmp_path / "a.mp4")
    with pytest.raises(UserError, match="no frames"):
        write_video([], tmp_path / "a.mp4")


@pytest.mark.parametrize("ext", ["gif", "webp"])
def test_animated_preview(tmp_path, ext):
    frames = moving_circle_frames(5, size=(40, 24))
    path = write_animation(frames, tmp_path / f"p.{ext}", fps=10)
    with Image.open(path) as img:
        img.load()  # (WebP sets the frame's duration when it is decoded)
        assert img.n_frames == 5 and img.size == (40, 24) and img.info.get("loop") == 0
        assert img.info["duration"] == 100
    if ext == "gif":
        assert [f.tobytes() for f in read_video(path, num_frames=5)] == [f.tobytes() for f in frames]
    with pytest.raises(UserError, match=r"\.gif or \.webp"):
        write_animation(frames, tmp_path / "p.png")


def test_frame_grid_spreads_the_frames():
    frames = [Image.new("RGB", (4, 2), (i, i, i)) for i in range(31)]
    grid = frame_grid(frames, max_frames=4)
    assert grid.size == (8, 4)
    assert [grid.getpixel((x, y))[0] for y in (0, 2) for x in (0, 4)] == [0, 10, 20, 30]


# -- video outputs: validation clips and `difftune sample` ---------------------------------------------------
def fake_video_pipeline():
    """What validation uses of a video family's pipeline: noise (C, F, h, w) and decoding to clips (B, 3, F, H, W);
    no timesteps, so the sampling template hands the noise straight to the decoder."""
    import dataclasses

    import torch

    from difftune.core.pipeline import BasePipeline
    from difftune.core.target import FrameRule, Target, VideoStream

    @dataclasses.dataclass(frozen=True, eq=False)
    class Clips(VideoStream):
        def noise_shape(self, pipe, height, width, num_frames=1):
            pipe.frames_asked.append(num_frames)
            return (3, num_frames, height, width)

        def decode(self, pipe, latents):
            return latents.clamp(-1, 1)

    class FakeVideoPipe(BasePipeline):
        model_names = loss_models = ("dit",)
        target = Target((Clips(frames=FrameRule(81, 4, 1), decode_models=()),))

        def __init__(self, device="cpu", torch_dtype=torch.float32):
            super().__init__(device, torch_dtype)
            self.models["dit"] = torch.nn.Linear(1, 1)
            self.scheduler = types.SimpleNamespace(sigmas=None, timesteps=[], set_timesteps=lambda *a, **k: None)
            self.frames_asked = []

    return FakeVideoPipe


def validation_run(fam, *flags, tmp_path):
    from difftune.training.config import RunConfig

    config = RunConfig.from_namespace(parse(tmp_path, *flags))
    config = config.with_family(fam)
    return types.SimpleNamespace(config=config, family=fam, pipeline=fam.pipeline, models=[])


def test_validation_renders_a_video_family_as_clips(tmp_path):
    import dataclasses

    from difftune.core.options import NoOptions
    from difftune.training.validation import Validator

    pipe_cls = fake_video_pipeline()
    video = dataclasses.replace(family(), pipeline=pipe_cls)
    assert video.options is NoOptions
    validator = Validator(validation_run(video, "--validation_prompts", "a|b", "--validation_size", "16",
                                         "--num_frames", "9", "--validation_num_frames", "5", "--output_path",
                                         str(tmp_path / "out"), tmp_path=tmp_path))
    validator._embeddings = lambda pipe: {}
    validator._decoders = lambda pipe: {}
    pipe = pipe_cls()
    png = validator.render(pipe, 3)
    assert pipe.frames_asked == [5, 5]  # --validation_num_frames, per prompt
    assert png == tmp_path / "out" / "validation" / "step-000003.png"
    assert Image.open(png).size == (5 * 16, 2 * 16)  # a row of frames per prompt
    with Image.open(tmp_path / "out" / "validation" / "step-000003.gif") as gif:
        assert gif.n_frames == 5 and gif.size == (2 * 16, 16)  # the prompts side by side
    run = validation_run(video, "--validation_prompts", "a", "--validation_size", "16", "--num_frames", "9",
                         tmp_path=tmp_path)
    assert Validator(run).num_frames == 9
    with pytest.raises(UserError) as err:
        validation_run(video, "--validation_num_frames", "6", tmp_path=tmp_path)
    one_line(err, "--validation_num_frames 6", "4k+1")
    from difftune.core.target import FrameRule, Target, VideoStream

    @dataclasses.dataclass(frozen=True, eq=False)
    class StillClips(VideoStream):
        def noise_shape(self, pipe, height, width):  # a family that renders stills
            return (3, 1, height, width)

    stills = dataclasses.replace(video, pipeline=type("Stills", (pipe_cls,), {
        "target": Target((StillClips(frames=FrameRule(81, 4, 1), decode_models=()),))}))
    with pytest.raises(UserError) as err:
        Validator(validation_run(stills, "--validation_num_frames", "5", tmp_path=tmp_path))
    one_line(err, "--validation_num_frames: not used", "renders stills")
    assert Validator(validation_run(stills, tmp_path=tmp_path)).num_frames is None


def test_sample_output_names_follow_the_family():
    from difftune.cli.sample import _output, sample_parser

    def out(video, *flags):
        args = sample_parser().parse_args(["--prompt", "p", *flags])
        return _output(args, family(data="video" if video else "image", name="fam"))

    assert out(True) == "sample.mp4" and out(False) == "sample.png"
    assert out(True, "--output", "a.webm") == "a.webm" and out(True, "--output", "a.gif") == "a.gif"
    with pytest.raises(UserError, match=r"--output a.png: the fam family makes clips: name a \.mp4/"):
        out(True, "--output", "a.png")
    with pytest.raises(UserError, match="--output a.mp4: the fam family makes images"):
        out(False, "--output", "a.mp4")
    with pytest.raises(UserError, match="--num_frames: not used: the fam family trains on images"):
        out(False, "--num_frames", "9")
    with pytest.raises(UserError, match=r"--num_frames 6: the fam family takes 4k\+1 frames"):
        out(True, "--num_frames", "6")  # before any model is loaded
