"""`difftune sample`: generate images (or, with a video family, clips) from the shell, optionally with trained LoRAs."""

from __future__ import annotations

import argparse
import os

from ..errors import UserError
from ..io import atomic_save_image


def sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="difftune sample", description="Generate an image.")
    p.add_argument("--model_paths", default=None, help="JSON list of model files, as for training.")
    p.add_argument("--model_id_with_origin_paths", default=None, help="model_id:glob entries, as for training.")
    p.add_argument("--model_dir", default=None, help="A model repository in the official layout (all components).")
    p.add_argument("--tokenizer_path", default=None)
    p.add_argument("--processor_path", default=None)
    p.add_argument("--tokenizer_1_path", default=None, help="FLUX: the CLIP tokenizer (default: tokenizer/ beside it).")
    p.add_argument("--tokenizer_2_path", default=None, help="FLUX: the T5 tokenizer (default: tokenizer_2/ beside it).")
    p.add_argument("--fp8_models", default=None)
    p.add_argument("--quant_options", default=None, help="Models to run with 4-bit Linear weights, as for training.")
    p.add_argument("--family", default=None)
    p.add_argument("--torch_dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    p.add_argument("--prompt", required=True, action="append", help="Repeat for several images.")
    p.add_argument("--negative_prompt", default="")
    p.add_argument("--cfg_scale", type=float, default=None, help="Default: the family's (Qwen-Image: 4).")
    p.add_argument("--height", type=int, default=None, help="Default: the family's (Qwen-Image: 1328).")
    p.add_argument("--width", type=int, default=None, help="Default: the family's (Qwen-Image: 1328).")
    p.add_argument("--num_inference_steps", type=int, default=None, help="Default: the family's (Qwen-Image: 30).")
    p.add_argument("--embedded_guidance", type=float, default=None, help="FLUX.1-dev's distilled guidance "
                   "(default: the family's, 3.5).")
    p.add_argument("--end_image", default=None, help="Wan I2V: the last frame.")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input_image", default=None, help="Image-to-image: the starting image.")
    p.add_argument("--denoising_strength", type=float, default=1.0)
    p.add_argument("--edit_image", action="append", default=None,
                   help="Qwen-Image-Edit: the image to edit; repeat it for several (Edit-2509/2511: the multi-image "
                        "template).")
    p.add_argument("--edit_plus", action="store_true",
                   help="The multi-image template (Edit-2509/2511) even for one --edit_image.")
    p.add_argument("--kontext_images", action="append", default=None,
                   help="FLUX.1 Kontext: a reference image (repeat for several).")
    p.add_argument("--layer_input_image", default=None, help="Qwen-Image-Layered: the image to take apart (RGBA).")
    p.add_argument("--layer_num", type=int, default=None, help="Qwen-Image-Layered: layers besides the first "
                                                                  "(writes NAME-layer<k>.png per layer).")
    p.add_argument("--lora", action="append", default=[], help="A LoRA file to apply (repeatable).")
    p.add_argument("--lora_alpha", type=float, action="append", default=[], help="Strength per --lora (default 1).")
    p.add_argument("--num_frames", type=int, default=None,
                   help="Video families: frames of the clip (4k+1; default: the family's, 81).")
    p.add_argument("--fps", type=float, default=16, help="Video families: frame rate of the written clip.")
    p.add_argument("--output", default=None, help="Output file (several prompts: NAME-<i>.EXT); default sample.png, or "
                   "sample.mp4 for a video family (.mp4/.mov/.mkv/.avi/.webm, or an animated .gif/.webp).")
    return p


def model_args_from_dir(model_dir: str) -> str:
    """--model_paths JSON for a repository in the official layout: the weights of each component folder (the
    family recognises them; tokenizers and processors are found beside them)."""
    import json
    from pathlib import Path

    root = Path(model_dir)
    if not root.is_dir():
        raise UserError(f"--model_dir {model_dir}: not a directory")
    entries = []
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(str(f) for f in sub.glob("*.safetensors"))
        if files:
            entries.append(files if len(files) > 1 else files[0])
    if not entries:
        raise UserError(f"--model_dir {model_dir}: no component folder with .safetensors weights found")
    return json.dumps(entries)


def main(argv: list[str]) -> int:
    import inspect

    import torch
    from PIL import Image

    from ..lora import load_lora_file
    from ..training.builders import build_pipeline, resolve_models

    args = sample_parser().parse_args(argv)
    if args.model_dir:
        args.model_paths = model_args_from_dir(args.model_dir)
    if not (args.model_paths or args.model_id_with_origin_paths):
        raise UserError("no model given: use --model_dir, --model_paths or --model_id_with_origin_paths")
    args.initialize_model_on_cpu = False
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    family, models = resolve_models(args)
    video = family.data == "video"
    output = _output(args, family, video)  # refused before any model is loaded
    pipe = build_pipeline(family, args, models, None, device)
    by_prefix = {family.lora_prefix(slot): slot for slot in family.slots}
    for i, path in enumerate(args.lora):
        alpha = args.lora_alpha[i] if i < len(args.lora_alpha) else 1.0
        # every model the file has a LoRA for
        for prefix in load_lora_file(path, converters=family.lora_converters).components:
            slot = by_prefix.get(prefix) or family.pipeline.loss_models[0]
            if pipe.models.get(slot) is None:
                raise UserError(f"--lora {path}: it holds a LoRA for {slot}, which is not loaded")
            pipe.load_lora(pipe.models[slot], path, alpha=alpha)

    def load(path, mode="RGB"):
        if path is None:
            return None
        try:
            return Image.open(path).convert(mode)
        except OSError as err:
            raise UserError(f"{path}: cannot read image ({err})") from None

    call = {"negative_prompt": args.negative_prompt, "seed": args.seed, **dict(family.sample_defaults)}
    call.update({k: v for k, v in (("cfg_scale", args.cfg_scale), ("height", args.height), ("width", args.width),
                                    ("num_inference_steps", args.num_inference_steps)) if v is not None})
    if args.edit_plus and not args.edit_image:
        raise UserError("--edit_plus: it needs --edit_image")
    edit = [load(p) for p in args.edit_image or []]
    edit = edit if len(edit) > 1 or args.edit_plus else edit[0] if edit else None  # a list: Edit-Plus
    extra = {"input_image": load(args.input_image), "edit_image": edit,
             "embedded_guidance": args.embedded_guidance, "end_image": load(args.end_image),
             "denoising_strength": args.denoising_strength if args.denoising_strength != 1.0 else None,
             "kontext_images": [load(p) for p in args.kontext_images] if args.kontext_images else None,
             "layer_input_image": load(args.layer_input_image, "RGBA"), "layer_num": args.layer_num}
    accepted = inspect.signature(pipe.__call__).parameters
    for name, value in extra.items():
        if value is not None:
            if name not in accepted:
                raise UserError(f"--{name}: the {family.name} family does not take it")
            call[name] = value
    if args.input_image is not None and "denoising_strength" in accepted:
        call["denoising_strength"] = args.denoising_strength
    if video:
        from ..training.builders import frame_settings

        call["num_frames"] = frame_settings(args, family)["num_frames"]
    images = pipe(args.prompt, **call)
    root, ext = os.path.splitext(output)
    outputs = [output] if len(images) == 1 else [f"{root}-{i}{ext}" for i in range(len(images))]
    if not video and images and isinstance(images[0], list):  # a stack of layers per prompt (Qwen-Image-Layered)
        pairs = [(layer, f"{os.path.splitext(out)[0]}-layer{k}{ext}")
                 for stack, out in zip(images, outputs) for k, layer in enumerate(stack)]
        images, outputs = [p[0] for p in pairs], [p[1] for p in pairs]
    for image, out in zip(images, outputs):
        if video:
            from ..media.video import write_video

            write_video(image, out, fps=args.fps)
        else:
            atomic_save_image(image, out)  # in the format the name's extension says
        print(out)
    return 0


def _output(args, family, video: bool) -> str:
    """The output name, its extension checked against what the family makes."""
    from ..media.video import VIDEO_EXTENSIONS, WRITABLE_EXTENSIONS
    from ..training.builders import frame_settings

    frame_settings(args, family)  # --num_frames: refused for an image family, 4k+1 for a video family
    output = args.output or ("sample.mp4" if video else "sample.png")
    ext = os.path.splitext(output)[1].lower()
    if video and ext not in WRITABLE_EXTENSIONS:
        raise UserError(f"--output {output}: the {family.name} family makes clips: name a "
                        f"{'/'.join(WRITABLE_EXTENSIONS)} file")
    if not video and ext in VIDEO_EXTENSIONS:
        raise UserError(f"--output {output}: the {family.name} family makes images: name an image file "
                        f"(.png, .jpg, ...)")
    return output if ext else output + ".png"
