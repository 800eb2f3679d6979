"""The collectives in a compiled (SPMD-partitioned) HLO module, with bytes and mesh axes.

Example::

    compiled = step.lower(state, batch).compile()
    for c in hlo_collectives(compiled.as_text(), plan.mesh):
        print(c.kind, c.bytes, c.axes)        # e.g. all-gather 8192 ('fsdp',)

``bytes`` is the size of the collective's result on one device (for an all-gather: the gathered
tensor; for a reduce-scatter: the scattered shard). Replica groups are partition ids, i.e.
positions in ``mesh.devices.flat``; the mesh axes of a collective are those along which the
devices of one group differ. Async pairs (``*-start`` / ``*-done``) are counted once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute", "ragged-all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1}
_OP = re.compile(r"=\s*(?P<type>\([^=]*?\)|[a-z0-9]+\[[0-9,]*\](?:\{[^}]*\})?)\s+"
                 r"(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int
    shapes: Tuple[str, ...]
    axes: Tuple[str, ...]
    group_size: int
    line: str


def _type_bytes(text: str) -> Tuple[int, Tuple[str, ...]]:
    total, shapes = 0, []
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
    return total, tuple(shapes)


def _iota(text: str, n: int) -> np.ndarray:
    """``[2,4]T(1,0)`` (iota reshaped and transposed) or ``0,4,1,5,...`` (explicit ids), flattened."""
    m = re.fullmatch(r"\s*\[([0-9,]+)\](?:T\(([0-9,]+)\))?\s*", text)
    if not m:
        return np.array([int(x) for x in re.findall(r"[0-9]+", text)][:n])
    ids = np.arange(n).reshape([int(x) for x in m.group(1).split(",")])
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)


def _replica_groups(line: str) -> Optional[List[List[int]]]:
    m = re.search(r"replica_groups=\{(\{[0-9,{} ]*\})\}", line)
    if m:
        return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([0-9, ]*)\}", m.group(1))]
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        dims = [int(x) for x in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(shape).tolist()
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^{]*)\))?\s*\{([^}]*)\}", line)
    if m:  # mesh['axis_0'=4,'axis_1'=2][, device_ids=([2,4]T(1,0))] {'axis_1'}: groups along the listed axes
        dims = re.findall(r"'([^']+)'=([0-9]+)", m.group(1))
        names, sizes = [d[0] for d in dims], [int(d[1]) for d in dims]
        ids = np.arange(math.prod(sizes))
        if m.group(2):
            ids = _iota(m.group(2), len(ids))
        chosen = [names.index(a) for a in re.findall(r"'([^']+)'", m.group(3))]
        rest = [i for i in range(len(names)) if i not in chosen]
        ids = ids.reshape(sizes).transpose(rest + chosen)
        return ids.reshape(-1, math.prod(sizes[i] for i in chosen)).tolist()
    m = re.search(r"source_target_pairs=\{([0-9,{} ]*)\}", line)
    if m:
        return [[int(x) for x in p.split(",")] for p in re.findall(r"\{([0-9]+,[0-9]+)\}", m.group(1))]
    return None


def _axes_of(groups: Optional[List[List[int]]], axis_names: Sequence[str], axis_sizes: Sequence[int]):
    if not groups or not axis_names:
        return (), (len(groups[0]) if groups else 0)
    varying = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.array(group), axis_sizes)).T  # (members, ndim)
        varying |= {axis_names[i] for i in range(len(axis_names)) if len(set(coords[:, i])) > 1}
    return tuple(a for a in axis_names if a in varying), len(groups[0])


def hlo_collectives(hlo_text: str, mesh=None) -> List[Collective]:
    """Every collective op in ``hlo_text`` (``compiled.as_text()``), with bytes and mesh axes."""
    names = tuple(mesh.axis_names) if mesh is not None else ()
    sizes = tuple(mesh.shape[a] for a in names) if mesh is not None else ()
    out = []
    for line in hlo_text.splitlines():
        m = _OP.search(line)
        if not m:
            continue
        nbytes, shapes = _type_bytes(m.group("type"))
        if m.group("start") and m.group("type").startswith("("):
            # async start returns (operand, result, ...): count the result only
            nbytes, shapes = _type_bytes(_SHAPE.findall(m.group("type")) and
                                         "{}[{}]".format(*_SHAPE.findall(m.group("type"))[-1]))
        axes, group_size = _axes_of(_replica_groups(line), names, sizes)
        out.append(Collective(m.group("kind"), nbytes, shapes, axes, group_size, line.strip()))
    return out


def summarize(collectives: Sequence[Collective]) -> Dict[str, Dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` plus ``{"axis:<name>": {...}}`` sums per mesh axis set."""
    out: Dict[str, Dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in collectives:
        for key in (c.kind, "axes:" + ("+".join(c.axes) or "-")):
            out[key]["count"] += 1
            out[key]["bytes"] += c.bytes
    return dict(out)
