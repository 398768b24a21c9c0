"""A cache changed after stage 1 wrote it, in ways the per-tensor checks cannot see: a latent shortened together with
its index entry (shape and hash rewritten to agree), a part folder that is a link to a folder outside the cache."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from difftune.cache import CacheManifest, CacheReader, CacheWriter
from difftune.cache.codec import tensor_sha256
from difftune.cache.verify import verify_cache
from difftune.errors import UserError


def _cache(root):
    manifest = CacheManifest.new(family="toy", fingerprint={"units": ["U@1"]}, frontier=None, expected_ids=["a", "b"])
    with CacheWriter(root, manifest=manifest) as w:
        for i, sid in enumerate(["a", "b"]):
            w.write(sid, {"latents": torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + i, "prompt": sid})
    (index,) = [p for p in root.rglob("shard-*.json")]
    return index, index.parent / json.loads(index.read_text())["tensor_file"]


def test_a_latent_shortened_with_its_index_fails_verify_and_stage_2(tmp_path):
    root = tmp_path / "cache"
    index, tensors = _cache(root)
    assert verify_cache(root).ok
    with safe_open(str(tensors), framework="pt") as f:
        meta, values = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    short = values["a/latents"][:, :, :2].contiguous()
    values["a/latents"] = short
    save_file(values, str(tensors), metadata=meta)
    data = json.loads(index.read_text())
    ref = data["samples"]["a"]["latents"]["tensor"]
    ref["shape"], ref["sha256"] = list(short.shape), tensor_sha256(short)
    index.write_text(json.dumps(data))
    report = verify_cache(root)
    assert not report.ok
    assert any(index.name in p and "changed after" in p for p in report.problems), report.problems
    with pytest.raises(UserError) as err:
        CacheReader(root, log=None)
    text = str(err.value)
    assert "\n" not in text and index.name in text and "changed after" in text


def test_a_part_folder_linked_outside_the_cache_is_refused(tmp_path):
    root = tmp_path / "cache"
    _cache(root)
    outside = tmp_path / "elsewhere" / "part-00000"
    outside.parent.mkdir()
    shutil.move(str(root / "part-00000"), str(outside))
    os.symlink(outside, root / "part-00000")
    report = verify_cache(root)
    assert not report.ok
    assert any("part-00000" in p and "outside the cache" in p for p in report.problems), report.problems
    with pytest.raises(UserError) as err:
        CacheReader(root, log=None)
    assert "part-00000" in str(err.value) and "outside the cache" in str(err.value)


def _reseal(index):
    """Rewrite the part's seal for an index written by hand (a tool of the user's own), as a writer would on close."""
    from difftune.cache.index import index_digest

    complete = index.parent / "complete.json"
    data = json.loads(complete.read_text())
    data["indexes"][index.name] = index_digest(index)
    complete.write_text(json.dumps(data))


@pytest.mark.parametrize("name", ["./{}", "sub/../{}"])
def test_a_tensor_file_path_that_stays_inside_the_cache_is_read(tmp_path, name):
    """`./x` and `a/../x` name the shard's own file: they were refused as 'outside the cache folder'."""
    root = tmp_path / "cache"
    index, tensors = _cache(root)
    data = json.loads(index.read_text())
    data["tensor_file"] = name.format(tensors.name)
    index.write_text(json.dumps(data))
    _reseal(index)
    report = verify_cache(root)
    assert report.ok, report.problems
    reader = CacheReader(root, log=None)
    assert torch.equal(reader[0]["latents"], torch.arange(24, dtype=torch.float32).reshape(2, 3, 4))


@pytest.mark.parametrize("value", ["", None, 5])
def test_an_empty_tensor_file_is_named(tmp_path, value):
    """An index whose samples hold tensors but whose tensor_file is empty, null or no name: 'cannot read None' at the
    first read before; now the index is named up front."""
    root = tmp_path / "cache"
    index, _ = _cache(root)
    data = json.loads(index.read_text())
    data["tensor_file"] = value
    index.write_text(json.dumps(data))
    _reseal(index)
    report = verify_cache(root)
    assert any(str(index) in p and "tensor_file" in p for p in report.problems), report.problems
    with pytest.raises(UserError) as err:
        CacheReader(root, log=None)
    text = str(err.value)
    assert "\n" not in text and str(index) in text and "tensor_file" in text and "None" not in text.split(":")[-1]
