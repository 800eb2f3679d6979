"""The collectives in a compiled (SPMD-partitioned) HLO module, with bytes, mesh axes and how many
times each runs per step.

Example::

    compiled = step.lower(state, batch).compile()
    ops = hlo_collectives(compiled.as_text(), plan.mesh)
    for c in ops:
        print(c.kind, c.bytes, c.axes, c.executions)   # e.g. all-gather 8192 ('fsdp',) 4
    per_axis(ops)     # {'fsdp': {'all-gather': bytes per step, ...}, ...}

``bytes`` is the size of the collective's result on one device (for an all-gather: the gathered
tensor; for a reduce-scatter: the scattered shard). ``executions`` is how often the op runs in one
call of the program: the product of the known trip counts of the ``while`` loops around it (a
layer scan of ``L`` layers runs its collectives ``L`` times). Replica groups are partition ids,
i.e. positions in ``mesh.devices.flat``; the mesh axes of a collective are those along which the
devices of one group differ. Async pairs (``*-start`` / ``*-done``) are counted once.

Next: :func:`per_axis` for bytes per step per mesh axis, or compare with the analytic inventory
(:mod:`meshtrain.analysis.comms`).
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
_KIND = re.compile(r"\s(?P<kind>" + "|".join(KINDS) + r")(?P<start>-start)?\(")
_COMMENT = re.compile(r"/\*.*?\*/")
_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_CALLEE = re.compile(r"\b(?P<attr>calls|to_apply|body|condition|true_computation|false_computation)=%(?P<name>[\w.\-]+)")
_CALLEES = re.compile(r"\b(?:branch_computations|called_computations)=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"(?P<n>[0-9]+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op of the partitioned program.

    Attributes:
      kind: one of :data:`KINDS`.
      bytes: result size on one device, per execution.
      shapes: the result shapes, e.g. ``("f32[256,16,16]",)``.
      axes: mesh axes the op runs over (devices of one replica group differ along these).
      group_size: devices per replica group.
      line: the HLO instruction.
      executions: runs per program call (product of enclosing loop trip counts; 1 at top level).
      computation: the HLO computation that holds the op.
    """

    kind: str
    bytes: int
    shapes: Tuple[str, ...]
    axes: Tuple[str, ...]
    group_size: int
    line: str
    executions: int = 1
    computation: str = ""

    @property
    def bytes_per_step(self) -> int:
        """``bytes × executions``: result bytes this op produces per program call."""
        return self.bytes * self.executions

    @property
    def wire_bytes(self) -> float:
        """Bytes one device sends per execution with ring algorithms over ``g = group_size``:
        all-gather / all-to-all ``(g-1)/g · result``, reduce-scatter ``(g-1) · result``,
        all-reduce ``2(g-1)/g · result``, collective-permute ``result``."""
        return wire_bytes(self.kind, self.bytes, self.group_size)


def wire_bytes(kind: str, result_bytes: float, group_size: int) -> float:
    """Ring-algorithm bytes sent per device for one collective (see :attr:`Collective.wire_bytes`)."""
    g = max(int(group_size), 1)
    if g == 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (g - 1) / g * result_bytes
    if kind == "reduce-scatter":
        return float(g - 1) * result_bytes
    if kind == "collective-permute":
        return float(result_bytes)
    return (g - 1) / g * result_bytes  # all-gather, all-to-all, ragged-all-to-all


def _type_bytes(text: str) -> Tuple[int, Tuple[str, ...]]:
    total, shapes = 0, []
    for dtype, dims in _SHAPE.findall(text):
        if dtype not in _DTYPE_BYTES:
            continue
        n = math.prod(int(d) for d in dims.split(",") if d) if dims else 1
        total += n * _DTYPE_BYTES[dtype]
        shapes.append(f"{dtype}[{dims}]")
    return total, tuple(shapes)


def _split_top(tuple_text: str) -> List[str]:
    """``"(a, (b, c), d)"`` → ``["a", "(b, c)", "d"]``."""
    inner = tuple_text.strip()[1:-1]
    parts, depth, cur = [], 0, []
    for ch in inner:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def _result_type(line: str, kind_start: int) -> Optional[str]:
    """The result type text of ``%x = TYPE kind(...)`` (tuples included, comments stripped)."""
    eq = line.find("=")
    if eq < 0 or eq > kind_start:
        return None
    return line[eq + 1:kind_start].strip()


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
    total = math.prod(axis_sizes)
    for group in groups:
        group = [g for g in group if g < total]
        if not group:
            continue
        coords = np.array(np.unravel_index(np.array(group), axis_sizes)).T  # (members, ndim)
        varying |= {axis_names[i] for i in range(len(axis_names)) if len(set(coords[:, i])) > 1}
    return tuple(a for a in axis_names if a in varying), len(groups[0])


