"""Training flags: every flag of the reference's training scripts, with its meaning, plus ours.

Users paste the reference's command lines and change only the script path, so names, defaults and
meanings follow DiffSynth-Studio's documentation; where the reference has a bug (an accidental lr/3
warm-up, no seed, micro-step counting) we keep the flag and fix the behaviour.
"""

from __future__ import annotations

import argparse

TASKS = ("sft", "sft:data_process", "sft:train", "sft:split",
         "direct_distill", "direct_distill:data_process", "direct_distill:train", "direct_distill:split")


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset_base_path", required=True, help="Root directory of the dataset (for --task *:train: the cache written by *:data_process).")
    g.add_argument("--dataset_metadata_path", default=None, help="Metadata file (csv, json or jsonl).")
    g.add_argument("--dataset_repeat", type=int, default=1, help="Times the dataset is repeated in each epoch.")
    g.add_argument("--dataset_num_workers", type=int, default=0, help="DataLoader worker processes.")
    g.add_argument("--data_file_keys", default="image,video", help="Comma-separated metadata fields that are files to load.")
    g.add_argument("--on_bad_sample", choices=("error", "skip"), default="error", help="Stop on a bad sample, or skip it and list it in bad_samples.json.")
    g.add_argument("--allow_empty_prompts", action="store_true", help="Train on metadata without a prompt column (every prompt empty); refused otherwise.")

    g = parser.add_argument_group("size")
    g.add_argument("--height", type=int, default=None, help="Fixed height; leave height and width empty for dynamic resolution.")
    g.add_argument("--width", type=int, default=None, help="Fixed width.")
    g.add_argument("--max_pixels", type=int, default=1024 * 1024, help="Dynamic resolution: larger images are scaled down to this area.")
    g.add_argument("--num_frames", type=int, default=None, help="Video families: frames per clip, the first ones (4k+1 for Wan; default 81, as the reference); a shorter clip is cut to the largest 4k+1 it has.")

    g = parser.add_argument_group("models")
    g.add_argument("--model_paths", default=None, help="JSON list of model files (an entry may be a list of shards).")
    g.add_argument("--model_id_with_origin_paths", default=None, help="Comma-separated model_id:glob entries, downloaded from the hub.")
    g.add_argument("--tokenizer_path", default=None, help="Tokenizer directory or model_id:glob.")
    g.add_argument("--processor_path", default=None, help="Image processor directory (Qwen-Image-Edit).")
    g.add_argument("--tokenizer_1_path", default=None, help="CLIP tokenizer directory or model_id:glob (FLUX).")
    g.add_argument("--tokenizer_2_path", default=None, help="T5 tokenizer directory or model_id:glob (FLUX).")
    g.add_argument("--align_to_opensource_format", action="store_true",
                   help="Accepted for the reference's FLUX scripts: difftune's LoRA files are already in the open "
                        "(diffusers) layout; see --lora_format.")
    g.add_argument("--extra_inputs", default=None, help="Comma-separated extra pipeline inputs from the metadata, e.g. edit_image.")
    g.add_argument("--fp8_models", default=None, help="Frozen models to store in FP8 (entries of the model flags, or dit/text_encoder/vae).")
    g.add_argument("--quant_options", default=None, help="QLoRA: ';'-separated '<model entry>:bitsandbytes_nf4[/<layers kept in full precision>]' (needs bitsandbytes: difftune[quant]).")
    g.add_argument("--offload_models", default=None, help="Accepted for the reference's split scripts: each stage loads only the models it uses, so nothing needs offloading.")
    g.add_argument("--family", default=None, help="Model family (default: recognised from the weights).")
    g.add_argument("--torch_dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16", help="Dtype of frozen weights.")
    g.add_argument("--initialize_model_on_cpu", action="store_true", help="Load models on the CPU first.")
    g.add_argument("--zero_cond_t", action="store_true", help="Qwen-Image-Edit-2511: the edit images' tokens are modulated at t=0 (on anyway when the transformer's config.json says so).")
    g.add_argument("--edit_image_auto_resize", type=_bool, default=True, help="Qwen-Image-Edit: resize edit images to about 1 MP (default true, as the reference).")

    g = parser.add_argument_group("training")
    g.add_argument("--task", default="sft", choices=TASKS, help="sft, direct_distill, and their :data_process / :train / :split stages.")
    g.add_argument("--learning_rate", type=float, default=1e-4)
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--num_epochs", type=int, default=1)
    g.add_argument("--max_steps", type=int, default=None, help="Stop after this many optimizer steps.")
    g.add_argument("--batch_size", type=int, default=1, help="Samples per process per micro-step (equal image sizes).")
    g.add_argument("--trainable_models", default=None, help="Comma-separated models to train fully: dit, text_encoder, vae.")
    g.add_argument("--find_unused_parameters", action="store_true", help="DDP: some parameters get no gradient (Qwen-Image's last text block).")
    g.add_argument("--lr_scheduler", default="constant", choices=("constant", "constant_with_warmup", "linear", "cosine"))
    g.add_argument("--lr_warmup_steps", type=int, default=0)
    g.add_argument("--max_grad_norm", type=float, default=None, help="Clip the gradient norm (off by default).")
    g.add_argument("--seed", type=int, default=0, help="Seeds data order, noise and timesteps.")
    g.add_argument("--customized_optimizer", default=None, help="Optimizer class by import path, e.g. bitsandbytes.optim.AdamW8bit.")
    g.add_argument("--mixed_precision", choices=("no", "bf16", "fp16"), default=None, help="Default: bf16 when --torch_dtype is bfloat16 (trainable weights stay fp32).")
    g.add_argument("--timestep_sampling", default="uniform", choices=("uniform", "logit_normal"))
    g.add_argument("--timestep_shift", default="fixed", choices=("fixed", "dynamic"))
    g.add_argument("--loss_weighting", default="bell", choices=("bell", "none"))
    g.add_argument("--max_timestep_boundary", type=float, default=1.0,
                   help="Train on the timesteps below this fraction of the training table (the reference's units: "
                        "0.358 ~ t=900 at shift 5); with --min_timestep_boundary, one Wan2.2 A14B expert per run.")
    g.add_argument("--min_timestep_boundary", type=float, default=0.0,
                   help="Train on the timesteps from this fraction of the training table on (see --max_timestep_boundary).")
    g.add_argument("--train_experts", choices=("both",), default=None,
                   help="Train both experts of a pair that share the timesteps (Wan2.2 A14B: both DiTs in --model_paths, the high-noise one first) in one command: stage 1 once, then each expert from the cache with its share of the timesteps (--expert_boundary), into <output_path>/high_noise/ and low_noise/.")
    g.add_argument("--expert_boundary", type=float, default=None,
                   help="With --train_experts both: where the experts meet, as --max_timestep_boundary's fraction (default: the reference's for the pair, 0.358 for Wan2.2-I2V-A14B, 0.417 for T2V-A14B).")
    g.add_argument("--rebuild_cache", action="store_true", help="*:data_process: rebuild a cache made with other settings.")
    g.add_argument("--data_process_batch_size", type=int, default=8, help="*:data_process: samples of equal size encoded together.")
    g.add_argument("--cache_commit_every", type=int, default=64, help="*:data_process: commit the cache every N samples (what a crash can lose).")

    g = parser.add_argument_group("output")
    g.add_argument("--output_path", default="./models", help="Where checkpoints (or the stage-1 cache) are written.")
    g.add_argument("--remove_prefix_in_ckpt", default="pipe.dit.", help="Prefix removed from saved full-model keys.")
    g.add_argument("--save_steps", type=int, default=None, help="Save every N optimizer steps; empty = once per epoch.")
    g.add_argument("--resume_from_checkpoint", default=None, help="'latest' or a state directory: continue exactly where a run stopped; a .safetensors file: full-model weights to start from (the reference's meaning).")
    g.add_argument("--save_state_steps", type=int, default=None, help="Save the full training state (for exact resume) every N optimizer steps.")
    g.add_argument("--save_state", action="store_true", help="Also save the full training state with every checkpoint.")
    g.add_argument("--keep_last_states", type=int, default=2, help="Training states to keep (older ones are deleted).")
    g.add_argument("--force_resume", action="store_true", help="Resume even if settings that break exactness changed.")

    g = parser.add_argument_group("lora")
    g.add_argument("--lora_base_model", default=None, help="Model the LoRA is added to (dit, text_encoder).")
    g.add_argument("--lora_target_modules", default="", help="Comma-separated module names for LoRA.")
    g.add_argument("--lora_rank", type=int, default=32)
    g.add_argument("--lora_alpha", type=float, default=None, help="LoRA alpha (default: the rank, as the reference).")
    g.add_argument("--full_format", choices=("diffusers", "original"), default="diffusers", help="Key names of a fully trained model's checkpoint (--trainable_models): diffusers (the class's own) or original (the model's original release, where the family has a map: Wan's DiT in Wan-AI's names); keys are then prefixed and --remove_prefix_in_ckpt applies as usual.")
    g.add_argument("--lora_format", choices=("diffusers", "comfyui", "kohya"), default="diffusers", help="Layout of saved LoRA checkpoints: diffusers (transformer.<module>.lora_A/B, alpha folded into lora_B: loads in diffusers, ComfyUI and difftune at the trained strength), comfyui (diffusion_model.<module> + .alpha) or kohya (lora_unet_<module> + .alpha); the last two hold the denoiser's LoRA only.")
    g.add_argument("--lora_checkpoint", default=None, help="Start from this LoRA (difftune, diffusers/PEFT, ComfyUI, kohya or DiffSynth layout).")
    g.add_argument("--preset_lora_path", default=None, help="A LoRA merged into the base before training (differential LoRA).")
    g.add_argument("--preset_lora_model", default=None, help="Model the preset LoRA is merged into, e.g. dit.")

    g = parser.add_argument_group("gradient")
    g.add_argument("--use_gradient_checkpointing", action="store_true")
    g.add_argument("--use_gradient_checkpointing_offload", action="store_true", help="Keep checkpointed activations in CPU memory.")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)

    g = parser.add_argument_group("logging and validation")
    g.add_argument("--enable_tensorboard_log", type=_bool, nargs="?", const=True, default=True, help="TensorBoard logs under <output_path>/logs (on by default).")
    g.add_argument("--enable_csv_log", action="store_true", help="Also write <output_path>/loss.csv (step, epoch, loss, lr per optimizer step).")
    g.add_argument("--validation_prompts", default=None, help="'|'-separated prompts rendered during training.")
    g.add_argument("--validation_steps", type=int, default=None, help="Render validation samples every N optimizer steps.")
    g.add_argument("--validation_size", type=int, default=None, help="Height and width of validation samples.")
    g.add_argument("--validation_inference_steps", type=int, default=20)
    g.add_argument("--validation_num_frames", type=int, default=None, help="Video families: frames of each validation clip (4k+1; default: --num_frames).")
    g.add_argument("--no_progress", action="store_true", help="No progress bar.")
    g = parser.add_argument_group("reference flags difftune refuses (not implemented yet: a run that names one stops)")
    for name, (kind, why) in REFUSED.items():
        if kind == "switch":
            g.add_argument(f"--{name}", action="store_true", default=None, help=why)
        else:
            g.add_argument(f"--{name}", default=None, help=why)
    return parser


