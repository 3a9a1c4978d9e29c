"""Regenerate mooncake_store_api.json from an installed Mooncake wheel (run once, by hand):

    /path/to/mooncake-venv/bin/python tests/data/make_mooncake_store_api.py > tests/data/mooncake_store_api.json

It records the public names of `mooncake.store`, and for each method of the classes an engine
touches the parameter names, in order, and which have defaults (read from the pybind
signatures), so the API-surface test runs without the wheel.
"""

import json
import re

import mooncake.store as store

CLASSES = ["MooncakeDistributedStore", "ReplicateConfig", "BufferHandle", "ReplicaDescriptor",
           "MemoryDescriptor", "DiskDescriptor", "Descriptor", "QueryTaskResponse",
           "ParallelAxis", "TensorParallelism", "ReadTarget", "BufferPool", "BufferLease",
           "MooncakeHostMemAllocator", "SoftPinAction", "ObjectDataType", "ReplicaStatus",
           "TaskType", "TaskStatus"]


def split_params(text):
    params, depth, current = [], 0, ""
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            params.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        params.append(current.strip())
    return params


def signatures(name, doc):
    """Each overload's parameters as [name, default-or-None, kind] (self left out)."""
    found = []
    for match in re.finditer(re.escape(name) + r"\((.*)\) ->", doc or ""):
        params = []
        for param in split_params(match.group(1))[1:]:
            kind = "positional"
            if param.startswith("**"):
                kind, param = "var_keyword", param[2:]
            elif param.startswith("*"):
                kind, param = "var_positional", param[1:]
            head, _, default = param.partition(" = ")
            pname = head.split(":")[0].strip()
            if default.startswith("<mooncake.store.ReplicateConfig"):
                default = "ReplicateConfig()"
            params.append([pname, default or None, kind])
        found.append(params)
    return found


def describe_class(cls):
    members = {}
    for attr in sorted(dir(cls)):
        if attr.startswith("_") and attr not in ("__init__", "__len__", "__str__"):
            continue
        value = getattr(cls, attr)
        if attr in ("__len__", "__str__"):
            members[attr] = {"kind": "method"}
            continue
        if isinstance(value, property):
            members[attr] = {"kind": "property"}
        elif callable(value) and not isinstance(value, type) and hasattr(value, "__doc__") \
                and not isinstance(value, int):
            members[attr] = {"kind": "method", "signatures": signatures(attr, value.__doc__)}
        else:
            members[attr] = {"kind": "value"}
    return members


api = {
    "mooncake_version": "0.3.13.post1",
    "module_names": sorted(n for n in dir(store) if not n.startswith("__")),
    "classes": {name: describe_class(getattr(store, name)) for name in CLASSES},
    "module_values": {n: [type(getattr(store, n)).__name__, int(getattr(store, n))]
                      for n in dir(store) if n.isupper()},
}
print(json.dumps(api, indent=1, sort_keys=True))
