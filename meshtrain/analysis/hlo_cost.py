"""Per-op cost of a compiled program: its optimized HLO, each top-level instruction put in one class.

The forecast (:mod:`meshtrain.analysis.forecast`) times each class of work at the rate that class is
measured to reach; with a compiled program it reads the classes' FLOPs and bytes here::

    cost = hlo_cost(compiled.as_text())      # one device's program (SPMD-partitioned)
    cost.matmul_flops, cost.attention_flops, cost.memory_bytes, cost.collective_bytes
    cost.loops                               # ((body name, trip count, how it was known), ...)

Classes (every top-level instruction of the entry computation, and of the computations it calls):

* ``matmul``: ``dot`` / ``convolution`` (a fusion counts as matmul when its fused computation holds
  one: XLA:CPU output fusions, XLA:GPU Triton GEMM fusions), cuBLAS / cuBLASLt custom calls
  (``__cublas$gemm``, ``__cublas$lt$matmul``, ``...$f8``). FLOPs ``2 · result elements · contracted
  size`` (``2·M·N·K·batch``); a convolution ``2 · result elements · kernel elements / output features``.
* ``attention``: cuDNN fused-attention custom calls (``__cudnn$fmha...``): FLOPs on the forecast's
  convention (forward ``4·B·N·T·S·H``, halved when the call's mask is causal; a backward call twice
  its forward), q and k read as ``B,T,N,H``; Pallas/Mosaic splash calls (``tpu_custom_call`` naming
  splash/flash): counted, FLOPs unknown (``attention_flops_known`` False). Dots that compute scores
  or apply them (the einsums ``...nts...`` / ``...gqs...`` of meshtrain's dense and blockwise
  attention, read from the op's ``op_name`` metadata) are attention too, at their executed FLOPs.
* ``collective``: all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute (their
  ``-start`` ops and ``async-start`` wrappers; the ``-done`` halves count nothing): result bytes.
* ``memory``: every other op or fusion: operand + result bytes (bookkeeping ops — parameter,
  constant, tuple, get-tuple-element, bitcast, partition ids — move nothing and count nothing).

Loops: a ``while`` body counts × its trip count: XLA's ``known_trip_count`` when the compiled program
states it, else the bound of the condition's ``compare(counter, constant)`` (init 0, step 1, ``LT``),
else once — and the loop is listed in ``loops`` with ``how="unknown"`` so the under-count shows.
``call`` bodies count once per call, a ``conditional`` its most expensive branch.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional, Tuple

#: Bytes per element of an HLO element type (fp8 types and sub-byte ints at one byte).
_DTYPE_BYTES = {"pred": 1, "s4": 1, "u4": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "token": 0}
_ARRAY = re.compile(r"\b(pred|token|[a-z]+\d+[a-z0-9]*)\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute",
                "ragged-all-to-all", "collective-broadcast")
#: Ops that move no data (or only name it).
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "partition-id", "replica-id", "after-all",
         "opt-barrier", "iota", "add-dependency", "domain", "copy-done", "send-done", "recv-done", "async-done",
         "async-update", "all-gather-done", "all-reduce-done", "collective-permute-done"}
#: Einsum specs of attention's score and apply dots (meshtrain.parallel.attention / flash): a key axis ``s``
#: against a query axis (``t`` dense, ``q`` blockwise).
_ATTENTION_EINSUM = re.compile(r"(bnts|bkgqs|nts->|gqs->)")
_CUBLAS = ("__cublas$gemm", "__cublas$lt$matmul")


@dataclasses.dataclass(frozen=True)
class Instr:
    """One HLO instruction: ``name``, result ``shape`` text, ``opcode``, operand names, the attribute text,
    ``args`` the raw text between the opcode's parentheses (a constant's value)."""

    name: str
    shape: str
    opcode: str
    operands: Tuple[str, ...]
    attrs: str
    args: str = ""


@dataclasses.dataclass(frozen=True)
class Loop:
    """A ``while`` loop: its body computation, trip count, and how the count was known
    (``"xla"``: ``known_trip_count``; ``"condition"``: the condition's constant bound; ``"unknown"``: counted once)."""

    body: str
    trips: int
    how: str


@dataclasses.dataclass(frozen=True)
class HloCost:
    """One device's program cost by class (see the module docstring). FLOPs and bytes per device, per step."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    attention_calls: int = 0
    attention_flops_known: bool = True
    memory_bytes: float = 0.0
    collective_bytes: float = 0.0
    collective_ops: int = 0
    ops: int = 0
    loops: Tuple[Loop, ...] = ()

    @property
    def dot_flops(self) -> float:
        """Every counted FLOP (matmul + attention): compare with ``cost_analysis()["flops"]``."""
        return self.matmul_flops + self.attention_flops

    def __add__(self, other: "HloCost") -> "HloCost":
        return HloCost(self.matmul_flops + other.matmul_flops, self.attention_flops + other.attention_flops,
                       self.attention_calls + other.attention_calls,
                       self.attention_flops_known and other.attention_flops_known,
                       self.memory_bytes + other.memory_bytes, self.collective_bytes + other.collective_bytes,
                       self.collective_ops + other.collective_ops, self.ops + other.ops, self.loops + other.loops)

    def times(self, k: int) -> "HloCost":
        """This cost run ``k`` times (a loop body); the loops it holds stay listed once."""
        return dataclasses.replace(self, matmul_flops=self.matmul_flops * k, attention_flops=self.attention_flops * k,
                                   attention_calls=self.attention_calls * k, memory_bytes=self.memory_bytes * k,
                                   collective_bytes=self.collective_bytes * k, collective_ops=self.collective_ops * k,
                                   ops=self.ops * k)

    def to_dict(self) -> Dict[str, object]:
        d = dataclasses.asdict(self)
        d["loops"] = [dataclasses.asdict(lp) for lp in self.loops]
        return d

    @classmethod
    def from_dict(cls, d: Dict[str, object]) -> "HloCost":
        """The inverse of :meth:`to_dict`."""
        return cls(**{**d, "loops": tuple(Loop(**lp) for lp in d.get("loops", ()))})


# -- parsing ---------------------------------------------------------------------------------------

def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closers = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closers:
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_instruction(line: str) -> Optional[Instr]:
    """``%name = SHAPE opcode(operands), attrs`` → :class:`Instr` (``None`` for anything else)."""
    m = _INSTR.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([a-z][\w\-.]*)\(", rest)
    if not op:
        return None
    end = _balanced(rest, op.end() - 1)
    args = rest[op.end():end - 1]
    return Instr(m.group(1), shape, op.group(1), tuple(re.findall(r"%([\w.\-]+)", args)), rest[end:], args)


def parse_module(text: str) -> Tuple[Dict[str, List[Instr]], Optional[str]]:
    """``({computation name: [instructions]}, entry name)`` of an HLO module's text."""
    comps: Dict[str, List[Instr]] = {}
    entry, current = None, None
    for line in text.splitlines():
        head = _HEADER.match(line)
        if head and not line.startswith(" "):
            current = head.group(2)
            comps[current] = []
            if head.group(1):
                entry = current
            continue
        if current is not None and line.strip() == "}":
            current = None
            continue
        if current is not None:
            ins = parse_instruction(line)
            if ins is not None:
                comps[current].append(ins)
    return comps, entry


def _arrays(shape: str) -> List[Tuple[str, Tuple[int, ...]]]:
    return [(t, tuple(int(d) for d in dims.split(",") if d)) for t, dims in _ARRAY.findall(shape)]


def _elements(dims: Tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape (a tuple: the sum of its arrays)."""
    return sum(_elements(dims) * _DTYPE_BYTES.get(t, 4) for t, dims in _arrays(shape))


def _dims(shape: str) -> Tuple[int, ...]:
    arrays = _arrays(shape)
    return arrays[0][1] if arrays else ()


def _int_list(attrs: str, key: str) -> Tuple[int, ...]:
    m = re.search(key + r"=\{([\d,]*)\}", attrs)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


# -- per-instruction FLOPs ---------------------------------------------------------------------------

def dot_flops(ins: Instr, shapes: Dict[str, str]) -> float:
    """``2 · result elements · contracted size`` of a ``dot`` (batch dims are in the result)."""
    lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else ()
    k = _elements(tuple(lhs[i] for i in _int_list(ins.attrs, "lhs_contracting_dims") if i < len(lhs)))
    return 2.0 * _elements(_dims(ins.shape)) * k


def conv_flops(ins: Instr, shapes: Dict[str, str]) -> float:
    """``2 · result elements · kernel elements / output features`` of a ``convolution``."""
    kernel = _dims(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else ()
    labels = re.search(r"dim_labels=\w+_(\w+)->", ins.attrs)
    o = labels.group(1).find("o") if labels else -1
    out_features = kernel[o] if 0 <= o < len(kernel) else 1
    return 2.0 * _elements(_dims(ins.shape)) * _elements(kernel) / max(out_features, 1)


def _cublas_flops(ins: Instr, shapes: Dict[str, str]) -> float:
    lhs = _dims(shapes.get(ins.operands[0], "")) if ins.operands else ()
    m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.attrs)
    idx = [int(x.strip('" ')) for x in m.group(1).split(",") if x.strip('" ')] if m else []
    k = _elements(tuple(lhs[i] for i in idx if i < len(lhs)))
    return 2.0 * _elements(_dims(ins.shape)) * k  # the first array of the (result, workspace) tuple


def _fmha_flops(ins: Instr, shapes: Dict[str, str]) -> float:
    """cuDNN fused attention on the forecast's convention: forward ``4·B·N·T·S·H`` (½ causal), backward 2×."""
    if len(ins.operands) < 2:
        return 0.0
    q, k = _dims(shapes.get(ins.operands[0], "")), _dims(shapes.get(ins.operands[1], ""))
    if len(q) != 4 or len(k) != 4:
        return 0.0
    fwd = 4.0 * _elements(q) * k[1] * (0.5 if '"mask_type":"CAUSAL"' in ins.attrs else 1.0)
    return fwd * (2.0 if "Backward" in ins.attrs else 1.0)


def _is_attention_dot(ins: Instr) -> bool:
    name = re.search(r'op_name="([^"]*)"', ins.attrs)
    return bool(name and _ATTENTION_EINSUM.search(name.group(1).lower()))


# -- the walk ----------------------------------------------------------------------------------------

class _Walker:
    def __init__(self, comps: Dict[str, List[Instr]]):
        self.comps = comps
        self.memo: Dict[str, HloCost] = {}

    def computation(self, name: str) -> HloCost:
        if name not in self.memo:
            self.memo[name] = HloCost()  # a cycle (none in valid HLO) counts nothing
            instrs = self.comps.get(name, [])
            shapes = {i.name: i.shape for i in instrs}
            total = HloCost()
            for ins in instrs:
                total = total + self.instruction(ins, shapes)
            self.memo[name] = total
        return self.memo[name]

    def _fused_dots(self, name: str) -> Tuple[float, float]:
        """(matmul, attention) FLOPs of the dots inside a fused computation (nested fusions too)."""
        instrs = self.comps.get(name, [])
        shapes = {i.name: i.shape for i in instrs}
        mm = att = 0.0
        for ins in instrs:
            if ins.opcode in ("dot", "convolution"):
                f = dot_flops(ins, shapes) if ins.opcode == "dot" else conv_flops(ins, shapes)
                att, mm = (att + f, mm) if _is_attention_dot(ins) else (att, mm + f)
            elif ins.opcode == "fusion":
                sub = _called(ins.attrs, "calls")
                if sub:
                    m2, a2 = self._fused_dots(sub[0])
                    mm, att = mm + m2, att + a2
        return mm, att

    def instruction(self, ins: Instr, shapes: Dict[str, str]) -> HloCost:
        op = ins.opcode
        if op in _FREE or op.endswith("-done"):
            return HloCost()
        if op == "while":
            return self._while(ins)
        if op == "call":
            return sum((self.computation(c) for c in _called(ins.attrs, "to_apply")), HloCost())
        if op == "conditional":
            branches = [self.computation(c) for c in _called(ins.attrs, "branch_computations")
                        + _called(ins.attrs, "true_computation") + _called(ins.attrs, "false_computation")]
            return max(branches, key=lambda c: (c.dot_flops, c.memory_bytes), default=HloCost())
        if op in ("dot", "convolution"):
            f = dot_flops(ins, shapes) if op == "dot" else conv_flops(ins, shapes)
            return HloCost(attention_flops=f, ops=1) if _is_attention_dot(ins) else HloCost(matmul_flops=f, ops=1)
        base = op[:-len("-start")] if op.endswith("-start") else op
        if base in _COLLECTIVES:
            return HloCost(collective_bytes=float(_result_bytes(ins)), collective_ops=1, ops=1)
        if op == "async-start":
            inner = [i.opcode for c in _called(ins.attrs, "calls") for i in self.comps.get(c, [])]
            if any(o.replace("-start", "") in _COLLECTIVES for o in inner):
                return HloCost(collective_bytes=float(_result_bytes(ins)), collective_ops=1, ops=1)
        if op == "custom-call":
            return self._custom_call(ins, shapes)
        if op == "fusion":
            called = _called(ins.attrs, "calls")
            mm, att = self._fused_dots(called[0]) if called else (0.0, 0.0)
            if mm or att:
                return HloCost(matmul_flops=mm, attention_flops=att, ops=1)
        moved = shape_bytes(ins.shape) + sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
        return HloCost(memory_bytes=float(moved), ops=1)

    def _custom_call(self, ins: Instr, shapes: Dict[str, str]) -> HloCost:
        target = re.search(r'custom_call_target="([^"]*)"', ins.attrs)
        target = target.group(1) if target else ""
        if target.startswith(_CUBLAS):
            return HloCost(matmul_flops=_cublas_flops(ins, shapes), ops=1)
        if target.startswith("__cudnn$fmha"):
            return HloCost(attention_flops=_fmha_flops(ins, shapes), attention_calls=1, ops=1)
        if target == "tpu_custom_call" and re.search(r"splash|flash", ins.attrs, re.I):
            return HloCost(attention_calls=1, attention_flops_known=False, ops=1)
        moved = shape_bytes(ins.shape) + sum(shape_bytes(shapes.get(o, "")) for o in ins.operands)
        return HloCost(memory_bytes=float(moved), ops=1)

    def _while(self, ins: Instr) -> HloCost:
        body = (_called(ins.attrs, "body") or [""])[0]
        trips, how = trip_count(ins, self.comps)
        inner = self.computation(body)
        return dataclasses.replace(inner.times(trips), loops=(Loop(body, trips, how),) + inner.loops)


def _called(attrs: str, key: str) -> List[str]:
    m = re.search(key + r"=\{([^}]*)\}", attrs)
    if m:
        return re.findall(r"%?([\w.\-]+)", m.group(1))
    m = re.search(key + r"=%?([\w.\-]+)", attrs)
    return [m.group(1)] if m else []


def _result_bytes(ins: Instr) -> int:
    """A collective's payload: its result (an async ``-start``'s tuple holds operand and result: the last array)."""
    arrays = _arrays(ins.shape)
    if ins.shape.startswith("(") and len(arrays) > 1:
        t, dims = arrays[-1]
        return _elements(dims) * _DTYPE_BYTES.get(t, 4)
    return shape_bytes(ins.shape)


def trip_count(ins: Instr, comps: Dict[str, List[Instr]]) -> Tuple[int, str]:
    """A ``while``'s trip count and how it is known (see :class:`Loop`)."""
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    if m:
        return int(m.group(1)), "xla"
    cond = (_called(ins.attrs, "condition") or [""])[0]
    consts = [c for c in comps.get(cond, []) if c.opcode == "constant" and re.match(r"s(32|64)\[\]", c.shape)]
    compares = [c for c in comps.get(cond, []) if c.opcode in ("compare", "fusion")]
    if len(consts) == 1 and compares and "direction=GT" not in " ".join(c.attrs for c in compares):
        value = consts[0].args.strip()
        if value.lstrip("-").isdigit() and int(value) > 0:
            return int(value), "condition"
    return 1, "unknown"


def hlo_cost(text: str) -> HloCost:
    """The per-class cost of a compiled module's text (``compiled.as_text()``): one device's program."""
    comps, entry = parse_module(text)
    if entry is None:
        return HloCost()
    return _Walker(comps).computation(entry)


__all__ = ["HloCost", "Instr", "Loop", "conv_flops", "dot_flops", "hlo_cost", "parse_instruction", "parse_module",
           "shape_bytes", "trip_count"]