# The reference's flags we do not implement: refused by name rather than ignored (name -> (kind, why)).
REFUSED = {
    "enable_wandb_log": ("switch", "Weights & Biases logging is not implemented (TensorBoard and --enable_csv_log are)"),
    "wandb_project": ("value", "Weights & Biases logging is not implemented (TensorBoard and --enable_csv_log are)"),
    "enable_swanlab_log": ("switch", "SwanLab logging is not implemented (TensorBoard and --enable_csv_log are)"),
    "swanlab_project": ("value", "SwanLab logging is not implemented (TensorBoard and --enable_csv_log are)"),
    "template_model_id_or_path": ("value", "Diffusion Templates are not implemented"),
    "enable_lora_hot_loading": ("switch", "Diffusion Templates (LoRA hot loading) are not implemented"),
    "enable_model_cpu_offload": ("switch", "model CPU offload is not implemented: use split training (stage 2 "
                                           "loads only the denoiser), --fp8_models or DeepSpeed offload"),
    "enable_optimizer_cpu_offload": ("switch", "optimizer CPU offload is not implemented: use a DeepSpeed config "
                                               "with offload_optimizer (accelerate launch --config_file)"),
    "cpu_offload_split_threshold": ("value", "model CPU offload is not implemented"),
    "audio_processor_path": ("value", "audio-conditioned video families are not implemented"),
    "framewise_decoding": ("switch", "frame-by-frame VAE encoding is not implemented (clips are encoded whole)"),
}


