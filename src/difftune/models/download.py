"""Where hub weights come from: `<model base path>/<model_id>/`, the standard Hugging Face cache, or a download.

Order (first complete hit wins, and only the last step touches the network):
1. `<base>/<model_id>/` where base is `ModelConfig.local_model_path`, else `DIFFTUNE_MODEL_BASE_PATH`
   (alias `DIFFSYNTH_MODEL_BASE_PATH`), else `./models` -- the reference's layout, so its downloads are reused;
2. the Hugging Face cache (`HF_HUB_CACHE` / `HF_HOME`), read with `local_files_only=True`;
3. unless `DIFFTUNE_SKIP_DOWNLOAD` (alias `DIFFSYNTH_SKIP_DOWNLOAD`) or `HF_HUB_OFFLINE` is set: a download into
   `<base>/<model_id>/` of only what is missing.
"Complete" means every shard named by a `*.safetensors.index.json` beside the matches (or implied by
`-0000N-of-0000M` names) is present: a half-downloaded sharded model is not mistaken for a whole one.
"""

from __future__ import annotations

import fnmatch
import json
import os
import posixpath
import re
from pathlib import Path

from ..errors import UserError
from ..util import PICKLE_SUFFIXES, first_line

TRUE = {"1", "true", "yes", "on"}
SOURCES = ("huggingface", "modelscope")
WEIGHT_SUFFIXES = (".safetensors",)
_SHARD = re.compile(r"^(?P<prefix>.+)-(?P<index>\d+)-of-(?P<total>\d+)\.safetensors$")


def env(name: str, default: str | None = None) -> str | None:
    """`DIFFTUNE_<name>`, else the reference's `DIFFSYNTH_<name>`, else `default` (empty values count as unset)."""
    for prefix in ("DIFFTUNE_", "DIFFSYNTH_"):
        value = os.environ.get(prefix + name)
        if value not in (None, ""):
            return value
    return default


def model_base_path(explicit: str | os.PathLike | None = None) -> Path:
    return Path(os.path.expanduser(os.fspath(explicit) if explicit else env("MODEL_BASE_PATH", "./models")))


def skip_download(explicit: bool | None = None) -> bool:
    return bool(explicit) if explicit is not None else (env("SKIP_DOWNLOAD", "") or "").strip().lower() in TRUE


def download_source(explicit: str | None = None) -> str:
    source = (explicit or env("DOWNLOAD_SOURCE", "huggingface")).strip().lower()
    if source not in SOURCES:
        raise UserError(f"download source {source!r} (DIFFTUNE_DOWNLOAD_SOURCE / download_source): expected one of "
                        f"{', '.join(SOURCES)}")
    return source


