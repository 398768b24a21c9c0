"""Do the LoRA files of today's families and layouts keep their tensor names and values across a refactor?

Not a test: a script run under one checkout, then again under another, and the two manifests compared.

    python benchmarks/lora_files_unchanged.py --out old.json      # under the old checkout
    python benchmarks/lora_files_unchanged.py --out new.json      # under the new one
    python benchmarks/lora_files_unchanged.py --compare old.json new.json

Recording: for each family (qwen_image, wan, flux, z_image, flux2, krea2, ernie_image, ideogram4) the tiny models
and the tiny data set the family contract suite trains (`support.tiny_family`, tests/support/<family>/: `tests/` is
put on sys.path, as the tests and the other benchmarks do) are written once; then one short LoRA training per layout
(`--lora_format` left at its default, diffusers, comfyui, kohya) runs as `python -m difftune train` in a fresh
process: float32 on the CPU, one intra-op thread, `--seed 5`, `--max_steps 2`, rank 4, alpha 8 (alpha / rank = 2,
so the diffusers layout's folding of alpha into lora_B shows), the family's own LoRA targets. A layout the family
refuses is recorded as refused (exit code and the error's last line). The manifest holds, per (family, layout) and
per file written: the sorted tensor names; each tensor's shape, dtype and the sha256 of its bytes (safetensors
`safe_open`); the file's metadata (keys and values; the run's folder written as <WORK>). Each LoRA file is copied
beside the manifest (`<manifest stem>_files/`), so that the comparison can give the largest absolute difference of a
tensor that differs. The inputs are recorded too (the command's flags, the sha256 of every tiny model and data file),
so that a difference can be told from a change of inputs.

Comparing: per (family, layout), same status? same names? same values? (and the first differing tensor with its
largest absolute difference), metadata keys and values (values whose key names difftune's version, a time, a date or a
commit are not compared). The exit status is 1 where a status, a name or a value differs (or a file is missing), else 0;
metadata differences are printed but do not change it.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen_image", "wan", "flux", "z_image", "flux2", "krea2", "ernie_image", "ideogram4")
FORMATS = ("default", "diffusers", "comfyui", "kohya")
VOLATILE = ("difftune_version", "time", "date", "commit", "created")  # in a metadata key's last part
TRAIN_FLAGS = ("--torch_dtype", "float32", "--learning_rate", "1e-2", "--dataset_repeat", "2", "--num_epochs", "1",
               "--max_steps", "2", "--seed", "5", "--no_progress", "--enable_tensorboard_log", "false",
               "--lora_rank", "4", "--lora_alpha", "8")
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
             "DIFFTUNE_SKIP_DOWNLOAD": "true", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "PYTHONHASHSEED": "0"}


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def difftune_origin() -> Path:
    """Where `import difftune` resolves (found, not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("difftune")
    if spec is None or spec.origin is None:
        sys.exit("difftune is not importable with this python")
    return Path(spec.origin).resolve()


def git(*args) -> str:
    try:
        proc = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True)
        return proc.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# -- recording ------------------------------------------------------------------------------------------

def describe_file(path: Path, work: Path) -> dict:
    """Tensor names, shapes, dtypes, sha256 of each tensor's bytes, and the metadata of a safetensors file."""
    import torch
    from safetensors import safe_open

    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        metadata = dict(f.metadata() or {})
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            tensors[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                             "sha256": hashlib.sha256(raw).hexdigest()}
    metadata = {k: v.replace(str(work), "<WORK>") for k, v in metadata.items()}
    return {"names": sorted(tensors), "tensors": tensors, "metadata": metadata, "file_sha256": sha256_file(path),
            "bytes": path.stat().st_size}


def input_hashes(paths, root: Path) -> dict:
    """sha256 of every file under the given paths (files or folders), keyed by their path below `root`."""
    out = {}
    for p in paths:
        p = Path(p)
        files = sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p]
        for q in files:
            out[str(q).replace(str(root), "<WORK>")] = sha256_file(q)
    return dict(sorted(out.items()))