# Numbers that make a run do nothing or nonsense (flag -> (smallest allowed, what it must be)); None = unset.
_AT_LEAST = {
    "max_steps": (1, "at least 1 optimizer step"), "num_epochs": (1, "at least 1"), "dataset_repeat": (1, "at least 1"),
    "batch_size": (1, "at least 1"), "gradient_accumulation_steps": (1, "at least 1"), "lora_rank": (1, "at least 1"),
    "save_steps": (1, "at least 1 optimizer step (leave it out to save once per epoch)"),
    "save_state_steps": (1, "at least 1 optimizer step"), "validation_steps": (1, "at least 1 optimizer step"),
    "validation_size": (1, "at least 1 pixel"), "validation_inference_steps": (1, "at least 1"),
    "num_frames": (1, "at least 1 frame"), "validation_num_frames": (1, "at least 1 frame"), "height": (1, "at least 1 pixel"), "width": (1, "at least 1 pixel"), "max_pixels": (1, "at least 1 pixel"),
    "data_process_batch_size": (1, "at least 1"), "cache_commit_every": (1, "at least 1 sample"),
    "dataset_num_workers": (0, "0 or more"), "lr_warmup_steps": (0, "0 or more"),
    "keep_last_states": (0, "0 (keep every state) or more"),
}
_POSITIVE = ("learning_rate", "lora_alpha")  # floats that must be > 0 (and finite)
_NOT_NEGATIVE = ("weight_decay", "max_grad_norm")  # floats that must be >= 0 (and finite); max_grad_norm 0 = off


