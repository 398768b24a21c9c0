"""The contract suite's tiny S2V, Wan-Dancer, LongCat-Video and Video-As-Prompt runs (`TinyFamily.variants`): each
variant's own DiT (and audio encoder / branch) in its released layout, the text encoder, VAE and CLIP of a tiny
diffusers-layout Wan repository, and 5-frame clips with the variant's inputs."""

from __future__ import annotations

from pathlib import Path

from ..common import TinyVariant


def _files(folder: Path, pattern: str) -> list[str]:
    files = sorted(str(p) for p in folder.glob(pattern))
    assert files, f"nothing matches {folder / pattern}"
    return files


def _one(files: list[str]):
    return files if len(files) > 1 else files[0]


def variants_b(folder: Path) -> dict[str, TinyVariant]:
    from .dancer import tiny_dancer_dit
    from .longcat import tiny_longcat_dit
    from .s2v import WAV2VEC_FOLDER, tiny_s2v_dit, write_tiny_wav2vec2
    from .tiny import tiny_wan_paths, write_tiny_wan
    from .variant_data import write_dancer_dataset, write_s2v_dataset, write_vap_dataset
    from .vap import TRANSFORMER_FOLDER, write_tiny_vap

    def wan(with_clip: bool) -> list:
        paths = tiny_wan_paths(write_tiny_wan(folder / ("wan_i2v" if with_clip else "wan_t2v"),
                                              "i2v" if with_clip else "t2v"))
        return [_one(paths[k]) for k in ("text_encoder", "vae", *(("image_encoder",) if with_clip else ()))]

    def s2v():
        root = folder / "s2v"
        tiny_s2v_dit().save_pretrained(str(root / "dit"))
        write_tiny_wav2vec2(root / WAV2VEC_FOLDER)
        return [_one(_files(root / "dit", "*.safetensors")), str(root / WAV2VEC_FOLDER / "model.safetensors"),
                *wan(False)]

    def dancer():
        from safetensors.torch import save_file

        from difftune.families.wan.dancer.keys import dancer_to_original

        (folder / "dancer").mkdir(parents=True, exist_ok=True)
        path = folder / "dancer" / "local_model.safetensors"
        save_file({k: v.contiguous() for k, v in dancer_to_original(tiny_dancer_dit().state_dict()).items()},
                  str(path))
        return [str(path), *wan(True)]

    def longcat():
        tiny_longcat_dit().save_pretrained(str(folder / "longcat" / "dit"))
        return [_one(_files(folder / "longcat" / "dit", "*.safetensors")), *wan(False)]

    def vap():
        models = write_tiny_vap(folder / "vap")
        return [_one(_files(models / TRANSFORMER_FOLDER, "*.safetensors")), *wan(True)]

    from difftune.families.wan.dancer.units import has_librosa

    small = ("--max_pixels", "4096")
    found = {
        "s2v": TinyVariant(flags=(*small, "--extra_inputs", "input_image,input_audio,s2v_pose_video"),
                           write_dataset=lambda root: write_s2v_dataset(root, size=(32, 32)), model_paths=s2v),
        # the music rows (8 per latent frame) divide a latent frame's tokens: 64 x 32 pixels, 8 tokens
        "dancer": TinyVariant(flags=(*small, "--extra_inputs", "wantodance_music_path,wantodance_reference_image,"
                                     "wantodance_fps,wantodance_keyframes,wantodance_keyframes_mask",
                                     "--data_file_keys", "video,wantodance_reference_image,wantodance_keyframes,"
                                     "wantodance_music_path"),
                              write_dataset=lambda root: write_dancer_dataset(root, size=(64, 32)),
                              model_paths=dancer),
        "longcat": TinyVariant(flags=small, model_paths=longcat,
                               write_dataset=lambda root: _video_dataset(root)),
        "vap": TinyVariant(flags=(*small, "--extra_inputs", "vap_video,input_image", "--data_file_keys",
                                  "video,vap_video"),
                           write_dataset=lambda root: write_vap_dataset(root, size=(32, 32)), model_paths=vap),
    }
    if not has_librosa():  # the Dancer's music features are librosa's (difftune[audio])
        del found["dancer"]
    return found


def _video_dataset(root):
    from ..video import write_example_video_dataset

    return write_example_video_dataset(root, n=2, num_frames=5, size=(32, 32))


__all__ = ["variants_b"]
