"""`difftune sample`: generate images from the shell, optionally with trained LoRAs."""

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
    p.add_argument("--fp8_models", default=None)
    p.add_argument("--family", default=None)
    p.add_argument("--torch_dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--device", default=None, help="Default: cuda if available, else cpu.")
    p.add_argument("--prompt", required=True, action="append", help="Repeat for several images.")
    p.add_argument("--negative_prompt", default="")
    p.add_argument("--cfg_scale", type=float, default=4.0)
    p.add_argument("--height", type=int, default=1328)
    p.add_argument("--width", type=int, default=1328)
    p.add_argument("--num_inference_steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--input_image", default=None, help="Image-to-image: the starting image.")
    p.add_argument("--denoising_strength", type=float, default=1.0)
    p.add_argument("--edit_image", default=None, help="Qwen-Image-Edit: the image to edit.")
    p.add_argument("--lora", action="append", default=[], help="A LoRA file to apply (repeatable).")
    p.add_argument("--lora_alpha", type=float, action="append", default=[], help="Strength per --lora (default 1).")
    p.add_argument("--output", default="sample.png", help="Output PNG (several prompts: NAME-<i>.png).")
    return p


def model_args_from_dir(model_dir: str) -> tuple[str, str]:
    """--model_paths JSON and tokenizer path for a repository in the official layout."""
    import json
    from pathlib import Path

    root = Path(model_dir)
    if not root.is_dir():
        raise UserError(f"--model_dir {model_dir}: not a directory")
    entries = []
    for sub, pattern in (("transformer", "diffusion_pytorch_model*.safetensors"),
                         ("text_encoder", "model*.safetensors"), ("vae", "diffusion_pytorch_model*.safetensors")):
        files = sorted(str(f) for f in (root / sub).glob(pattern))
        if files:
            entries.append(files if len(files) > 1 else files[0])
    if not entries:
        raise UserError(f"--model_dir {model_dir}: no transformer/, text_encoder/ or vae/ weights found")
    return json.dumps(entries), str(root / "tokenizer")


def main(argv: list[str]) -> int:
    import torch
    from PIL import Image

    from ..training.run import DTYPES, build_pipeline, resolve_components

    args = sample_parser().parse_args(argv)
    if args.model_dir:
        args.model_paths, tok = model_args_from_dir(args.model_dir)
        args.tokenizer_path = args.tokenizer_path or tok
        proc = os.path.join(args.model_dir, "processor")
        if args.processor_path is None and os.path.isdir(proc):
            args.processor_path = proc
    if not (args.model_paths or args.model_id_with_origin_paths):
        raise UserError("no model given: use --model_dir, --model_paths or --model_id_with_origin_paths")
    args.initialize_model_on_cpu = False
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    pipe = build_pipeline(args, resolve_components(args), None, device)
    for i, path in enumerate(args.lora):
        alpha = args.lora_alpha[i] if i < len(args.lora_alpha) else 1.0
        pipe.load_lora(pipe.dit, path, alpha=alpha)

    def load(path):
        if path is None:
            return None
        try:
            return Image.open(path).convert("RGB")
        except OSError as err:
            raise UserError(f"{path}: cannot read image ({err})") from None

    images = pipe(args.prompt, negative_prompt=args.negative_prompt, cfg_scale=args.cfg_scale, height=args.height,
                  width=args.width, num_inference_steps=args.num_inference_steps, seed=args.seed,
                  input_image=load(args.input_image), denoising_strength=args.denoising_strength,
                  edit_image=load(args.edit_image))
    root, ext = os.path.splitext(args.output)
    outputs = [args.output] if len(images) == 1 else [f"{root}-{i}{ext or '.png'}" for i in range(len(images))]
    for image, out in zip(images, outputs):
        atomic_save_image(image, out)  # in the format the name's extension says
        print(out)
    return 0
