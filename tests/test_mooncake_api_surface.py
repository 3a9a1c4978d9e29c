"""The facade's public surface against Mooncake's, from tests/data/mooncake_store_api.json
(taken once from the mooncake wheel 0.3.13.post1 with tests/data/make_mooncake_store_api.py):
every module name, every method with Mooncake's parameter names in order and the same
parameters optional, every ReplicateConfig field with Mooncake's default and printed form."""

from __future__ import annotations

import inspect
import json
import os

import pytest

import mooncaked.mooncake_store as facade

API = json.load(open(os.path.join(os.path.dirname(__file__), "data",
                                  "mooncake_store_api.json")))


def test_every_module_name_is_exported():
    missing = [n for n in API["module_names"] if not hasattr(facade, n)]
    assert missing == []
    assert set(API["module_names"]) <= set(facade.__all__)


@pytest.mark.parametrize("name", sorted(API["module_values"]))
def test_module_level_enum_values(name):
    enum_name, value = API["module_values"][name]
    assert type(getattr(facade, name)).__name__ == enum_name
    assert int(getattr(facade, name)) == value


def _methods():
    for class_name, members in sorted(API["classes"].items()):
        for member, spec in sorted(members.items()):
            if member.startswith("_") or spec["kind"] != "method":
                continue
            yield class_name, member, spec.get("signatures", [])


@pytest.mark.parametrize("class_name,member,signatures", list(_methods()))
def test_method_signature_matches_mooncake(class_name, member, signatures):
    cls = getattr(facade, class_name)
    assert callable(getattr(cls, member, None)), f"{class_name}.{member} is missing"
    if not signatures:
        return
    ours = [p for p in inspect.signature(getattr(cls, member)).parameters.values()
            if p.name != "self" and p.kind != p.VAR_KEYWORD]
    # An overloaded Mooncake method (setup) matches when our parameters cover the longest
    # overload; the dict form is the same first argument.
    theirs = max(signatures, key=len)
    # pybind's "argN" is a positional-only parameter without a name: any name matches.
    assert len(ours) >= len(theirs), f"{member} takes fewer parameters than Mooncake's"
    assert [p.name if not name.startswith("arg") else name
            for p, (name, _d, _k) in zip(ours, theirs)] == [name for name, _d, _k in theirs]
    for param, (name, default, kind) in zip(ours, theirs):
        if kind == "var_positional":
            assert param.kind == param.VAR_POSITIONAL, name
            continue
        if default is not None:
            assert param.default is not param.empty, f"{member}({name}=...) needs a default"
        if default in ("None", "False", "True", "0", "1", "9300", "''", "'default'", "'tcp'"):
            assert repr(param.default) == default or (default == "None" and
                                                      param.default is None), name
    assert all(p.default is not p.empty or p.kind == p.VAR_POSITIONAL
               for p in ours[len(theirs):]), "extra parameters must be optional"


def test_store_has_every_mooncake_method():
    theirs = {n for n in API["classes"]["MooncakeDistributedStore"] if not n.startswith("__")}
    theirs.discard("_pybind11_conduit_v1_")
    assert sorted(n for n in theirs if not hasattr(facade.MooncakeDistributedStore, n)) == []


def test_replicate_config_fields_defaults_and_str():
    config = facade.ReplicateConfig()
    fields = {n for n, spec in API["classes"]["ReplicateConfig"].items()
              if spec["kind"] == "property"}
    assert fields == {"data_type", "dfs_replica_num", "group_ids", "nof_replica_num",
                      "prefer_alloc_in_same_node", "preferred_nof_segments",
                      "preferred_segment", "preferred_segments", "replica_num",
                      "soft_pin_action", "soft_pin_ttl_ms", "with_hard_pin"}
    for field in fields:
        getattr(config, field)
    assert (config.replica_num, config.nof_replica_num, config.dfs_replica_num) == (1, 0, 0)
    assert config.soft_pin_action == facade.SoftPinAction.PRESERVE
    assert config.soft_pin_ttl_ms is None and config.group_ids is None
    assert config.with_hard_pin is False and config.prefer_alloc_in_same_node is False
    assert config.preferred_segments == [] and config.preferred_segment == ""
    assert config.data_type == facade.ObjectDataType.UNKNOWN
    # The text Mooncake 0.3.13 prints for a default config and for a configured one.
    assert str(config) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
        "soft_pin_action: PRESERVE, soft_pin_ttl_ms: default, with_hard_pin: 0, "
        "preferred_segments: [], preferred_nof_segments: [], prefer_alloc_in_same_node: 0, "
        "data_type: UNKNOWN }")
    config.soft_pin_ttl_ms = 5
    config.preferred_segments = ["a", "b"]
    config.group_ids = ["g"]
    config.with_hard_pin = True
    config.soft_pin_action = facade.SoftPinAction.ENABLE
    assert str(config) == (
        "ReplicateConfig: { replica_num: 1, nof_replica_num: 0, dfs_replica_num: 0, "
        "soft_pin_action: ENABLE, soft_pin_ttl_ms: 5, with_hard_pin: 1, "
        "preferred_segments: [a, b], preferred_nof_segments: [], "
        "prefer_alloc_in_same_node: 0, data_type: UNKNOWN, group_ids: [g] }")


@pytest.mark.parametrize("field,value", [
    ("soft_pin_ttl_ms", "1000"), ("soft_pin_ttl_ms", 1.5), ("replica_num", 1.5),
    ("replica_num", "2"), ("soft_pin_action", 1), ("preferred_segments", "seg"),
    ("preferred_segments", [1]), ("preferred_segment", None), ("data_type", 3),
    ("group_ids", "g"), ("with_hard_pin", "yes"),
])
def test_replicate_config_rejects_wrong_types(field, value):
    config = facade.ReplicateConfig()
    with pytest.raises(TypeError):
        setattr(config, field, value)
    with pytest.raises(AttributeError):
        config.no_such_field = 1


def test_enums_print_like_pybind():
    assert str(facade.SoftPinAction.ENABLE) == "SoftPinAction.ENABLE"
    assert facade.SoftPinAction.ENABLE.name == "ENABLE" and facade.SoftPinAction.ENABLE.value == 1
    assert int(facade.TaskStatus.SUCCESS) == 3 and int(facade.TaskStatus.FAILED) == 2
    assert facade.ReadTarget().mode == "as_stored"
    target = facade.ReadTarget()
    with pytest.raises(RuntimeError):
        target.mode = "sideways"
    assert repr(facade.QueryTaskResponse()).startswith("QueryTaskResponse(id=(0, 0), type=0")


def test_tensor_metadata_size():
    assert facade._tensor_metadata_size() == 304