def _check_numbers(args) -> None:
    import math

    from ..errors import UserError

    for name, (low, what) in _AT_LEAST.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise UserError(f"--{name} {value}: must be {what}")
    for name in (*_POSITIVE, *_NOT_NEGATIVE):
        value = getattr(args, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and name in _POSITIVE):
            raise UserError(f"--{name} {value}: must be a finite number {'above 0' if name in _POSITIVE else '>= 0'}")


def check_training_args(args) -> None:
    """Refuse, in one line, a reference flag that difftune would otherwise accept and ignore, and numbers that
    would make the run do nothing (`--max_steps 0`) or nonsense."""
    from ..errors import UserError

    for name, (_, why) in REFUSED.items():
        if getattr(args, name, None) is not None:
            raise UserError(f"--{name}: not supported by difftune: {why}")
    _check_numbers(args)
    lo, hi = getattr(args, "min_timestep_boundary", 0.0), getattr(args, "max_timestep_boundary", 1.0)
    if not 0.0 < hi <= 1.0:
        raise UserError(f"--max_timestep_boundary {hi}: must be in (0, 1], a fraction of the training timestep table "
                        f"(0.358 ~ t=900 at Wan's shift 5)")
    if not 0.0 <= lo < hi:
        raise UserError(f"--min_timestep_boundary {lo}: must be in [0, --max_timestep_boundary {hi})")
    if getattr(args, "align_to_opensource_format", False):
        print("note: --align_to_opensource_format is not needed: difftune saves LoRAs in the open diffusers layout "
              "(FluxPipeline.load_lora_weights reads them; --lora_format picks another: for FLUX, "
              "--lora_format kohya writes BFL's kohya names, the layout this flag gives in DiffSynth-Studio)")
    if args.offload_models:
        print(f"note: --offload_models {args.offload_models} is not needed: each stage loads only the models it "
              f"uses (the rest are never loaded)")


def training_parser(prog: str = "difftune train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Train a diffusion model (reference-compatible flags).")
    return add_training_args(parser)
