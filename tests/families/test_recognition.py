"""Each family of manifest.py with a recognition part: its models recognised from their weights. The files a user
names (the official folders the scripts name) fill the entry's slots; single files in other layouts are recognised
as the entry's components and load to exactly the official folders' tensors; the real-size models, from their
headers alone (meta tensors), match their components with the released configs."""

from __future__ import annotations

import importlib

import pytest
import torch

from difftune.core.family import recognise
from difftune.models.detect import match_header
from families.manifest import FAMILIES as ENTRIES, named

FAMILIES = tuple(name for name, f in ENTRIES.items() if f.recognition)


def pytest_generate_tests(metafunc):
    families = [ENTRIES[f] for f in metafunc.module.FAMILIES]
    for arg, part in (("folders", "folders"), ("single_file", "single_files"), ("header", "headers")):
        if arg in metafunc.fixturenames:
            metafunc.parametrize(arg, [pytest.param((f, c), id=f"{f.name}-{c.id}") for f in families
                                       for c in getattr(f.recognition, part)])


@pytest.fixture(scope="module")
def hubs(tmp_path_factory):
    """family -> (its support module, its tiny hub), written when a test of the family first asks."""
    built = {}

    def get(family):
        if family.name not in built:
            support = importlib.import_module(family.support)
            built[family.name] = support, family.hub(support, tmp_path_factory.mktemp(f"{family.name}_hub"))
        return built[family.name]
    return get


def _slots(configs, family=None):
    spec, found = recognise(configs, family, log=lambda *a: None)
    return spec.name, {slot: det for slot, _, det in found}


def test_the_files_a_user_names(folders, hubs):
    family, case = folders
    support, hub = hubs(family)
    name, found = _slots(case.configs(support, hub))
    assert name == family.name and sorted(found) == sorted(case.slots)
    if case.check:
        case.check(found, support, hub)


def test_a_single_file_loads_as_the_official_folder(single_file, hubs, tmp_path):
    family, case = single_file
    support, hub = hubs(family)
    configs = case.write(support, hub, tmp_path)
    name, found = _slots(configs)
    assert name == family.name
    for slot, spec in case.specs.items():
        assert found[slot].spec is getattr(family.components, spec), slot
    if case.check:
        case.check(found)
    ours = case.official(support, hub)
    single = type(ours).from_pretrained(torch_dtype=torch.float32, model_configs=configs, **case.load(support, hub))
    for slot in case.specs:
        a, b = getattr(ours, slot).state_dict(), getattr(single, slot).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), slot


def test_a_real_size_model_from_its_header(header):
    family, case = header
    shapes = case.shapes()
    missing = [k for k in case.holds if k not in shapes]
    assert not missing, missing
    match = match_header(shapes, family.spec.components)
    assert match is not None and match.spec is getattr(family.components, case.spec)
    if case.config:
        assert match.config == named(case.config)
    if case.check:
        case.check(shapes, match)