def flat_paths(model_paths) -> list[str]:
    out = []
    for p in model_paths:
        out.extend(flat_paths(p) if isinstance(p, (list, tuple)) else [str(p)])
    return out


def record(args) -> int:
    origin = difftune_origin()
    if ROOT.resolve() not in origin.parents:
        sys.exit(f"difftune resolves to {origin}, outside this checkout ({ROOT}): set PYTHONPATH={ROOT / 'src'} "
                 f"or use this checkout's venv")
    tests = ROOT / "tests"
    if str(tests) not in sys.path:
        sys.path.insert(0, str(tests))
    os.environ.update(CHILD_ENV)  # the tiny writers run here with the same settings as the trainings
    import torch

    torch.set_num_threads(1)
    import support
    from support import tiny_family

    try:
        support.quiet_hf()
    except Exception:  # noqa: BLE001  (cosmetic only)
        pass

    out = Path(args.out).resolve()
    files_dir = out.with_name(out.stem + "_files")
    work = Path(args.workdir).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    if files_dir.exists():
        shutil.rmtree(files_dir)
    files_dir.mkdir(parents=True)
    env = {**os.environ, **CHILD_ENV}
    manifest = {"checkout": str(ROOT), "commit": git("rev-parse", "HEAD"),
                "dirty_tracked_files": [ln for ln in git("status", "--porcelain", "--untracked-files=no").splitlines()],
                "difftune": str(origin), "python": sys.executable, "torch": torch.__version__,
                "platform": platform.platform(), "started": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                "workdir": str(work), "train_flags": list(TRAIN_FLAGS), "env": CHILD_ENV, "families": {}, "runs": {}}
    t_all = time.perf_counter()
    for family in args.families:
        t0 = time.perf_counter()
        folder = work / family
        tiny = tiny_family(family, folder / "tiny")
        meta = Path(tiny.write_dataset(folder / "data"))
        model_paths = json.loads(json.dumps(tiny.model_paths, default=str))
        manifest["families"][family] = {
            "model_paths": json.loads(json.dumps(model_paths).replace(str(work), "<WORK>")),
            "lora_base_model": tiny.lora_base_model, "lora_target_modules": tiny.lora_target_modules,
            "flags": [str(f).replace(str(work), "<WORK>") for f in tiny.flags],
            "inputs": input_hashes([*flat_paths(model_paths), meta.parent], work),
            "write_s": round(time.perf_counter() - t0, 2)}
        print(f"[{family}] tiny models and data written in {time.perf_counter() - t0:.1f} s", flush=True)
        for fmt in args.formats:
            key = f"{family}/{fmt}"
            run_dir = folder / f"out_{fmt}"
            cmd = [sys.executable, "-m", "difftune", "train", "--task", "sft", "--family", family,
                   "--dataset_base_path", str(meta.parent), "--dataset_metadata_path", str(meta),
                   "--output_path", str(run_dir), "--model_paths", json.dumps(model_paths), *TRAIN_FLAGS,
                   *map(str, tiny.flags), "--lora_base_model", tiny.lora_base_model,
                   "--lora_target_modules", tiny.lora_target_modules,
                   *(("--lora_format", fmt) if fmt != "default" else ())]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
            seconds = round(time.perf_counter() - t0, 2)
            entry = {"argv": [c.replace(str(work), "<WORK>") for c in cmd[1:]], "rc": proc.returncode,
                     "seconds": seconds}
            written = sorted(run_dir.glob("*.safetensors")) if run_dir.is_dir() else []
            if proc.returncode == 0 and written:
                entry["status"] = "ok"
                entry["files"] = {}
                for f in written:
                    desc = describe_file(f, work)
                    copy = files_dir / f"{family}-{fmt}-{f.name}"
                    shutil.copyfile(f, copy)
                    desc["copy"] = str(copy.relative_to(out.parent))
                    entry["files"][f.name] = desc
                summary = ", ".join(f"{n}: {len(d['names'])} tensors" for n, d in entry["files"].items())
            else:
                entry["status"] = "refused" if proc.returncode == 2 else "failed"
                lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
                entry["error"] = (lines[-1] if lines else "").replace(str(work), "<WORK>")
                entry["stderr_tail"] = proc.stderr[-3000:].replace(str(work), "<WORK>")
                summary = entry["error"][:200]
            manifest["runs"][key] = entry
            print(f"[{key}] {entry['status']} in {seconds:.1f} s: {summary}", flush=True)
            out.write_text(json.dumps(manifest, indent=1, sort_keys=True))  # what is done so far survives a stop
    manifest["total_s"] = round(time.perf_counter() - t_all, 2)
    manifest["finished"] = datetime.datetime.now(datetime.timezone.utc).isoformat()
    out.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    if not args.keep_workdir:
        shutil.rmtree(work, ignore_errors=True)
    print(f"wrote {out} ({len(manifest['runs'])} runs, {manifest['total_s']:.0f} s); LoRA files in {files_dir}")
    return 0