def _computations(hlo_text: str):
    """``{name: [instruction lines]}``, the ENTRY name, and call edges ``(caller, callee, factor)``."""
    comps: Dict[str, List[str]] = {}
    entry, current = None, None
    for raw in hlo_text.splitlines():
        line = _COMMENT.sub("", raw)
        if current is None:
            m = _HEADER.match(line.strip()) if not line.startswith(" ") else None
            if m:
                current = m.group("name")
                comps[current] = []
                if line.lstrip().startswith("ENTRY"):
                    entry = current
            continue
        if line.strip() == "}" and not line.startswith("  "):
            current = None
            continue
        comps[current].append(line)
    edges = []
    index = {name: _instructions(lines) for name, lines in comps.items()}
    for caller, lines in comps.items():
        for line in lines:
            trip = _TRIP.search(line)
            derived = None
            if trip is None and _WHILE.search(line):
                derived = _derived_trip_count(line, index, caller)
            for m in _CALLEE.finditer(line):
                if m.group("attr") == "body":
                    factor = int(trip.group("n")) if trip else (derived if derived is not None else 1)
                else:
                    factor = 1
                edges.append((caller, m.group("name"), factor))
            for m in _CALLEES.finditer(line):
                for name in re.findall(r"%([\w.\-]+)", m.group("names")):
                    edges.append((caller, name, 1))
    return comps, entry, edges


_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+)\s*=\s*(?P<rest>.*)$")
_WHILE = re.compile(r"\bwhile\(%(?P<init>[\w.\-]+)\), condition=%(?P<cond>[\w.\-]+), body=%(?P<body>[\w.\-]+)")
_CONST = re.compile(r"^\S+\s+constant\((?P<v>-?\d+)\)")   # "u32[]{:T(128)} constant(4), ..."
_GTE = re.compile(r"\bget-tuple-element\(%[\w.\-]+\), index=(?P<i>\d+)")
_COMPARE = re.compile(r"\bcompare\(%(?P<a>[\w.\-]+), %(?P<b>[\w.\-]+)\), direction=(?P<dir>[A-Z]+)")
_FORWARD = re.compile(r"\b(?:copy|convert|bitcast)\(%(?P<x>[\w.\-]+)\)")
_ADD = re.compile(r"\badd\(%(?P<a>[\w.\-]+), %(?P<b>[\w.\-]+)\)")


def _instructions(lines: List[str]) -> Dict[str, str]:
    """``{instruction name: text after '='}``, plus ``"ROOT"`` → the root's name."""
    out: Dict[str, str] = {}
    for line in lines:
        m = _INSTR.match(line)
        if m:
            out[m.group("name")] = m.group("rest")
            if line.lstrip().startswith("ROOT"):
                out["ROOT"] = m.group("name")
    return out


def _constant(comp: Dict[str, str], name: str, depth: int = 0) -> Optional[int]:
    rest = comp.get(name)
    if rest is None or depth > 8:
        return None
    m = _CONST.match(rest)
    if m:
        return int(m.group("v"))
    f = _FORWARD.search(rest)
    return _constant(comp, f.group("x"), depth + 1) if f else None


def _tuple_operand(comp: Dict[str, str], name: str, i: int) -> Optional[str]:
    rest = comp.get(name, "")
    m = re.search(r"\btuple\((?P<ops>[^)]*)\)", rest)
    if not m:
        return None
    ops = re.findall(r"%([\w.\-]+)", m.group("ops"))
    return ops[i] if i < len(ops) else None