def hf_offline() -> bool:
    # Read at call time: huggingface_hub reads it once at import, which tests (and launchers) may precede.
    return any(os.environ.get(k, "").strip().lower() in TRUE for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hf_cache_dir() -> Path:
    for key in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(key):
            return Path(os.path.expanduser(os.environ[key]))
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return Path(os.path.expanduser(home)) / "hub"


def is_weight_file(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(WEIGHT_SUFFIXES + PICKLE_SUFFIXES)


# -- shards ----------------------------------------------------------------------------------------------

def shard_index(directory: Path) -> dict[str, Path]:
    """{shard file name: index file} for every `*.safetensors.index.json` in `directory`."""
    shards: dict[str, Path] = {}
    for index in sorted(directory.glob("*.safetensors.index.json")):
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = set(weight_map.values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UserError(f"{index}: not a valid safetensors shard index ({type(e).__name__}: {e})") from e
        for name in names:
            shards[str(name)] = index
    return shards


def missing_shards(files: list[str | os.PathLike]) -> list[tuple[Path, str]]:
    """Shards that belong with `files` but are not among them: [(missing path, why we expect it)]."""
    missing: list[tuple[Path, str]] = []
    by_dir: dict[Path, set[str]] = {}
    for f in files:
        p = Path(f)
        by_dir.setdefault(p.parent, set()).add(p.name)
    for directory, names in by_dir.items():
        index = shard_index(directory)
        used = {index[n] for n in names if n in index}
        for shard, idx in sorted(index.items()):
            if idx in used and shard not in names:
                missing.append((directory / shard, f"listed in {idx}"))
        # Shards named -0000N-of-0000M with no index beside them (the reference downloads no index).
        groups: dict[tuple[str, str], set[int]] = {}
        for n in names:
            m = _SHARD.match(n)
            if m and n not in index:
                groups.setdefault((m["prefix"], m["total"]), set()).add(int(m["index"]))
        for (prefix, total), present in sorted(groups.items()):
            width = len(total)
            for i in range(1, int(total) + 1):
                if i not in present:
                    name = f"{prefix}-{i:0{width}d}-of-{total}.safetensors"
                    missing.append((directory / name, f"shard {i} of {int(total)}"))
    return missing


# -- local matching ---------------------------------------------------------------------------------------

def match_files(root: Path, pattern: str) -> list[Path]:
    """Files under `root` whose repository path matches `pattern` (fnmatch, as huggingface_hub's allow_patterns)."""
    if not root.is_dir():
        return []
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir == ".":
            dirnames[:] = [d for d in dirnames if d != ".cache"]  # huggingface_hub's local_dir metadata
        for name in filenames:
            rel = name if rel_dir == "." else posixpath.join(Path(rel_dir).as_posix(), name)
            if fnmatch.fnmatchcase(rel, pattern) and not name.endswith(".incomplete"):
                out.append(Path(dirpath) / name)
    return sorted(out)


def _weights_pattern(pattern: str) -> str:
    """A folder (`tokenizer/`) -> its files; the repository's root (`./`, the reference's spelling) -> every file."""
    pattern = pattern.removeprefix("./")
    return pattern + "*" if pattern.endswith("/") or not pattern else pattern


def _state(root: Path, pattern: str) -> tuple[list[Path], list[tuple[Path, str]]]:
    files = match_files(root, _weights_pattern(pattern))
    return files, missing_shards([f for f in files if f.name.endswith(".safetensors")])


def _result(root: Path, pattern: str, files: list[Path]) -> list[str] | str:
    """Weight files (safetensors preferred over pickles, which the loader refuses), else their folder."""
    safetensors = [str(f) for f in files if f.name.lower().endswith(WEIGHT_SUFFIXES)]
    weights = safetensors or [str(f) for f in files if is_weight_file(f)]
    if weights:
        return sorted(weights)
    if pattern.endswith("/"):
        return str(root / pattern.rstrip("/"))
    parents = {f.parent for f in files}
    return str(parents.pop()) if len(parents) == 1 else sorted(str(f) for f in files)


# -- hub ---------------------------------------------------------------------------------------------------

def _hf_cache_snapshot(model_id: str, allow_patterns: list[str]) -> Path | None:
    cache = hf_cache_dir()
    if not (cache / ("models--" + model_id.replace("/", "--"))).is_dir():
        return None  # not cached: no need to ask huggingface_hub at all
    import huggingface_hub

    try:
        return Path(huggingface_hub.snapshot_download(model_id, allow_patterns=allow_patterns, cache_dir=str(cache),
                                                      local_files_only=True))
    except Exception:  # an incomplete or foreign cache is simply not a hit
        return None


def _download(source: str, model_id: str, allow_patterns: list[str], local_dir: Path, what: str) -> None:
    try:
        if source == "modelscope":
            try:
                from modelscope import snapshot_download as ms_snapshot_download
            except ImportError as e:
                raise UserError(f"{what}: download_source 'modelscope' needs the modelscope package "
                                f"(pip install modelscope), or use download_source 'huggingface'") from e
            ms_snapshot_download(model_id, allow_file_pattern=allow_patterns, local_dir=str(local_dir))
        else:
            import huggingface_hub

            huggingface_hub.snapshot_download(model_id, allow_patterns=allow_patterns, local_dir=str(local_dir))
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{what}: download from {source} into {local_dir} failed ({first_line(e)})") from e


def resolve_hub(model_id: str, pattern: str, *, base: Path, skip: bool, source: str) -> list[str] | str:
    """Local paths for `model_id:pattern` (weight files, or a folder such as `tokenizer/`)."""
    what = f"{model_id}:{pattern}"
    weights_pattern = _weights_pattern(pattern)
    # config.json and the shard index live beside the weights: fetch them too (recognition, completeness).
    siblings = posixpath.join(posixpath.dirname(weights_pattern), "*.json")
    local_dir = base / model_id
    files, missing = _state(local_dir, pattern)
    if files and not missing:
        return _result(local_dir, pattern, files)
    if source == "huggingface":
        snapshot = _hf_cache_snapshot(model_id, [weights_pattern, siblings])
        if snapshot is not None:
            cached, cached_missing = _state(snapshot, pattern)
            if cached and not cached_missing:
                return _result(snapshot, pattern, cached)
    offline = source == "huggingface" and hf_offline()
    if skip or offline:
        why = "DIFFTUNE_SKIP_DOWNLOAD is set" if skip else "HF_HUB_OFFLINE is set"
        found = f"missing {missing[0][0]} ({missing[0][1]})" if missing else "no matching file"
        raise UserError(f"{what}: {found} under {local_dir} or in the Hugging Face cache {hf_cache_dir()}, "
                        f"and downloads are off ({why})")
    from filelock import FileLock

    (local_dir / ".cache").mkdir(parents=True, exist_ok=True)
    # Several ranks on one machine: one downloads, the others wait and then find the files complete.
    with FileLock(str(local_dir / ".cache" / "difftune.lock")):
        files, missing = _state(local_dir, pattern)
        if not files or missing:
            if files:  # ask only for what is missing
                allow = [p.relative_to(local_dir).as_posix() for p, _ in missing] + [siblings]
            else:
                allow = [weights_pattern, siblings]
            _download(source, model_id, allow, local_dir, what)
            files, missing = _state(local_dir, pattern)
    if not files:
        raise UserError(f"{what}: no file of {model_id} on {source} matches {pattern!r}")
    if missing:
        raise UserError(f"{missing[0][0]}: still missing after the download ({missing[0][1]})")
    return _result(local_dir, pattern, files)
