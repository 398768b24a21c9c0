"""The split-training cache store: round trip, atomicity and resume, staleness, ranks, refusals, verify."""

import json
import multiprocessing as mp
import os
import pickle
from pathlib import Path

import pytest
import torch
from PIL import Image

from difftune.cache import (CacheManifest, CacheReader, CacheWriter, file_identity, fingerprint_diff,
                            fingerprint_hash, verify_cache)
from difftune.cache import writer as store  # the writer writes the index files (atomic_write_json)
from difftune.data.operators import DataError
from difftune.errors import UserError

FP = {"weights": {"vae": [{"file": "vae.safetensors", "size": 123, "header_sha256": "ab"}]},
      "preprocessing": {"height": 512, "width": 512}, "units": ["ImageEmbedder@1", "PromptEmbedder@1"]}
N = 10


def make_manifest(fingerprint=FP, family="toy", frontier=None, **kw):
    return CacheManifest.new(family=family, fingerprint=fingerprint, frontier=frontier, **kw)


def sample(i: int) -> dict:
    """Deterministic values of several dtypes, with per-sample shapes (true length, never padded)."""
    g = torch.Generator().manual_seed(i)
    n_tok = 3 + i % 4
    return {
        "latents": torch.randn(4, 2 + i % 3, 5, generator=g),
        "prompt_embeds": torch.randn(n_tok, 8, generator=g).to(torch.bfloat16),
        "prompt_embeds_mask": torch.ones(n_tok, dtype=torch.bool),
        "token_ids": torch.arange(n_tok, dtype=torch.int64) * i,
        "edit_latents": [torch.full((2, 2), float(i)), torch.zeros(1, 3)],
        "prompt": f"a photo number {i}",
        "meta": {"row": i, "scale": 0.5 * i, "flip": bool(i % 2), "tags": ["x", None]},
        "seed": None,
    }


def ids(n=N):
    return [f"img-{i}" for i in range(n)]


def build(root, n=N, **kw):
    with CacheWriter(root, manifest=make_manifest(expected_ids=ids(n)), **kw) as w:
        for i, sid in enumerate(ids(n)):
            w.write(sid, sample(i))
    return root