# -- comparing ------------------------------------------------------------------------------------------

def _volatile(path: str) -> bool:
    return any(word in path.rpartition(".")[2].lower() for word in VOLATILE)


def _flatten(metadata: dict) -> dict:
    """Metadata key -> value, a JSON value opened into `key.field` paths."""
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        else:
            flat[prefix] = value

    for k, v in metadata.items():
        try:
            parsed = json.loads(v)
        except (TypeError, ValueError):
            parsed = v
        walk(k, parsed) if isinstance(parsed, dict) else flat.__setitem__(k, parsed)
    return flat


def metadata_differences(a: dict, b: dict) -> list[str]:
    fa, fb = _flatten(a), _flatten(b)
    out = [f"key only in A: {k}" for k in sorted(set(fa) - set(fb))]
    out += [f"key only in B: {k}" for k in sorted(set(fb) - set(fa))]
    out += [f"{k}: {fa[k]!r} != {fb[k]!r}" for k in sorted(set(fa) & set(fb)) if fa[k] != fb[k] and not _volatile(k)]
    return out


def max_abs_difference(path_a: Path, path_b: Path, name: str):
    from safetensors import safe_open

    try:
        with safe_open(str(path_a), framework="pt") as fa, safe_open(str(path_b), framework="pt") as fb:
            ta, tb = fa.get_tensor(name), fb.get_tensor(name)
    except (OSError, FileNotFoundError) as err:
        return f"(tensors not readable: {err})"
    if ta.shape != tb.shape:
        return f"(shapes {list(ta.shape)} vs {list(tb.shape)})"
    return float((ta.double() - tb.double()).abs().max()) if ta.numel() else 0.0


