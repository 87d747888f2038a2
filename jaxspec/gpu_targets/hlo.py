"""What an optimized HLO module costs per loop iteration, read from its text.

`parse(text)` reads the module a compiled program prints (`compiled.as_text()`: after
fusion and scheduling, the kernels the device runs). `loop_costs(module)` then walks each
`while` loop of the entry computation and estimates, per iteration of its body:

- **bytes moved** (HBM traffic): every instruction that runs as a kernel reads its operands
  and writes its result once. Instructions that run no kernel cost nothing (parameter,
  constant, tuple, get-tuple-element, bitcast, and a `while`/`call`/`conditional` itself,
  whose computations are counted instead: a nested loop's body times its trip count, a call
  once, a conditional's costliest branch). Two refinements follow what the kernels read:
  a fusion operand that the fused computation only slices (dynamic-slice, slice, gather,
  through bitcasts, elementwise ops and reductions: a fusion computes only its result's
  elements, so a slice of `convert(reduce(p))` reads only that part of p) is charged the
  slices' sizes, not the whole operand's; and a fusion
  whose result is a dynamic-update-slice or a scatter into an operand (updated in place) is
  charged the update's size for the write and nothing for that operand. Register- and cache-resident
  reuse is not modelled: a tensor read by two kernels is charged twice, as HBM would see it
  when it does not fit in L2.
- **kernels launched**: the same kernel-running instructions, counted with the same nesting.
- **copies**: every `copy`/`copy-start` instruction, and every fusion whose computation only
  moves data (no arithmetic; an in-place dynamic-update-slice, a cache write, is not one),
  with the size it writes and its `op_name` metadata (which jax operation it came from).
- **command buffers**: the kernels that run inside XLA's command buffers (CUDA graphs),
  i.e. under a `call` to a computation XLA named `command_buffer...`.

A nested loop whose trip count XLA could not infer (a data-dependent bound) is counted with
the trip count `unknown_trip` gives it (default 1) and reported in `unknown_trips`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

__all__ = [
    "Computation",
    "Instruction",
    "Kernel",
    "LoopCost",
    "Module",
    "loop_costs",
    "parse",
    "program_cost",
    "shape_bytes",
]

_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2,
          "bf16": 2, "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
          "c128": 16, "token": 0, "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3fnuz": 1,
          "f8e5m2fnuz": 1, "f8e4m3": 1, "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
# Instructions that run no kernel of their own.
_FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
         "partition-id", "replica-id", "opt-barrier", "add-dependency", "domain",
         "copy-done", "all-reduce-done", "all-gather-done", "collective-permute-done",
         "send-done", "recv-done", "async-done", "async-update"}
_CONTROL = {"while", "call", "conditional"}
_SLICERS = {"dynamic-slice", "slice", "gather"}
_ELEMENTWISE = {"convert", "negate", "abs", "exponential", "log", "rsqrt", "sqrt", "tanh",
                "logistic", "add", "subtract", "multiply", "divide", "maximum", "minimum",
                "compare", "select", "and", "or", "not"}
_MOVERS = {"parameter", "bitcast", "copy", "transpose", "reshape", "dynamic-slice", "slice",
           "broadcast", "constant", "tuple", "get-tuple-element", "concatenate", "pad"}


def shape_bytes(shape: str) -> int:
    """Bytes of an HLO shape string: an array "bf16[4,1024]{1,0}" or a tuple of them."""
    total = 0.0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _BYTES:
            raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _BYTES[dtype]
    return int(total)


@dataclasses.dataclass
class Instruction:
    name: str
    shape: str  # the result's shape string
    opcode: str
    operands: list[str]  # instruction names
    attrs: str  # everything after the operand list
    root: bool = False

    @property
    def bytes(self) -> int:
        return shape_bytes(self.shape)

    def called(self, key: str) -> list[str]:
        """Computation names of attribute `key` (calls, body, condition, to_apply, ...)."""
        m = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.attrs)
        if m:
            return [c.strip().lstrip("%") for c in m.group(1).split(",") if c.strip()]
        m = re.search(rf"\b{key}=%?([\w.\-]+)", self.attrs)
        return [m.group(1)] if m else []

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def known_trip_count(self) -> int | None:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', self.attrs)
        return int(m.group(1)) if m else None


@dataclasses.dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction]
    entry: bool = False

    @property
    def root(self) -> Instruction:
        return next(i for i in self.instructions.values() if i.root)

    def users(self, name: str) -> list[Instruction]:
        return [i for i in self.instructions.values() if name in i.operands]


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]

    @property
    def entry(self) -> Computation:
        return next(c for c in self.computations.values() if c.entry)


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at text[start]."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack, i, quoted = [], start, False
    while i < len(text):
        c = text[i]
        if quoted:
            if c == "\\":
                i += 1
            elif c == '"':
                quoted = False
        elif c == '"':
            quoted = True
        elif c in pairs:
            stack.append(pairs[c])
        elif stack and c == stack[-1]:
            stack.pop()
            if not stack:
                return i + 1
        i += 1
    raise ValueError(f"unbalanced HLO text: {text[start:start + 80]!r}")


_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_LINE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _instruction(line: str) -> Instruction | None:
    m = _LINE.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    paren = rest.index("(")
    opcode = rest[:paren]
    close = _balanced(rest, paren)
    operands = re.findall(r"%([\w.\-]+)", rest[paren:close])
    return Instruction(m.group(2), shape, opcode, operands, rest[close:], root=bool(m.group(1)))


def parse(text: str) -> Module:
    """An HLO module's text (`compiled.as_text()`) -> Module."""
    computations, current = {}, None
    for line in text.splitlines():
        stripped = line.strip()
        if current is None:
            m = _HEADER.match(stripped)
            if m and not stripped.startswith("HloModule"):
                current = Computation(m.group(2), {}, entry=bool(m.group(1)))
            continue
        if stripped == "}":
            computations[current.name] = current
            current = None
            continue
        inst = _instruction(line)
        if inst is not None:
            current.instructions[inst.name] = inst
    if not any(c.entry for c in computations.values()):
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(computations)


