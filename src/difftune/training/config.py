"""The run configuration: every flag of `difftune train`, typed, declared once (each field is its flag: name,
default, help), plus what is derived from the flags once the family is known (its options, the frame settings).

The reference's names, defaults and meanings are kept (users paste its command lines); where the reference has a
bug (an accidental lr/3 warm-up, no seed, micro-step counting) the flag stays and the behaviour is fixed. The CLI
(`cli/args.py`) builds its parser from these fields and every family's options; the recipe and everything it calls
read this object, never the argparse namespace.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..core.options import BOOL, SWITCH, from_values, option
from ..errors import UserError
from ..util import names

DEFAULT_DATA_FILE_KEYS = ("image", "video")
STAGES = ("", "data_process", "train", "split")


def name_list(value) -> tuple[str, ...]:
    """A list flag's names, from the command line's "a, b,a" (the reference's form), a list, or a saved config's
    value: stripped, no empties, no repeats, in order (`util.names`)."""
    return tuple(names(value))


def target_list(value) -> tuple[str, ...]:
    """--lora_target_modules: as `name_list`, and the empty string the reference's scripts give for its automatic
    choice (`lora.auto_targets`) kept as that choice's marker."""
    from ..lora.auto_targets import AUTO

    if isinstance(value, str) and not value.strip():
        return (AUTO,)
    return name_list(value)


def flag_text(value: tuple[str, ...]) -> str | None:
    """A list flag as the command line writes it ("a,b"; None when empty): the form a run records it in, as it did
    before the flags were parsed (so a stage-1 cache's fingerprint and training_args.json read as before)."""
    return ",".join(value) or None


@dataclass(frozen=True)
class TaskSpec:
    loss: str  # sft | direct_distill | a family's own
    stage: str  # "" (one stage) | data_process | train | split

    @classmethod
    def parse(cls, task: str, losses=None) -> TaskSpec:
        from .losses import LOSSES

        loss, _, stage = task.partition(":")
        if loss not in (losses or LOSSES) or stage not in STAGES:
            raise UserError(f"--task {task}: unknown task")
        return cls(loss, stage)


def task_choices(losses) -> tuple[str, ...]:
    """Every task the loss table allows: each loss, alone and with each stage."""
    return tuple(f"{loss}:{stage}" if stage else loss for loss in losses for stage in STAGES)


@dataclass(frozen=True)
class FamilyFlags:
    """Family flags as parsed, before the family is known."""

    given: dict


@dataclass(frozen=True)
class FrameSettings:
    """A video family's clip settings, derived once from the flags and the family."""

    num_frames: int
    time_division_factor: int
    time_division_remainder: int

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


D, S, M, T, O, L, G, V = ("dataset", "size", "models", "training", "output", "lora", "gradient",
                          "logging and validation")


@dataclass(frozen=True)
class RunConfig:
    # -- dataset
    dataset_base_path: str = option(None, "Root directory of the dataset (for --task *:train: the cache written by "
                                    "*:data_process).", group=D, required=True)
    dataset_metadata_path: str | None = option(None, "Metadata file (csv, json or jsonl).", group=D)
    dataset_repeat: int = option(1, "Times the dataset is repeated in each epoch.", kind=int, group=D)
    dataset_num_workers: int = option(0, "DataLoader worker processes.", kind=int, group=D)
    data_file_keys: tuple[str, ...] = option(DEFAULT_DATA_FILE_KEYS, "Comma-separated metadata fields that are "
                                             "files to load.", kind=name_list, group=D)
    on_bad_sample: str = option("error", "Stop on a bad sample, or skip it and list it in bad_samples.json.",
                                choices=("error", "skip"), group=D)
    allow_empty_prompts: bool = option(False, "Train on metadata without a prompt column (every prompt empty); "
                                       "refused otherwise.", kind=SWITCH, group=D)
    allow_paths_outside_dataset: bool = option(False, "Read metadata files that resolve outside "
                                               "--dataset_base_path (../ paths, absolute paths, links out of it); "
                                               "refused otherwise.", kind=SWITCH, group=D)
    # -- size
    height: int | None = option(None, "Fixed height; leave height and width empty for dynamic resolution.",
                                kind=int, group=S)
    width: int | None = option(None, "Fixed width.", kind=int, group=S)
    max_pixels: int = option(1024 * 1024, "Dynamic resolution: larger images are scaled down to this area.",
                             kind=int, group=S)
    num_frames: int | None = option(None, "Video families: frames per clip, the first ones (a count the family's "
                                    "VAE takes, e.g. 4k+1; default: the family's); a shorter clip is cut to the "
                                    "largest such count it has.",
                                    kind=int, group=S)
    # -- models
    model_paths: str | None = option(None, "JSON list of model files (an entry may be a list of shards).", group=M)
    model_id_with_origin_paths: str | None = option(None, "Comma-separated model_id:glob entries, downloaded from "
                                                    "the hub.", group=M)
    extra_inputs: tuple[str, ...] = option((), "Comma-separated extra pipeline inputs from the metadata (the "
                                           "columns a family's features read).", kind=name_list, group=M)
    fp8_models: str | None = option(None, "Frozen models to store in FP8 (entries of the model flags, or "
                                    "dit/text_encoder/vae).", group=M)
    quant_options: str | None = option(None, "QLoRA: ';'-separated '<model entry>:<method>[/<layers kept in full "
                                       "precision>]', method bitsandbytes_nf4 / bitsandbytes_fp4 (difftune[quant]) or "
                                       "torchao_int8_w8a16 / torchao_fp8_w8a16 / torchao_int4_w4a16 / "
                                       "torchao_nvfp4_w4a16 (difftune[torchao]).", group=M)
    offload_models: str | None = option(None, "Accepted for the reference's split scripts: each stage loads only "
                                        "the models it uses, so nothing needs offloading.", group=M)
    enable_model_cpu_offload: bool = option(False, "Keep the frozen weights of the denoiser's repeated blocks in host "
                                            "memory and copy each block to the GPU just before it runs (LoRA "
                                            "and other trainable weights stay on the GPU; turns gradient "
                                            "checkpointing on; docs/memory.md).", kind=SWITCH, group=M)
    blocks_to_swap: int | None = option(None, "Model offload of the last N blocks only (musubi-tuner's name; the "
                                        "other blocks stay on the GPU); implies --enable_model_cpu_offload's "
                                        "streaming for those N.", kind=int, group=M)
    cpu_offload_split_threshold: float | None = option(None, "Model offload granularity in MB: a block larger than "
                                                       "this is streamed in parts (its submodules) of at most this "
                                                       "size (default: whole blocks).", kind=float, group=M)
    enable_optimizer_cpu_offload: bool = option(False, "Keep the optimizer state in host memory and run the "
                                                "optimizer step there (the trainable weights stay on the GPU; "
                                                "gradient accumulation works).", kind=SWITCH, group=M)
    family: str | None = option(None, "Model family (default: recognised from the weights).", group=M)
    torch_dtype: str = option("bfloat16", "Dtype of frozen weights.", choices=("bfloat16", "float16", "float32"),
                              group=M)
    initialize_model_on_cpu: bool = option(False, "Load models on the CPU first.", kind=SWITCH, group=M)
    # -- training
    task: str = option("sft", "sft, direct_distill, a family's own loss, and their :data_process / :train / :split "
                       "stages.", group=T)
    learning_rate: float = option(1e-4, "", kind=float, group=T)
    weight_decay: float = option(0.01, "", kind=float, group=T)
    num_epochs: int = option(1, "", kind=int, group=T)
    max_steps: int | None = option(None, "Stop after this many optimizer steps.", kind=int, group=T)
    batch_size: int = option(1, "Samples per process per micro-step (equal image sizes).", kind=int, group=T)
    trainable_models: tuple[str, ...] = option((), "Comma-separated models to train fully: dit, text_encoder, "
                                               "vae.", kind=name_list, group=T)
    find_unused_parameters: bool = option(False, "DDP: some parameters get no gradient (e.g. a last text block no loss "
                                          "reaches).", kind=SWITCH, group=T)
    lr_scheduler: str = option("constant", "", choices=("constant", "constant_with_warmup", "linear", "cosine"),
                               group=T)
    lr_warmup_steps: int = option(0, "", kind=int, group=T)
    max_grad_norm: float | None = option(None, "Clip the gradient norm (off by default).", kind=float, group=T)
    seed: int = option(0, "Seeds data order, noise and timesteps.", kind=int, group=T)
    customized_optimizer: str | None = option(None, "Optimizer class by import path, e.g. "
                                              "bitsandbytes.optim.AdamW8bit.", group=T)
    mixed_precision: str | None = option(None, "Default: bf16 when --torch_dtype is bfloat16 (trainable weights stay "
                                         "fp32).", choices=("no", "bf16", "fp16"), group=T)
    timestep_sampling: str = option("uniform", "", choices=("uniform", "logit_normal"), group=T)
    timestep_shift: str = option("fixed", "", choices=("fixed", "dynamic"), group=T)
    loss_weighting: str = option("bell", "", choices=("bell", "none"), group=T)
    max_timestep_boundary: float = option(1.0, "Train on the timesteps below this fraction of the training table "
                                          "(the reference's units: 0.358 ~ t=900 at shift 5); with "
                                          "--min_timestep_boundary, one expert of a pair per run.", kind=float,
                                          group=T)
    min_timestep_boundary: float = option(0.0, "Train on the timesteps from this fraction of the training table on "
                                          "(see --max_timestep_boundary).", kind=float, group=T)
    # kohya sd-scripts' loss options for epsilon / v-prediction models (SD 1.x, SDXL); a flow model refuses them
    noise_offset: float = option(0.0, "Epsilon / v models: add this times one normal value per sample and channel "
                                 "to the noise (kohya's --noise_offset; SDXL base was trained with ~0.0357).",
                                 kind=float, group=T)
    noise_offset_random_strength: bool = option(False, "With --noise_offset: each sample's offset scaled by a "
                                                "uniform draw in [0, 1) (kohya's).", kind=SWITCH, group=T)
    min_snr_gamma: float | None = option(None, "Epsilon / v models: weigh each sample's loss by min(SNR, gamma) / "
                                         "SNR (v: / (SNR + 1)), kohya's and Hang et al.'s min-SNR (5 is usual).",
                                         kind=float, group=T)
    debiased_estimation_loss: bool = option(False, "Epsilon / v models: weigh each sample's loss by 1 / sqrt(SNR) "
                                            "(v: SNR + 1), SNR at most 1000, kohya's.", kind=SWITCH, group=T)
    min_timestep: int | None = option(None, "Epsilon / v models: draw training timesteps from this one on (kohya's; "
                                      "0 .. 1000).", kind=int, group=T)
    max_timestep: int | None = option(None, "Epsilon / v models: draw training timesteps below this one (kohya's; "
                                      "1 .. 1000).", kind=int, group=T)
    train_experts: str | None = option(None, "Train both experts of a pair that share the timesteps (both denoisers in "
                                       "--model_paths, the high-noise one first) in one command: stage 1 once, then "
                                       "each expert from the cache with its share of the timesteps "
                                       "(--expert_boundary), into <output_path>/high_noise/ and low_noise/.",
                                       choices=("both",), group=T)
    expert_boundary: float | None = option(None, "With --train_experts both: where the experts meet, as "
                                           "--max_timestep_boundary's fraction (default: the one the pair was "
                                           "released with, where the family knows it).", kind=float,
                                           group=T)
    rebuild_cache: bool = option(False, "*:data_process: rebuild a cache made with other settings.", kind=SWITCH,
                                 group=T)
    data_process_batch_size: int | None = option(None, "*:data_process: samples of equal size encoded together "
                                                 "(default: up to 8 and 1 megapixel in all, one at a time from "
                                                 "1024x1024 up).", kind=int, group=T)
    cache_commit_every: int = option(64, "*:data_process: commit the cache every N samples (what a crash can "
                                     "lose).", kind=int, group=T)
    # -- output
    output_path: str = option("./models", "Where checkpoints (or the stage-1 cache) are written.", group=O)
    remove_prefix_in_ckpt: str | None = option(None, "Prefix removed from saved full-model keys (default: "
                                               "pipe.<the family's denoiser slot>., e.g. pipe.dit.).", group=O)
    save_steps: int | None = option(None, "Save every N optimizer steps; empty = once per epoch.", kind=int, group=O)
    resume_from_checkpoint: str | None = option(None, "'latest' or a state directory: continue exactly where a run "
                                                "stopped; a .safetensors file: full-model weights to start from (the "
                                                "reference's meaning).", group=O)
    save_state_steps: int | None = option(None, "Save the full training state (for exact resume) every N optimizer "
                                          "steps.", kind=int, group=O)
    save_state: bool = option(False, "Also save the full training state with every checkpoint.", kind=SWITCH,
                              group=O)
    keep_last_states: int = option(2, "Training states to keep (older ones are deleted).", kind=int, group=O)
    force_resume: bool = option(False, "Resume even if settings that break exactness changed.", kind=SWITCH,
                                group=O)
    # -- lora
    lora_base_model: str | None = option(None, "Model the LoRA is added to (dit, text_encoder).", group=L)
    lora_target_modules: tuple[str, ...] = option((), "Comma-separated module names for LoRA; \"\" chooses them as "
                                                  "the reference does (Linear layers of at least 512 features in "
                                                  "the model's block lists, logged).", kind=target_list, group=L)
    lora_rank: int = option(32, "", kind=int, group=L)
    lora_alpha: float | None = option(None, "LoRA alpha (default: the rank, as the reference).", kind=float, group=L)
    full_format: str = option("diffusers", "Key names of a fully trained model's checkpoint (--trainable_models): "
                              "diffusers (the class's own) or original (the model's original release, where the "
                              "family has a map); keys are then prefixed and "
                              "--remove_prefix_in_ckpt applies as usual.", choices=("diffusers", "original"), group=L)
    lora_format: str = option("default", "Layout of saved LoRA checkpoints. default: the family's layout for the "
                              "denoiser's LoRA that diffusers, ComfyUI and DiffSynth-Studio all load at the trained "
                              "strength (docs/lora_files.md names it per family); another model's LoRA: diffusers. "
                              "diffusers: transformer.<diffusers module>.lora_A/B, alpha folded into lora_B. comfyui: "
                              "diffusion_model.<the model's own module names> + .alpha. kohya: lora_unet_<module> + "
                              ".alpha. reference: the reference's own file (its module names, alpha folded), for "
                              "the families whose module names differ from diffusers' and the release's. The last three hold the "
                              "denoiser's LoRA only; docs/lora_files.md says which reader takes which layout of each "
                              "family.", choices=("default", "diffusers", "comfyui", "kohya", "reference"), group=L)
    lora_checkpoint: str | None = option(None, "Start from this LoRA (difftune, diffusers/PEFT, ComfyUI, kohya or "
                                         "DiffSynth layout).", group=L)
    preset_lora_path: str | None = option(None, "A LoRA merged into the base before training (differential LoRA).",
                                          group=L)
    preset_lora_model: str | None = option(None, "Model the preset LoRA is merged into, e.g. dit.", group=L)
    lora_compute: str = option("auto", "auto: under bf16/fp16 mixed precision (one process) the LoRA layers compute "
                               "in that dtype from fp32 master weights, which the optimizer steps and checkpoints "
                               "save (no cast pair per layer); fp32: the adapters compute in fp32, autocast casting "
                               "around each (the earlier behaviour). docs/performance.md.", choices=("auto", "fp32"),
                               group=L)
    # -- gradient
    use_gradient_checkpointing: bool = option(False, "", kind=SWITCH, group=G)
    use_gradient_checkpointing_offload: bool = option(False, "Keep checkpointed activations in CPU memory.",
                                                      kind=SWITCH, group=G)
    gradient_accumulation_steps: int = option(1, "", kind=int, group=G)
    attention_backend: str = option("auto", "The attention kernel of diffusers' attention dispatcher: auto (the "
                                    "fastest installed for the device: flash3 on Hopper, then flash, else native SDPA; "
                                    "native on a CPU), native, flash, flash3, sage, cudnn, efficient, math, xformers, "
                                    "flex. A step whose prompts are padded runs native (it takes the mask).",
                                    choices=("auto", "native", "flash", "flash3", "sage", "cudnn", "efficient", "math",
                                             "xformers", "flex"), group=G)
    compile: bool = option(False, "Compile the trained model's repeated blocks with torch.compile (diffusers' "
                           "compile_repeated_blocks): once per shape bucket, on its first step; works with gradient "
                           "checkpointing and LoRA. Needs a C++ compiler on a CPU (inductor).", kind=SWITCH, group=G)
    loss_readback_steps: int = option(10, "Read the step losses back from the device every N steps (every step's loss "
                                      "is still logged and checked for NaN/Inf, in batches; before any save too): "
                                      "fewer host syncs. 1: every step.", kind=int, group=G)
    # -- logging and validation
    enable_tensorboard_log: bool = option(True, "TensorBoard logs under <output_path>/logs (on by default).",
                                          kind=BOOL, group=V)
    enable_wandb_log: bool = option(False, "Also log to Weights & Biases (loss, learning rate, validation renders, the "
                                    "flags as config; files in <output_path>/wandb_log; needs difftune[wandb]).",
                                    kind=SWITCH, group=V)
    wandb_project: str | None = option(None, "The W&B project (default: $WANDB_PROJECT, else difftune).", group=V)
    enable_swanlab_log: bool = option(False, "Also log to SwanLab (as --enable_wandb_log; files in "
                                      "<output_path>/swanlab_log; needs difftune[swanlab]).", kind=SWITCH, group=V)
    swanlab_project: str | None = option(None, "The SwanLab project (default: $SWANLAB_PROJECT, else difftune).",
                                         group=V)
    enable_csv_log: bool = option(False, "Also write <output_path>/loss.csv (step, epoch, loss, lr per optimizer "
                                  "step).", kind=SWITCH, group=V)
    validation_prompts: str | None = option(None, "'|'-separated prompts rendered during training.", group=V)
    validation_steps: int | None = option(None, "Render validation samples every N optimizer steps.", kind=int,
                                          group=V)
    validation_size: int | None = option(None, "Height and width of validation samples.", kind=int, group=V)
    validation_inference_steps: int = option(20, "", kind=int, group=V)
    validation_num_frames: int | None = option(None, "Video families: frames of each validation clip (a count "
                                               "the family's VAE takes; default: --num_frames).", kind=int, group=V)
    no_progress: bool = option(False, "No progress bar.", kind=SWITCH, group=V)

    # -- derived once the family is known (not flags)
    family_options: Any = None  # the family's own options (FamilySpec.options); FamilyFlags until it is known
    frames: FrameSettings | None = None  # video families: the clip settings

    def __post_init__(self):
        # the list flags are parsed here, once, however the config is built (flags, the API, a saved config)
        for name in LIST_FLAGS:
            parse = target_list if name == "lora_target_modules" else name_list
            object.__setattr__(self, name, parse(getattr(self, name)))

    # ------------------------------------------------------------------------------------------------
    @classmethod
    def from_namespace(cls, args) -> RunConfig:
        """The configuration of a parsed command line (an argparse namespace); the family flags it was given wait
        in `family_options` (a `FamilyFlags`) until the family is known (`with_family`)."""
        if isinstance(args, RunConfig):
            return args
        values = dict(vars(args))
        shared = {f.name for f in dataclasses.fields(cls) if "flag" in f.metadata}
        # family flags are in the namespace only when given (refused reference flags: None unless given)
        given = {k: v for k, v in values.items() if k not in shared and v is not None and not k.startswith("_")}
        config = from_values(cls, {k: v for k, v in values.items() if k in shared})
        return dataclasses.replace(config, family_options=FamilyFlags(given))

    def with_family(self, family) -> RunConfig:
        """The configuration for `family`: its options from the family flags given (one given that the family does
        not take is refused in one line) and its frame settings."""
        flags = self.family_options.given if isinstance(self.family_options, FamilyFlags) else {}
        if not isinstance(self.family_options, FamilyFlags) and self.family_options is not None:
            return self  # already resolved
        from ..core.options import option_names

        takes = set(option_names(family.options, "train"))
        for name in flags:
            if name not in takes:
                raise UserError(f"--{name}: the {family.name} family does not take it")
        options = family.options(**flags)
        notes = getattr(options, "notes", None)
        for note in (notes() if notes else []):
            print(f"note: {note}")
        resolved = dataclasses.replace(self, family_options=options)
        return dataclasses.replace(resolved, frames=frame_settings(resolved, family))

    @classmethod
    def parse(cls, argv: list[str]) -> RunConfig:
        """The configuration of `difftune train` flags given as a list (the shared flags only; the command line
        itself, with every family's flags and the refused ones, is `cli.args.training_parser`)."""
        import argparse

        from ..core.options import add_flags

        parser = argparse.ArgumentParser(prog="difftune train")
        add_flags(parser, cls, "train")
        return cls.from_namespace(parser.parse_args([str(a) for a in argv]))

    @property
    def task_spec(self) -> TaskSpec:
        return TaskSpec.parse(self.task, _all_losses())

    @property
    def trainable(self) -> list[str]:
        """Every model that trains (its slot): --trainable_models and --lora_base_model."""
        return names([*self.fully_trained, self.lora_base_model])

    @property
    def fully_trained(self) -> list[str]:
        """The slots --trainable_models names (a submodule, `dit.blocks.0.self_attn.q`, counts as its model)."""
        return list(dict.fromkeys(n.split(".", 1)[0] for n in self.trainable_models))

    def checkpoint_prefix(self, denoiser: str | None) -> str:
        """--remove_prefix_in_ckpt, or the denoiser's `pipe.<slot>.` (the reference's `pipe.dit.` for a DiT)."""
        return self.remove_prefix_in_ckpt if self.remove_prefix_in_ckpt is not None else f"pipe.{denoiser or 'dit'}."

    def replace(self, **changes) -> RunConfig:
        return dataclasses.replace(self, **changes)

    def record(self) -> dict:
        """The flags as a run records them (training_args.json): shared flags and the family's options."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if "flag" in f.metadata}
        out.update({name: flag_text(out[name]) for name in LIST_FLAGS})
        if self.family_options is not None and dataclasses.is_dataclass(self.family_options):
            out.update(dataclasses.asdict(self.family_options))
        return out


# the flags that hold a list of names (their `kind` parses them)
LIST_FLAGS = tuple(f.name for f in dataclasses.fields(RunConfig)
                   if f.metadata.get("flag", {}).get("kind") in (name_list, target_list))


def _all_losses() -> dict:
    from .losses import all_losses

    return all_losses()


def frame_settings(config: RunConfig, family) -> FrameSettings | None:
    """The frame settings of a family whose target makes clips, from the flags (None for one that makes none):
    `num_frames` (the family's default where --num_frames is not given) and the time division clips are cut to.
    Refuses --num_frames for a family without clips, and a count the family's VAE cannot take, in one line."""
    rule = family.target.frames
    if rule is None:
        for flag in ("num_frames", "validation_num_frames"):
            if getattr(config, flag, None) is not None:
                raise UserError(f"--{flag}: not used: the {family.name} family trains on "
                                f"{family.target.describe()} (--{flag} is for video families)")
        return None
    factor, remainder = rule.factor, rule.remainder
    # a family option may change the frame counts clips are cut to (the options' `time_division()`, e.g. a flag
    # for a model whose latents take one frame each)
    division = getattr(config.family_options, "time_division", None)
    if callable(division) and division() is not None:
        factor, remainder = division()
    num_frames = config.num_frames if config.num_frames is not None else rule.default
    checked = (("num_frames", num_frames), ("validation_num_frames", config.validation_num_frames))
    for flag, value in checked:
        if value is not None and (value < 1 or value % factor != remainder % factor):
            examples = ", ".join(str(remainder + factor * k) for k in range(4) if remainder + factor * k >= 1)
            raise UserError(f"--{flag} {value}: the {family.name} family takes {factor}k+{remainder} frames "
                            f"({examples}, ...)")
    return FrameSettings(int(num_frames), factor, remainder)


__all__ = ["DEFAULT_DATA_FILE_KEYS", "FamilyFlags", "FrameSettings", "LIST_FLAGS", "RunConfig", "TaskSpec", "flag_text",
           "frame_settings", "name_list", "task_choices"]
