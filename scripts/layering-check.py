#!/usr/bin/env python3
"""Fails when a module of src/ imports from a layer above it (`crate::X` / `super::X` paths).

The layers, bottom to top, are listed in LAYERS; a module may use only modules of lower layers
(or its own); comments, doc links included, are not dependencies. KNOWN lists the upward edges the crate still has, each with the reason it is not
yet removed: the check fails on any other upward edge, and also when a KNOWN edge disappears
(so that the list shrinks with the code). CI runs it.
"""
import pathlib
import re
import sys

LAYERS = [
    "sync",        # the blocking primitives (and the model's scheduler hook)
    "error",       # Error, ErrorCode
    "driver",      # the Driver trait, the real and simulated drivers, the device rules
    "hostfn",      # the crate's host-function threads, background wake-ups
    "pinned",      # page-locked host memory kept for a context's next state
    "hub",         # the completion hub: host-mapped flags, the poller thread, staging memory
    "pool",        # streams, slots, shards, the cap's gate
    "refs",        # per-shard counts of references to a context's state
    "retry",       # the context's lists of work kept for a later attempt
    "registry",    # one state per (driver, CUDA context): weak references by key
    "context",     # the state of a context: options, pools, teardown
    "ctx_ref",     # the crate's objects' references to a context's state
    "stream",      # StreamRef, OwnedStream
    "owner",       # owners, priorities, async acquisition
    "memory",      # DeviceBuffer and its uses
    "completion",  # completion futures and host copies
    "capture",     # capture guards and graphs
    "kernels",     # feature: the crate's kernels
    "cudarc",      # feature: cudarc interop
]

# Upward edges the crate still has, each with the reason it is not yet removed (none today).
KNOWN: dict = {}


def layer_of(path: pathlib.Path) -> str:
    rel = path.relative_to("src")
    return rel.parts[0].removesuffix(".rs")


def main() -> int:
    rank = {name: i for i, name in enumerate(LAYERS)}
    found = {}
    for path in sorted(pathlib.Path("src").rglob("*.rs")):
        me = layer_of(path)
        if me in ("lib", "main") or me not in rank:
            if me not in ("lib",):
                print(f"layering: {path}: module {me!r} is in no layer (add it to LAYERS)")
                return 1
            continue
        # Comments (doc links included) name other modules without depending on them.
        text = "\n".join(line.split("//", 1)[0] for line in path.read_text().splitlines())
        # `super::X` from a top-level module means crate::X; inside src/driver it stays there.
        pat = r"\bcrate::([a-z_]+)" if path.parent.name == "driver" or path.parent.name == "sim" \
            else r"\b(?:crate|super)::([a-z_]+)"
        for m in re.finditer(pat, text):
            other = m.group(1)
            if other not in rank or other == me:
                continue
            if rank[other] > rank[me]:
                found.setdefault((me, other), path)
    bad = [(e, p) for e, p in found.items() if e not in KNOWN]
    gone = [e for e in KNOWN if e not in found]
    for (me, other), p in bad:
        print(f"layering: {p}: `{me}` uses `{other}`, a layer above it")
    for me, other in gone:
        print(f"layering: the known upward edge {me} -> {other} is gone: remove it from KNOWN")
    if bad or gone:
        return 1
    print(f"layering: OK ({len(LAYERS)} layers, {len(KNOWN)} known upward edges)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