@dataclasses.dataclass
class Copy:
    """A data-movement kernel: its size, where jax emitted it, and the loop nest it sits in."""

    name: str
    bytes: int
    op_name: str
    kind: str  # "copy" or the fusion's name
    count: int  # executions per iteration of the loop reported


@dataclasses.dataclass
class LoopCost:
    """Per-iteration cost of one loop's body (see the module docstring for the method)."""

    loop: str  # the while instruction's name
    trip_count: int | None
    bytes: float = 0.0
    kernels: int = 0
    command_buffer_kernels: int = 0
    copies: list[Copy] = dataclasses.field(default_factory=list)
    unknown_trips: list[str] = dataclasses.field(default_factory=list)
    largest: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    # Every kernel-running instruction walked (jaxspec.gpu_targets.estimate times them);
    # left out of as_dict.
    kernel_list: list[Kernel] = dataclasses.field(default_factory=list, repr=False)

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "kernel_list"}


@dataclasses.dataclass
class Kernel:
    """One kernel-running instruction of a walked loop body: where it sits, its executions
    per iteration of the loop reported, and the bytes each execution moves."""

    inst: Instruction
    computation: Computation
    count: int
    bytes: int
    in_command_buffer: bool


def _fusion_bytes(module: Module, inst: Instruction, comp: Computation) -> int:
    """Bytes a fusion moves: operands read (sliced ones at their slices' sizes, operands
    updated in place not at all) plus the result written (an in-place update's size)."""
    called = inst.called("calls")
    fused = module.computations.get(called[0]) if called else None
    if fused is None:
        return sum(comp.instructions[o].bytes for o in inst.operands
                   if o in comp.instructions) + inst.bytes
    params = {}
    for i in fused.instructions.values():
        if i.opcode == "parameter":
            params[i.name] = i
    roots = [fused.root]
    if fused.root.opcode == "tuple":
        roots = [fused.instructions[o] for o in fused.root.operands]
    in_place = {}  # parameter name -> update bytes written instead of the whole buffer
    for r in roots:
        node = r
        while node.opcode == "bitcast":
            node = fused.instructions[node.operands[0]]
        if node.opcode in ("dynamic-update-slice", "scatter"):
            buf = fused.instructions[node.operands[0]]
            while buf.opcode == "bitcast":
                buf = fused.instructions[buf.operands[0]]
            update = node.operands[1 if node.opcode == "dynamic-update-slice" else 2]
            if buf.opcode == "parameter":
                in_place[buf.name] = (r.name, fused.instructions[update].bytes)
    written = 0
    for r in roots:
        hit = [v for v in in_place.values() if v[0] == r.name]
        written += hit[0][1] if hit else r.bytes
    read = 0
    for p in params.values():
        if p.name in in_place:
            continue
        read += _read_bytes(fused, p)
    return read + written


def _read_bytes(fused: Computation, inst: Instruction) -> int:
    """Bytes of `inst` (a fused parameter) that the fusion reads: the slices taken of it
    when slicing is all it is used for, through bitcasts, elementwise ops and reductions
    (a fusion computes only the elements of its result, so a slice of `reduce(p)` or of
    `convert(p)` reads only the matching part of p), else all of it."""
    return int(inst.bytes * _read_fraction(fused, inst))


def _dims(shape: str) -> str:
    found = _ARRAY.findall(shape)
    return found[0][1] if len(found) == 1 else shape


def _elements(shape: str) -> int:
    n = 1
    for d in filter(None, _dims(shape).split(",")):
        n *= int(d)
    return n