def _derived_trip_count(line: str, index: Dict[str, Dict[str, str]], caller: str) -> Optional[int]:
    """Trip count of a ``while`` without XLA's ``known_trip_count`` annotation, read from the loop:
    the condition compares one tuple element with a constant bound (``i < n``), the element starts at
    a constant in the loop's initial tuple (0 if it cannot be resolved) and the body adds a constant
    step to it (1 if not resolved). XLA:TPU's windowed-einsum (collective matmul) loops and layer
    scans both have this shape. ``None`` when the condition has another shape."""
    w = _WHILE.search(line)
    cond, body, here = index.get(w.group("cond"), {}), index.get(w.group("body"), {}), index.get(caller, {})
    root = cond.get(cond.get("ROOT", ""), "")
    cm = _COMPARE.search(root)
    if not cm:
        return None
    direction = cm.group("dir")
    elem, bound = None, None
    for var, other, flip in ((cm.group("a"), cm.group("b"), False), (cm.group("b"), cm.group("a"), True)):
        g = _GTE.search(cond.get(var, ""))
        c = _constant(cond, other)
        if g and c is not None:
            elem, bound = int(g.group("i")), c
            if flip:  # n > i  is  i < n
                direction = {"GT": "LT", "GE": "LE", "LT": "GT", "LE": "GE"}.get(direction, direction)
            break
    if elem is None:
        return None
    start_name = _tuple_operand(here, w.group("init"), elem)
    start = _constant(here, start_name) if start_name else None
    start = 0 if start is None else start
    step = 1
    next_name = _tuple_operand(body, body.get("ROOT", ""), elem)
    am = _ADD.search(body.get(next_name, "")) if next_name else None
    if am:
        for x in (am.group("a"), am.group("b")):
            k = _constant(body, x)
            if k:
                step = k
    if direction in ("LT", "NE") and step > 0:
        return max(0, -(-(bound - start) // step))
    if direction == "LE" and step > 0:
        return max(0, (bound - start) // step + 1)
    if direction == "GT" and step < 0:
        return max(0, -(-(start - bound) // -step))
    if direction == "GE" and step < 0:
        return max(0, (start - bound) // -step + 1)
    return None


def _executions(comps, entry, edges) -> Dict[str, int]:
    """Runs per program call of each computation (sum over call sites of caller runs × trip count)."""
    callers: Dict[str, List[Tuple[str, int]]] = defaultdict(list)
    for caller, callee, factor in edges:
        callers[callee].append((caller, factor))
    memo: Dict[str, int] = {}

    def runs(name: str, stack=()) -> int:
        if name in memo:
            return memo[name]
        if name == entry or name in stack:
            return 1
        total = sum(runs(c, stack + (name,)) * f for c, f in callers.get(name, ())) or 1
        memo[name] = total
        return total

    return {name: runs(name) for name in comps}


def hlo_collectives(hlo_text: str, mesh=None) -> List[Collective]:
    """Every collective op in ``hlo_text`` (``compiled.as_text()``), with bytes, mesh axes and
    executions per call. ``mesh``: the ``Mesh`` the program was compiled for (for axis names)."""
    names = tuple(mesh.axis_names) if mesh is not None else ()
    sizes = tuple(mesh.shape[a] for a in names) if mesh is not None else ()
    comps, entry, edges = _computations(hlo_text)
    if not comps:  # a bare list of instructions (tests, snippets): one computation
        comps, entry, edges = {"main": [_COMMENT.sub("", l) for l in hlo_text.splitlines()]}, "main", []
    runs = _executions(comps, entry, edges)
    out = []
    for comp, lines in comps.items():
        for line in lines:
            m = _KIND.search(line)
            if not m or "=" not in line[:m.start()]:
                continue
            type_text = _result_type(line, m.start())
            if type_text is None:
                continue
            kind = m.group("kind")
            if m.group("start") and type_text.startswith("(") and kind != "all-reduce":
                parts = _split_top(type_text)  # (operands, results[, context...]): keep the results
                type_text = parts[1] if len(parts) > 1 else parts[0]
            nbytes, shapes = _type_bytes(type_text)
            axes, group_size = _axes_of(_replica_groups(line), names, sizes)
            out.append(Collective(kind, nbytes, shapes, axes, group_size, line.strip(), runs.get(comp, 1), comp))
    return out


def summarize(collectives: Sequence[Collective]) -> Dict[str, Dict[str, int]]:
    """``{kind: {"count": n, "bytes": b}}`` plus ``{"axes:<names>": {...}}`` sums per mesh axis set.

    Counts ops as they appear in the program (one per instruction, ``bytes`` once); use
    :func:`per_axis` for traffic per step (loop trip counts applied).
    """
    out: Dict[str, Dict[str, int]] = defaultdict(lambda: {"count": 0, "bytes": 0})
    for c in collectives:
        for key in (c.kind, "axes:" + ("+".join(c.axes) or "-")):
            out[key]["count"] += 1
            out[key]["bytes"] += c.bytes
    return dict(out)


def axes_key(axes: Sequence[str]) -> str:
    """``("data", "fsdp")`` → ``"data+fsdp"``; no axes → ``"-"`` (a collective over one device)."""
    return "+".join(axes) or "-"


def per_axis(collectives: Sequence[Collective]) -> Dict[str, Dict[str, int]]:
    """Result bytes per step, ``{axes_key: {kind: bytes, ..., "total": bytes}}``.

    Each op contributes ``bytes × executions``. Ops over no mesh axis (group size 1) are left out.
    """
    out: Dict[str, Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for c in collectives:
        if not c.axes:
            continue
        key = axes_key(c.axes)
        out[key][c.kind] += c.bytes_per_step
        out[key]["total"] += c.bytes_per_step
    return {k: dict(v) for k, v in out.items()}
