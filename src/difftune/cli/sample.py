"""`difftune sample`: generate images (or, with a video family, clips) from the shell, optionally with trained LoRAs.

The shared flags are here; each family declares its own (its tokenizer paths and sample inputs: an edit image, a
control image, an end frame, ...) in its options, and a flag of another family is refused in one line."""

from __future__ import annotations

import argparse
import dataclasses
import os

from ..core.options import flag_fields, option_names
from ..errors import UserError


def sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="difftune sample", description="Generate an image.")
    p.add_argument("--model_paths", default=None, help="JSON list of model files, as for training.")
    p.add_argument("--model_id_with_origin_paths", default=None, help="model_id:glob entries, as for training.")
    p.add_argument("--model_dir", default=None, help="A model repository in the official layout (all components).")
    p.add_argument("--fp8_models", default=None)
    p.add_argument("--quant_options", default=None, help="Models to run with 4-bit Linear weights, as for training.")
    p.add_argument("--family", default=None)
    p.add_argument("--torch_dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    p.add_argument("--prompt", required=True, action="append", help="Repeat for several images.")
    p.add_argument("--negative_prompt", default="")
    p.add_argument("--cfg_scale", type=float, default=None, help="Default: the family's.")
    p.add_argument("--height", type=int, default=None, help="Default: the family's.")
    p.add_argument("--width", type=int, default=None, help="Default: the family's.")
    p.add_argument("--num_inference_steps", type=int, default=None, help="Default: the family's.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input_image", default=None, help="Image-to-image (image families) or image-to-video: the "
                                                       "starting image.")
    p.add_argument("--denoising_strength", type=float, default=1.0)
    p.add_argument("--lora", action="append", default=[], help="A LoRA file to apply (repeatable).")
    p.add_argument("--lora_alpha", type=float, action="append", default=[], help="Strength per --lora (default 1).")
    p.add_argument("--num_frames", type=int, default=None,
                   help="Video families: frames of the clip (a count the family's VAE takes; default: the family's).")
    p.add_argument("--fps", type=float, default=None, help="Video families: frame rate of the written clip (default: "
                   "the rate the clip was made at: the family's, 16 for most, or the call's where it takes one).")
    p.add_argument("--output", default=None, help="Output file (several prompts: NAME-<i>.EXT); default sample.png, or "
                   "sample.mp4 for a video family (.mp4/.mov/.mkv/.avi/.webm, or an animated .gif/.webp).")
    p.add_argument("--separate_streams", action="store_true",
                   help="A family that makes several streams (a clip with its sound): write each to its own file, "
                        "NAME-<stream>.EXT (NAME-video.mp4 silent, NAME-audio.wav), not one file with the sound "
                        "muxed in.")
    from .args import add_family_flags

    add_family_flags(p, "sample", {a.dest for a in p._actions})
    return p


def model_args_from_dir(model_dir: str, log=print) -> str:
    """--model_paths JSON for a repository in the official layout: the weights of each component folder (the
    family recognises them; tokenizers and processors are found beside them). A folder whose config.json names a
    class no family loads (LTX-2's latent_upsampler/) is left out with a note."""
    import json
    from pathlib import Path

    root = Path(model_dir)
    if not root.is_dir():
        raise UserError(f"--model_dir {model_dir}: not a directory")
    from ..models.detect import config_class

    loadable = _loadable_classes()
    entries = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(str(f) for f in sub.glob("*.safetensors"))
        named = config_class(sub)
        if files and named is not None and named not in loadable:
            log(f"note: --model_dir: {sub.name}/ holds a {named}, which no family loads: left out")
            continue
        if files:
            entries.append(files if len(files) > 1 else files[0])
    if not entries:
        raise UserError(f"--model_dir {model_dir}: no component folder with .safetensors weights found")
    return json.dumps(entries)


def _loadable_classes() -> set[str]:
    """Every class a family's components are built from or read the config of."""
    from ..core.family import families

    out = set()
    for spec in families().values():
        for c in spec.components:
            out.update((c.class_name, *c.config_classes, *c.foreign_config_classes))
    return out


def family_inputs(args, family) -> tuple[object, dict]:
    """The family's options and sampling inputs from the flags given (another family's refused; image flags read
    as images): (the options, the flags' values by name)."""
    from ..media.image import load_image

    shared = {a for a in vars(sample_parser_shared())}
    given = {k: v for k, v in vars(args).items() if k not in shared and v is not None}
    cls = family.sample_options
    takes = set(option_names(cls, "sample"))
    for name in given:
        if name not in takes:
            raise UserError(f"--{name}: the {family.name} family does not take it")
    options = cls(**given)
    flags = {}
    for f in flag_fields(cls):
        mode, value = f.metadata["flag"]["load"], getattr(options, f.name)
        if mode and value is not None:
            value = [load_image(v, mode) for v in value] if isinstance(value, list) else load_image(value, mode)
        flags[f.name] = value
    return options, {"_given": set(given), **flags}


def call_inputs_of(pipeline, family, flags: dict) -> dict:
    """The sampling inputs the chosen pipeline class takes from the flags (`sample_values`): a sampling flag it does
    not take is refused; a flag training takes too that is a sampling input (Insert-Anything's size, SD's clip skip: a
    feature's input or setting, or the pipeline's own call parameter) goes to the call when given (unset, the pipeline's default is the option's)."""
    given = flags["_given"]
    own = pipeline.all_sample_flags()
    for name in sorted(given):
        if name not in own and not flag_meta(family.sample_options, name)["train"]:
            raise UserError(f"--{name}: {pipeline.__name__} does not take it")
    inputs = {*pipeline.call_inputs(), *pipeline.call_settings(), *pipeline.call_parameters}
    call = {name: flags[name] for name in given if name in inputs and name not in own
            and flag_meta(family.sample_options, name)["train"]}
    call.update(pipeline.sample_values(flags))
    return call


def flag_meta(cls, name: str) -> dict:
    return next(f.metadata["flag"] for f in flag_fields(cls) if f.name == name)


_SHARED = None


def sample_parser_shared():
    """The shared flags' names (a namespace of defaults), without any family's."""
    global _SHARED
    if _SHARED is None:
        p = sample_parser()
        names = {a.dest: None for a in p._actions if a.default is not argparse.SUPPRESS}
        _SHARED = argparse.Namespace(**names)
    return _SHARED


MAX_SIDE = 16384  # pixels a side: beyond it a sample is a typo, not a picture (it would allocate for minutes first)


def check_numbers(args) -> None:
    """Numbers no sample can be made with, refused before any model is read (NaN guidance gave a black image)."""
    import math

    def say(flag, value, what):
        raise UserError(f"--{flag} {value:g}: {what}" if isinstance(value, float) else f"--{flag} {value}: {what}")

    for flag, value in (("cfg_scale", args.cfg_scale), ("denoising_strength", args.denoising_strength),
                        *(("lora_alpha", a) for a in args.lora_alpha)):
        if value is not None and not math.isfinite(value):
            say(flag, value, "must be a finite number")
    if not 0 < args.denoising_strength <= 1:
        say("denoising_strength", args.denoising_strength, "must be in (0, 1]")
    for flag in ("num_inference_steps", "num_frames"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            say(flag, value, "must be at least 1")
    for flag in ("width", "height"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            say(flag, value, "must be a positive number of pixels")
        if value is not None and value > MAX_SIDE:
            say(flag, value, f"at most {MAX_SIDE} pixels")
    if args.fps is not None and not (math.isfinite(args.fps) and args.fps > 0):
        say("fps", args.fps, "must be a positive frame rate")


def main(argv: list[str]) -> int:
    import torch

    from ..core.build import build_pipeline
    from ..core.family import recognise
    from ..lora import load_lora_file
    from ..media.image import load_image
    from ..models import check_fp8_slots, parse_model_configs
    from ..training.config import RunConfig, frame_settings

    args = sample_parser().parse_args(argv)
    check_numbers(args)
    if args.model_dir:
        args.model_paths = model_args_from_dir(args.model_dir)
    if not (args.model_paths or args.model_id_with_origin_paths):
        raise UserError("no model given: use --model_dir, --model_paths or --model_id_with_origin_paths")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    configs = parse_model_configs(args.model_paths, args.model_id_with_origin_paths, args.fp8_models,
                                  quant_options=args.quant_options)
    family, found = recognise(configs, args.family)
    check_fp8_slots(configs, family.slots)
    options, flags = family_inputs(args, family)
    from ..core.build import context_of

    columns = {"input_image"} if args.input_image else set()
    context = context_of(found, columns | {k for k in flags["_given"] if flags[k] is not None}, options)
    pipeline = family.pipeline_for(context)  # a variant makes its own outputs (Qwen-Image-Layered: a stack of layers)
    call_inputs = {"input_image": load_image(args.input_image) if args.input_image else None,
                   **call_inputs_of(pipeline, family, flags)}
    target = pipeline.target
    output = _output(args, family, target)  # refused before any model is loaded
    if args.separate_streams and len(target.streams) == 1:
        raise UserError(f"--separate_streams: {pipeline.__name__} makes one stream ({target.describe()}); "
                        f"there is nothing to write apart")
    pipe = build_pipeline(family, [(s, c) for s, c, _ in found], device=device, torch_dtype=args.torch_dtype,
                          pipeline=pipeline, features=pipeline.resolve_features(context), options=options)
    by_prefix = {family.lora_prefix(slot): slot for slot in family.slots}
    for i, path in enumerate(args.lora):
        alpha = args.lora_alpha[i] if i < len(args.lora_alpha) else 1.0
        # every model the file has a LoRA for
        for prefix in load_lora_file(path, converters=family.lora_converters).components:
            slot = by_prefix.get(prefix) or pipeline.loss_models[0]
            if pipe.models.get(slot) is None:
                raise UserError(f"--lora {path}: it holds a LoRA for {slot}, which is not loaded")
            pipe.load_lora(pipe.models[slot], path, alpha=alpha)

    call = {"negative_prompt": args.negative_prompt, "seed": args.seed}
    # the call's own parameters and its features' inputs (a pipeline's `**inputs`)
    accepted = pipeline.call_arguments()
    defaults = {k: v for k, v in pipeline.call_defaults.items() if k in accepted}
    call.update(defaults)
    call.update({k: v for k, v in (("cfg_scale", args.cfg_scale), ("height", args.height), ("width", args.width),
                                    ("num_inference_steps", args.num_inference_steps)) if v is not None})
    for name, value in call_inputs.items():
        if value is not None:
            if name not in accepted:
                raise UserError(f"--{name}: {pipeline.__name__} does not take it")
            call[name] = value
    if args.input_image is not None and "denoising_strength" in accepted:
        call["denoising_strength"] = args.denoising_strength
    elif args.denoising_strength != 1.0:
        raise UserError("--denoising_strength: it needs --input_image (image-to-image)")
    frames = frame_settings(RunConfig(dataset_base_path=".", num_frames=args.num_frames), family)
    if frames is not None:
        call["num_frames"] = frames.num_frames
    outputs = pipe(args.prompt, **call)
    note_made_size(args, outputs[0] if isinstance(outputs, (list, tuple)) and outputs else outputs)
    root, ext = os.path.splitext(output)
    names = [output] if len(outputs) == 1 else [f"{root}-{i}{ext}" for i in range(len(outputs))]
    # a clip plays at the rate it was made for (the target says: its own, or the call's), unless --fps says
    fps = args.fps or target.primary.output_fps(call)
    for one, name in zip(outputs, names):
        for written in target.write(one, name, fps=float(fps), apart=args.separate_streams):  # the target's files: a layer stack is several
            print(written)
    return 0


def note_made_size(args, output, log=print) -> None:
    """The pipeline rounds the size up to what its model makes (its size factor: 16 for most, 32 for Wan2.2-TI2V-5B):
    a --height / --width it changed is said once, with the size written (33 wrote 48 pixels without a word)."""
    from PIL import Image

    first = output[0] if isinstance(output, (list, tuple)) and output else output
    if not isinstance(first, Image.Image):
        return  # audio, or a stack the target writes its own way
    made = {"width": first.size[0], "height": first.size[1]}
    changed = [f"--{k} {getattr(args, k)} -> {made[k]}" for k in ("height", "width")
               if getattr(args, k) is not None and getattr(args, k) != made[k]]
    if changed:
        log(f"note: {', '.join(changed)} (the model makes sizes in multiples of its size factor; the pipeline rounds "
            f"up): the output is {made['width']}x{made['height']}")


def _output(args, family, target=None) -> str:
    """The output name, its extension checked against what the family makes."""
    from ..training.config import RunConfig, frame_settings

    # --num_frames: refused for a family without clips, 4k+1 for Wan
    frame_settings(dataclasses.replace(RunConfig(dataset_base_path="."), num_frames=args.num_frames), family)
    return (target or family.target).check_output(args.output, family.name)