def _read_fraction(fused: Computation, inst: Instruction) -> float:
    """The share of `inst`'s elements the fusion needs (1.0: all of them)."""
    if inst.root:
        return 1.0
    users = fused.users(inst.name)
    total = 0.0
    for u in users:
        first = u.operands[0] == inst.name
        if u.opcode == "bitcast":
            total += _read_fraction(fused, u)
        elif u.opcode in _SLICERS and first:
            total += _elements(u.shape) / max(_elements(inst.shape), 1)
        elif u.opcode in ("dynamic-update-slice", "scatter") and first:
            total += 0  # updated in place: not read
        elif u.opcode == "reduce" and first and len(u.operands) == 2:
            # Each result element reads the reduced dimensions of its own position: a share
            # of the result needs the same share of the input.
            total += _read_fraction(fused, u)
        elif u.opcode in _ELEMENTWISE and _dims(u.shape) == _dims(inst.shape):
            total += _read_fraction(fused, u)
        else:
            return 1.0
        if total >= 1.0:
            return 1.0
    return total


def _is_mover(module: Module, inst: Instruction) -> bool:
    called = inst.called("calls")
    fused = module.computations.get(called[0]) if called else None
    return fused is not None and all(i.opcode in _MOVERS for i in fused.instructions.values())


def _walk(module: Module, comp: Computation, cost: LoopCost, times: int, in_buffer: bool,
          unknown_trip: Callable[[Instruction], int], custom_reads=None):
    for inst in comp.instructions.values():
        op = inst.opcode
        if op in _FREE:
            continue
        if op == "while":
            trips = inst.known_trip_count
            if trips is None:
                trips = unknown_trip(inst)
                cost.unknown_trips.append(f"{inst.name} ({inst.op_name}): counted x{trips}")
            body = module.computations[inst.called("body")[0]]
            _walk(module, body, cost, times * trips, in_buffer, unknown_trip, custom_reads)
            continue
        if op == "call":
            for name in inst.called("to_apply"):
                _walk(module, module.computations[name], cost, times,
                      in_buffer or name.startswith("command_buffer"), unknown_trip, custom_reads)
            continue
        if op == "conditional":
            best = None
            for name in inst.called("branch_computations") or (
                    inst.called("true_computation") + inst.called("false_computation")):
                branch = LoopCost(cost.loop, None)
                _walk(module, module.computations[name], branch, 1, in_buffer, unknown_trip,
                      custom_reads)
                if best is None or branch.bytes > best.bytes:
                    best = branch
            if best is not None:
                cost.bytes += times * best.bytes
                cost.kernels += times * best.kernels
                cost.command_buffer_kernels += times * best.command_buffer_kernels
                cost.copies += best.copies
                cost.unknown_trips += best.unknown_trips
                cost.kernel_list += [dataclasses.replace(k, count=k.count * times)
                                     for k in best.kernel_list]
            continue
        operands = [comp.instructions[o] for o in inst.operands if o in comp.instructions]
        given = custom_reads(inst, operands) if custom_reads is not None else None
        if given is not None:
            moved = given
        elif op == "fusion":
            moved = _fusion_bytes(module, inst, comp)
        else:
            moved = sum(comp.instructions[o].bytes for o in inst.operands
                        if o in comp.instructions) + inst.bytes
        cost.bytes += times * moved
        cost.kernels += times
        cost.command_buffer_kernels += times if in_buffer else 0
        cost.largest.append((times * moved, inst.name, inst.op_name))
        cost.kernel_list.append(Kernel(inst, comp, times, moved, in_buffer))
        if op in ("copy", "copy-start") or (op == "fusion" and _is_mover(module, inst)):
            cost.copies.append(Copy(inst.name, inst.bytes, inst.op_name,
                                    op if op != "fusion" else inst.name, times))


def loop_costs(module: Module, unknown_trip: Callable[[Instruction], int] = lambda inst: 1,
               top: int = 8, custom_reads=None) -> list[LoopCost]:
    """Per-iteration costs of the entry computation's `while` loops (outermost ones), each
    with its `top` costliest kernels in `largest` as (bytes, name, op_name).

    `custom_reads(instruction, operand_instructions)` may give the bytes an instruction
    moves, read and written (a kernel that reads part of an operand, or returns an aliased
    input it never writes, which the HLO cannot show); None: the rules above."""
    out = []
    for inst in module.entry.instructions.values():
        if inst.opcode != "while":
            continue
        cost = LoopCost(inst.name, inst.known_trip_count)
        body = module.computations[inst.called("body")[0]]
        _walk(module, body, cost, 1, False, unknown_trip, custom_reads)
        cost.largest = sorted(cost.largest, reverse=True)[:top]
        out.append(cost)
    return out


def program_cost(module: Module, unknown_trip: Callable[[Instruction], int] = lambda inst: 1,
                 top: int = 8, custom_reads=None) -> LoopCost:
    """The whole entry computation's cost, loops counted at their trip counts."""
    cost = LoopCost("ENTRY", 1)
    _walk(module, module.entry, cost, 1, False, unknown_trip, custom_reads)
    cost.largest = sorted(cost.largest, reverse=True)[:top]
    return cost