def assert_same_value(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_value(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same_value(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b and type(a) is type(b), where


def assert_same_cache(a: CacheReader, b: CacheReader):
    assert a.ids == b.ids
    for i in range(len(a)):
        assert_same_value(a[i], b[i], a.ids[i])


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted one-writer cache."""
    return build(tmp_path_factory.mktemp("ref") / "cache", shard_max_samples=3)


# -- round trip -----------------------------------------------------------------------------------------

def test_round_trip_dtypes_and_json(reference):
    r = CacheReader(reference, family="toy", required=["latents", "prompt_embeds"])
    assert len(r) == N and r.ids == ids()
    for i in range(N):
        got = r[i]
        assert got.pop("_id") == f"img-{i}"
        assert_same_value(sample(i), got, f"img-{i}")
    assert r.frontier["prompt_embeds"] == {"kind": "tensor", "dtype": "bfloat16"}
    assert r.frontier["prompt_embeds_mask"] == {"kind": "tensor", "dtype": "bool"}
    assert r.frontier["token_ids"] == {"kind": "tensor", "dtype": "int64"}
    assert r.frontier["prompt"] == {"kind": "json"} and r.frontier["edit_latents"] == {"kind": "tree"}
    # the frontier learnt from the samples is recorded in the manifest on close
    assert json.loads((reference / "manifest.json").read_text())["frontier"] == r.frontier
    assert r[-1]["_id"] == "img-9"
    with pytest.raises(IndexError):
        r[N]


def test_stores_copies_at_true_shape_and_scalar_edge_cases(tmp_path):
    batch = torch.arange(1000, dtype=torch.float32).reshape(10, 100)
    values = {"row": batch[3], "t": batch[:4, :3].t(), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 7),
              "half": torch.ones(3, dtype=torch.float16)}
    with CacheWriter(tmp_path / "c", manifest=make_manifest()) as w:
        w.write("a", values)
        batch.zero_()  # the cache holds copies, not views of the caller's batch
    got = CacheReader(tmp_path / "c")[0]
    assert torch.equal(got["row"], torch.arange(300, 400, dtype=torch.float32))
    assert got["t"].shape == (3, 4) and got["t"][2, 1].item() == 102
    assert got["scalar"].shape == () and got["scalar"].item() == 2.5
    assert got["empty"].shape == (0, 7) and got["half"].dtype == torch.float16
    # only the 100-element row is stored, not the 1000-element batch it was a view of
    size = (tmp_path / "c" / "part-00000" / "shard-000000.safetensors").stat().st_size
    assert size < 1000 * 4


@pytest.mark.parametrize("value, kind", [(Image.new("RGB", (4, 4)), "PIL.Image.Image"), (object(), "object"),
                                         ({"deep": [1, {2, 3}]}, "set")])
def test_refuses_non_tensor_non_json_values_naming_the_key(tmp_path, value, kind):
    with CacheWriter(tmp_path / "c", manifest=make_manifest()) as w:
        with pytest.raises(TypeError, match=rf"'bad(\.deep\[1\])?'.*{kind}"):
            w.write("a", {"ok": torch.ones(1), "bad": value})
        with pytest.raises(ValueError, match="'x'.*nan"):
            w.write("b", {"x": float("nan")})
        w.write("c", {"ok": torch.ones(1), "bad": 1})
    assert CacheReader(tmp_path / "c").ids == ["c"]


def test_writer_checks_samples_against_the_frontier(tmp_path):
    frontier = {"lat": {"kind": "tensor", "dtype": "float32"}, "prompt": {"kind": "json"}}
    with CacheWriter(tmp_path / "c", manifest=make_manifest(frontier=frontier)) as w:
        w.write("a", {"lat": torch.ones(2), "prompt": "x"})
        w.write("none-ok", {"lat": None, "prompt": None})
        with pytest.raises(ValueError, match="'lat' is a bfloat16 tensor"):
            w.write("b", {"lat": torch.ones(2, dtype=torch.bfloat16), "prompt": "x"})
        with pytest.raises(ValueError, match=r"missing \['prompt'\]"):
            w.write("c", {"lat": torch.ones(2)})
        with pytest.raises(ValueError, match="already in the cache"):
            w.write("a", {"lat": torch.ones(2), "prompt": "x"})
    # without a declared frontier the first sample fixes it
    with CacheWriter(tmp_path / "d", manifest=make_manifest()) as w:
        w.write("a", {"lat": torch.ones(2)})
        with pytest.raises(ValueError, match="'lat' is a int64 tensor but earlier samples have a float32 tensor"):
            w.write("b", {"lat": torch.ones(2, dtype=torch.int64)})


def test_fingerprint_hash_is_stable():
    a = {"b": [1, 2], "a": {"y": 1, "x": "s"}}
    assert fingerprint_hash(a) == fingerprint_hash({"a": {"x": "s", "y": 1}, "b": (1, 2)})
    assert fingerprint_hash(a) != fingerprint_hash({**a, "b": [2, 1]})
    assert len(fingerprint_hash(a)) == 64
    assert fingerprint_diff(a, {**a, "b": [1, 3], "c": 0}) == ["b", "c (added)"]


def test_file_identity_tells_apart_fine_tunes_with_the_same_header(tmp_path):
    from safetensors.torch import save_file

    a, b = tmp_path / "a" / "vae.safetensors", tmp_path / "b" / "vae.safetensors"
    for path, seed in ((a, 0), (b, 1)):
        path.parent.mkdir()
        g = torch.Generator().manual_seed(seed)
        save_file({f"w{i}": torch.randn(64, 64, generator=g) for i in range(40)}, path)
    assert a.stat().st_size == b.stat().st_size and a.read_bytes()[:200] == b.read_bytes()[:200]
    ia, ib = file_identity(a), file_identity(b)
    assert ia["file"] == ib["file"] == "vae.safetensors" and ia["size"] == ib["size"]
    assert ia != ib and ia == file_identity(a)


# -- atomicity and resume -----------------------------------------------------------------------------

def test_crash_leaves_only_committed_samples_and_resume_finishes(tmp_path, reference, monkeypatch):
    root = tmp_path / "c"
    real = store.atomic_write_json
    indexes = []

    def crash_on_third_index(path, obj, indent=1):
        if Path(path).name.startswith("shard-"):
            indexes.append(path)
            if len(indexes) == 3:  # killed after the shard's tensors were renamed in, before its index
                raise KeyboardInterrupt
        return real(path, obj, indent)

    monkeypatch.setattr(store, "atomic_write_json", crash_on_third_index)
    w = CacheWriter(root, manifest=make_manifest(expected_ids=ids()), shard_max_samples=3)
    with pytest.raises(KeyboardInterrupt):
        for i, sid in enumerate(ids()):
            w.write(sid, sample(i))
    monkeypatch.setattr(store, "atomic_write_json", real)
    part = root / "part-00000"
    (part / ".shard-000007.safetensors.tmp-dead").write_bytes(b"half a file")  # another writer's leftover
    assert (part / "shard-000002.safetensors").exists() and not (part / "shard-000002.json").exists()

    with pytest.raises(UserError, match="incomplete.*part-00000 never closed; 6 samples of 10 expected.*resume"):
        CacheReader(root)
    partial = CacheReader(root, allow_incomplete=True)
    assert partial.ids == ids()[:6]
    report = verify_cache(root)
    assert not report.ok
    assert any("orphan file part-00000/shard-000002.safetensors" in p for p in report.problems)
    assert any("orphan file part-00000/.shard-000007" in p for p in report.problems)
    assert any("not finished" in p for p in report.problems)
    assert any("4 expected sample(s) missing" in p for p in report.problems)

    with CacheWriter(root, manifest=make_manifest(expected_ids=ids()), shard_max_samples=3) as w:
        done = w.done_ids()
        assert done == set(ids()[:6])
        assert sorted(p.name for p in part.iterdir()) == ["shard-000000.json", "shard-000000.safetensors",
                                                          "shard-000001.json", "shard-000001.safetensors"]
        for i, sid in enumerate(ids()):
            if sid not in done:
                w.write(sid, sample(i))
    assert_same_cache(CacheReader(root), CacheReader(reference))
    assert verify_cache(root).ok, verify_cache(root).problems


@pytest.mark.parametrize("limit", [{"shard_max_bytes": 1}, {"flush_seconds": 0.0}])
def test_shards_commit_on_size_or_time(tmp_path, limit):
    w = CacheWriter(tmp_path / "c", manifest=make_manifest(), **limit)
    for i in range(3):
        w.write(f"s{i}", {"x": torch.full((2,), float(i))})
        # committed right away: a crash now would lose nothing
        assert CacheReader(tmp_path / "c", allow_incomplete=True).ids == [f"s{j}" for j in range(i + 1)]
    w.close()
    assert len(list((tmp_path / "c" / "part-00000").glob("shard-*.json"))) == 3


def test_exception_in_with_block_commits_buffered_samples(tmp_path):
    with pytest.raises(RuntimeError):
        with CacheWriter(tmp_path / "c", manifest=make_manifest()) as w:
            w.write("a", sample(0))
            raise RuntimeError("encoder failed")
    assert CacheReader(tmp_path / "c", allow_incomplete=True).ids == ["a"]


# -- staleness ----------------------------------------------------------------------------------------

def test_fingerprint_mismatch_refused_naming_the_field(tmp_path):
    root = build(tmp_path / "c", n=2)
    other = json.loads(json.dumps(FP))
    other["preprocessing"]["height"] = 1024
    with pytest.raises(UserError) as e:
        CacheWriter(root, manifest=make_manifest(other))
    msg = str(e.value)
    assert "\n" not in msg and str(root) in msg and "different settings" in msg
    assert "fingerprint.preprocessing.height (512 -> 1024)" in msg and "--rebuild_cache" in msg
    assert "width" not in msg
    with pytest.raises(UserError, match=r"family \(toy -> other\)"):
        CacheWriter(root, manifest=make_manifest(family="other"))
    assert CacheReader(root).ids == ids(2)  # untouched


def test_rebuild_replaces_only_cache_files(tmp_path):
    root = build(tmp_path / "c", n=3)
    (root / "bad_samples.json").write_text("[]")  # someone else's file next to the cache
    other = {**FP, "units": ["ImageEmbedder@2"]}
    with CacheWriter(root, manifest=make_manifest(other), rebuild=True) as w:
        assert w.done_ids() == set()
        w.write("new", {"x": torch.ones(1)})
    r = CacheReader(root)
    assert r.ids == ["new"] and r.manifest.fingerprint == other
    assert (root / "bad_samples.json").read_text() == "[]"


def test_rebuild_and_write_refuse_a_directory_that_is_not_a_cache(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "metadata.csv").write_text("image,prompt\n")
    (data / "part-00000").mkdir()
    for rebuild in (False, True):
        with pytest.raises(UserError, match="not a difftune cache"):
            CacheWriter(data, manifest=make_manifest(), rebuild=rebuild)
    assert (data / "metadata.csv").exists() and (data / "part-00000").is_dir()
    # a cache part with a foreign file in it is not deleted either
    root = build(tmp_path / "c", n=1)
    (root / "part-00000" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="refusing to delete.*part-00000/notes.txt"):
        CacheWriter(root, manifest=make_manifest(), rebuild=True)
    assert (root / "manifest.json").exists()


# -- ranks ----------------------------------------------------------------------------------------------

def test_two_ranks_sequentially_equal_one_writer(tmp_path, reference):
    root = tmp_path / "c"
    writers = [CacheWriter(root, manifest=make_manifest(expected_ids=ids()), rank=r, world_size=2,
                           shard_max_samples=2) for r in range(2)]
    for i, sid in enumerate(ids()):
        writers[i % 2].write(sid, sample(i))
    writers[1].write(ids()[0], sample(0))  # a padded rank repeats a sample: it collapses on read
    for w in writers:
        w.close()
    r = CacheReader(root)
    assert_same_cache(r, CacheReader(reference))
    assert r.manifest.world_size == 2
    report = verify_cache(root)
    assert report.ok, report.problems
    assert report.parts == 2 and report.samples == N
    assert any("'img-0' is in both" in n for n in report.notes)

    # a later run with another world size resumes from every part
    w = CacheWriter(root, manifest=make_manifest(expected_ids=ids()), rank=0, world_size=1)
    assert w.done_ids() == set(ids())
    w.close()
    assert_same_cache(CacheReader(root), CacheReader(reference))


def test_other_ranks_need_rank_0_first(tmp_path):
    with pytest.raises(RuntimeError, match="rank 1: .*manifest.json is missing.*pass a real barrier"):
        CacheWriter(tmp_path / "c", manifest=make_manifest(), rank=1, world_size=2)


def test_same_id_with_different_content_in_two_parts_is_an_error(tmp_path):
    root = tmp_path / "c"
    writers = [CacheWriter(root, manifest=make_manifest(), rank=r, world_size=2) for r in range(2)]
    writers[0].write("a", {"x": torch.zeros(2)})
    writers[1].write("a", {"x": torch.ones(2)})
    for w in writers:
        w.close()
    with pytest.raises(UserError, match="sample 'a' twice with different content.*part-00000.*part-00001"):
        CacheReader(root)
    assert any("different content" in p for p in verify_cache(root).problems)


def _spawned_writer(root, rank, barrier):
    with CacheWriter(root, manifest=make_manifest(expected_ids=ids()), rank=rank, world_size=2,
                     barrier=barrier.wait, shard_max_samples=2) as w:
        for i, sid in enumerate(ids()):
            if i % 2 == rank and sid not in w.done_ids():
                w.write(sid, sample(i))


def test_two_real_processes_equal_one_writer(tmp_path, reference):
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_spawned_writer, args=(str(tmp_path / "c"), r, barrier)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    assert_same_cache(CacheReader(tmp_path / "c"), CacheReader(reference))


# -- refusals -------------------------------------------------------------------------------------------

def test_reader_refuses_foreign_family_version_and_missing_names(tmp_path, reference):
    with pytest.raises(UserError, match="built for the 'toy' family, not 'qwen_image'"):
        CacheReader(reference, family="qwen_image")
    with pytest.raises(UserError, match="lacks 'input_latents', 'noise' \\(it has edit_latents, latents"):
        CacheReader(reference, required=["latents", "input_latents", "noise"])
    root = build(tmp_path / "c", n=1)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["format_version"] = 99
    (root / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="format version 99.*reads version 1"):
        CacheReader(root)
    with pytest.raises(UserError, match="format version 99.*--rebuild_cache"):
        CacheWriter(root, manifest=make_manifest())
    with pytest.raises(UserError, match="does not exist"):
        CacheReader(tmp_path / "nowhere")
    CacheWriter(tmp_path / "empty", manifest=make_manifest()).close()
    with pytest.raises(UserError, match="holds no samples"):
        CacheReader(tmp_path / "empty")


def test_reader_refuses_a_raw_dataset_with_a_hint(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "metadata.csv").write_text("image,prompt\n1.jpg,a cat\n")
    Image.new("RGB", (8, 8)).save(data / "1.jpg")
    with pytest.raises(UserError) as e:
        CacheReader(data)
    assert str(e.value) == (f"{data} looks like a raw dataset (it has metadata.csv), not a cache; "
                            "stage 2 needs the output of --task sft:data_process")


class _Marker:
    """Unpickling this creates a directory: proof of whether anything was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


@pytest.mark.parametrize("name", ["0/sample.pth", "extra.pt", "part-00000/x.bin", "innocent-name"])
def test_reader_refuses_pickles_without_loading_them(tmp_path, name):
    root = build(tmp_path / "c", n=1)
    marker = tmp_path / "unpickled"
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_bytes(pickle.dumps(_Marker(str(marker)), protocol=4))
    with pytest.raises(UserError, match=f"holds pickle files \\({name}\\).*never loads pickles"):
        CacheReader(root)
    assert not marker.exists()
    assert any("pickle file" in p for p in verify_cache(root).problems)


# -- data loading ---------------------------------------------------------------------------------------

def test_dataloader_with_two_workers_reads_everything(reference):
    r = CacheReader(reference)
    r[0]  # the parent has open memory maps before the workers fork
    assert r._handles
    clone = pickle.loads(pickle.dumps(r))  # what a spawned worker receives: no handles
    assert not clone._handles
    assert_same_value(clone[3], r[3], "clone")
    loader = torch.utils.data.DataLoader(r, batch_size=None, num_workers=2, shuffle=True)
    got = {s["_id"]: s for s in loader}
    assert sorted(got) == sorted(ids())
    for i, sid in enumerate(ids()):
        s = dict(got[sid])
        s.pop("_id")
        assert_same_value(sample(i), s, sid)


def test_ids_sort_naturally(tmp_path):
    with CacheWriter(tmp_path / "c", manifest=make_manifest()) as w:
        for sid in ["row-10", "row-2", "b", "row-1", "a/3"]:
            w.write(sid, {"v": torch.ones(1)})
    assert CacheReader(tmp_path / "c").ids == ["a/3", "b", "row-1", "row-2", "row-10"]


# -- verify ---------------------------------------------------------------------------------------------

def test_verify_catches_nan_truncation_and_missing_samples(tmp_path):
    root = tmp_path / "c"
    expected = ids(6)
    with CacheWriter(root, manifest=make_manifest(expected_ids=expected), shard_max_samples=2) as w:
        for i, sid in enumerate(expected[:5]):
            values = sample(i)
            if i == 1:
                values["latents"][0, 0, 0] = float("nan")
                values["prompt_embeds"][0, 0] = float("inf")
            w.write(sid, values)
        w.skip("img-7", "unreadable image")
    clean = verify_cache(root)
    assert not clean.ok
    assert any("img-1" in p and "'latents'" in p and "1 NaN and 0 Inf" in p for p in clean.problems)
    assert any("img-1" in p and "'prompt_embeds'" in p and "0 NaN and 1 Inf" in p for p in clean.problems)
    assert any("1 expected sample(s) missing, e.g. 'img-5'" in p for p in clean.problems)
    assert len(clean.problems) == 3, clean.problems
    assert "3 problems" in clean.summary and str(root) in clean.summary

    shard = root / "part-00000" / "shard-000001.safetensors"  # img-2, img-3
    shard.write_bytes(shard.read_bytes()[:-10])
    report = verify_cache(root)
    assert any("shard-000001.safetensors is unreadable (truncated" in p for p in report.problems)
    reader = CacheReader(root)
    reader[0]
    with pytest.raises(UserError, match="cannot read .*shard-000001.safetensors"):
        reader[2]


def test_verify_ok_and_detects_corruption_and_missing_values(tmp_path):
    root = build(tmp_path / "c", n=4)
    report = verify_cache(root)
    assert report.ok and report.summary.endswith("is OK: 4 samples in 1 shards, 1 parts, family toy")
    index_path = root / "part-00000" / "shard-000000.json"
    index = json.loads(index_path.read_text())
    del index["samples"]["img-2"]["prompt"]
    index["samples"]["img-3"]["latents"]["tensor"]["sha256"] = "0" * 64
    index["samples"]["img-1"]["token_ids"] = {"tensor": {**index["samples"]["img-1"]["token_ids"]["tensor"],
                                                         "dtype": "int32"}}
    index_path.write_text(json.dumps(index))
    problems = verify_cache(root).problems
    assert any("'img-2': missing ['prompt']" in p for p in problems)
    assert any("'img-3'" in p and "does not match the hash" in p for p in problems)
    assert any("'img-1'" in p and "dtype int64, manifest says" not in p and "index says int32" in p
               for p in problems)
    with pytest.raises(UserError, match="inconsistent: sample 'img-2'"):
        CacheReader(root)


# -- source files: a changed source re-encodes its sample, a stale cache is refused ------------------------------
def write_tracked(root, files: dict, value: float, crash_before_close=False):
    """One writer run over samples "s<i>" made from files[i]; returns what track_sources reported."""
    writer = CacheWriter(root, manifest=make_manifest())
    changed = writer.track_sources({sid: [str(f)] for sid, f in files.items()})
    for sid in sorted(set(files) - writer.done_ids()):
        writer.write(sid, {"x": torch.full((3,), value)})
    if crash_before_close:
        return changed  # nothing committed: the old entries stay the live ones
    writer.close()
    return changed


def test_changed_sources_are_encoded_again_and_replace_the_old_entries(tmp_path):
    files = {f"s{i}": tmp_path / f"{i}.bin" for i in range(3)}
    for i, f in enumerate(files.values()):
        f.write_bytes(bytes([i]) * 1000)
    root = tmp_path / "c"
    assert write_tracked(root, files, 1.0) == {}
    index = json.loads((root / "part-00000" / "shard-000000.json").read_text())
    assert index["sources"]["s1"] == [{"path": str(files["s1"]), "size": 1000,
                                       "mtime_ns": os.stat(files["s1"]).st_mtime_ns,
                                       "sha256": file_identity(files["s1"], blocks=4)["sampled_sha256"]}]
    assert write_tracked(root, files, 2.0) == {}  # nothing changed: nothing written
    files["s1"].write_bytes(b"\x07" * 1000)  # same size, other content
    assert set(write_tracked(root, files, 3.0, crash_before_close=True)) == {"s1"}
    with pytest.raises(UserError, match=f"is stale: {files['s1']} changed after stage 1"):
        CacheReader(root, allow_incomplete=True)  # the interrupted run left the old entry live
    changed = write_tracked(root, files, 4.0)
    assert list(changed) == ["s1"] and "same size, different content" in changed["s1"]
    reader = CacheReader(root)
    assert [reader[i]["x"][0].item() for i in range(3)] == [1.0, 4.0, 1.0]
    report = verify_cache(root)
    assert report.ok and report.samples == 3, str(report)
    files["s2"].write_bytes(b"longer" * 1000)
    assert "1000 -> 6000 bytes" in write_tracked(root, files, 5.0)["s2"]
    assert [CacheReader(root)[i]["x"][0].item() for i in range(3)] == [1.0, 4.0, 5.0]
    os.utime(files["s0"], ns=(5, 5))  # touched: same size and content
    assert write_tracked(root, files, 6.0) == {}
    files["s0"].unlink()  # carried elsewhere: a note, not a refusal
    notes = []
    reader = CacheReader(root, log=notes.append)
    assert len(reader) == 3 and notes == [f"note: 1 of the 3 source files of the cache at {root} are not on this "
                                          f"machine (e.g. {files['s0']}), so they cannot be checked for changes "
                                          "since stage 1"]


def _cache(root):
    manifest = CacheManifest.new(family="toy", fingerprint={"units": ["U@1"]}, frontier=None,
                                 expected_ids=["a", "b"])
    with CacheWriter(root, manifest=manifest) as w:
        for i, sid in enumerate(["a", "b"]):
            w.write(sid, {"latents": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + i, "prompt": sid})
    (index,) = [p for p in root.rglob("*.json") if json.loads(p.read_text()).get("tensor_file")]
    return index, index.parent / json.loads(index.read_text())["tensor_file"]


def test_cached_latent_reshaped_with_the_same_bytes_is_refused_by_stage_2(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    index, tensors = _cache(tmp_path / "cache")
    with safe_open(str(tensors), framework="pt") as f:
        meta, values = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = next(iter(values))
    values[key] = values[key].reshape(4, 3, 2)  # the same bytes, another shape
    save_file(values, str(tensors), metadata=meta)
    assert not verify_cache(tmp_path / "cache").ok
    reader = CacheReader(tmp_path / "cache", log=None)
    with pytest.raises(DataError) as err:
        for i in range(len(reader)):
            reader[i]
    msg = str(err.value)
    assert "\n" not in msg and str(tensors) in msg and "stored as float32[4, 3, 2], index says float32[2, 3, 4]" in msg


def test_cache_index_pointing_outside_the_cache_is_refused(tmp_path):
    import shutil

    index, tensors = _cache(tmp_path / "cache")
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tensors, outside)
    data = json.loads(index.read_text())
    for target in (os.path.relpath(outside, index.parent), str(outside)):
        data["tensor_file"] = target
        index.write_text(json.dumps(data))
        report = verify_cache(tmp_path / "cache")
        assert any("outside the cache folder" in p and str(index) in p for p in report.problems), report.problems
        with pytest.raises(UserError, match="outside the cache folder"):
            CacheReader(tmp_path / "cache", log=None)
    os.remove(tensors)
    os.symlink(outside, tensors)  # a link out of the cache, under the expected name
    data["tensor_file"] = tensors.name
    index.write_text(json.dumps(data))
    with pytest.raises(UserError, match="outside the cache folder"):
        CacheReader(tmp_path / "cache", log=None)