def compare(path_a: str, path_b: str) -> int:
    a, b = (json.loads(Path(p).read_text()) for p in (path_a, path_b))
    base_a, base_b = Path(path_a).resolve().parent, Path(path_b).resolve().parent
    print(f"A: {path_a}  commit {a.get('commit', '?')[:10]}  ({a.get('checkout')})")
    print(f"B: {path_b}  commit {b.get('commit', '?')[:10]}  ({b.get('checkout')})")
    failed = False
    for family in sorted(set(a["families"]) | set(b["families"]), key=lambda f: (FAMILIES + (f,)).index(f)):
        fa, fb = a["families"].get(family), b["families"].get(family)
        if fa and fb:
            notes = []
            if fa["inputs"] != fb["inputs"]:
                changed = [k for k in sorted(set(fa["inputs"]) | set(fb["inputs"]))
                           if fa["inputs"].get(k) != fb["inputs"].get(k)]
                notes.append(f"inputs differ ({len(changed)} files, first {changed[0]})")
            for k in ("lora_target_modules", "lora_base_model", "flags", "model_paths"):
                if fa[k] != fb[k]:
                    notes.append(f"{k} differs: {fa[k]!r} vs {fb[k]!r}")
            print(f"{family}: inputs " + ("identical (tiny models, data, flags)" if not notes else "; ".join(notes)))
    print(f"{'family/format':24} {'A':8} {'B':8} {'names':6} {'values':6} details")
    keys = sorted(set(a["runs"]) | set(b["runs"]),
                  key=lambda k: ((FAMILIES + (k.split('/')[0],)).index(k.split("/")[0]),
                                 (FORMATS + (k.split('/')[1],)).index(k.split("/")[1])))
    for key in keys:
        ra, rb = a["runs"].get(key), b["runs"].get(key)
        sa, sb = (r["status"] if r else "absent" for r in (ra, rb))
        if sa != "ok" or sb != "ok":
            same = sa == sb
            failed |= not same
            why = ra.get("error", "") if ra and sa != "ok" else (rb.get("error", "") if rb else "")
            print(f"{key:24} {sa:8} {sb:8} {'-':6} {'-':6} {'same status' if same else 'STATUS DIFFERS'}"
                  f"{': ' + why[:160] if why else ''}")
            if same and ra and rb and ra.get("error") != rb.get("error"):
                print(f"{'':24} messages differ: A {ra.get('error')!r} / B {rb.get('error')!r}")
            continue
        files = sorted(set(ra["files"]) | set(rb["files"]))
        for fname in files:
            da, db = ra["files"].get(fname), rb["files"].get(fname)
            label = key if len(files) == 1 else f"{key}:{fname}"
            if da is None or db is None:
                failed = True
                print(f"{label:24} {sa:8} {sb:8} {'-':6} {'-':6} FILE {fname} only in {'B' if da is None else 'A'}")
                continue
            same_names = da["names"] == db["names"]
            common = [n for n in da["names"] if n in db["tensors"]]
            differing = [n for n in common if da["tensors"][n] != db["tensors"][n]]
            same_values = same_names and not differing
            details = []
            if not same_names:
                only_a = sorted(set(da["names"]) - set(db["names"]))
                only_b = sorted(set(db["names"]) - set(da["names"]))
                details.append(f"{len(only_a)} names only in A (first {only_a[:1]}), {len(only_b)} only in B "
                               f"(first {only_b[:1]})")
            if differing:
                n = differing[0]
                diff = max_abs_difference(base_a / da["copy"], base_b / db["copy"], n)
                diffs = [max_abs_difference(base_a / da["copy"], base_b / db["copy"], m) for m in differing]
                worst = max((d for d in diffs if isinstance(d, float)), default=None)
                details.append(f"{len(differing)}/{len(common)} tensors differ; first {n} "
                               f"({da['tensors'][n]['dtype']} {da['tensors'][n]['shape']}) max abs diff "
                               f"{diff if isinstance(diff, str) else f'{diff:.3e}'}"
                               + (f"; largest over all differing {worst:.3e}" if worst is not None else ""))
            else:
                details.append(f"{len(common)} {'' if same_names else 'common '}tensors, bytes identical")
            meta = metadata_differences(da["metadata"], db["metadata"])
            details.append("metadata same (non-volatile)" if not meta else f"metadata: {'; '.join(meta)[:400]}")
            failed |= not same_values
            print(f"{label:24} {sa:8} {sb:8} {'yes' if same_names else 'NO':6} {'yes' if same_values else 'NO':6} "
                  + " | ".join(details))
    print("RESULT: " + ("DIFFERENCES FOUND" if failed else "names and values identical for every (family, format)"))
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="manifest to write (record mode)")
    p.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two manifests")
    p.add_argument("--families", default=",".join(FAMILIES))
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--workdir", default="/tmp/lora_files_unchanged_work",
                   help="where the tiny models, data and runs go (emptied first); the same path for both checkouts "
                        "keeps any path a file records identical")
    p.add_argument("--keep-workdir", action="store_true")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("--out or --compare is required")
    args.families = [f for f in args.families.split(",") if f]
    args.formats = [f for f in args.formats.split(",") if f]
    return record(args)


if __name__ == "__main__":
    sys.exit(main())
