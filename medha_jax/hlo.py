"""What a compiled program sends between devices: the collectives of its optimized HLO.

Equal tokens do not show that a mesh axis does parallel work (a layout that XLA answers
with an all-gather of the whole KV cache gives the same tokens); the collectives do. This
reads `compiled.as_text()` and lists every all-reduce, all-gather, reduce-scatter,
all-to-all and collective-permute with the bytes of its result and how many times it runs
per call: an instruction inside a while loop (the layer scan) runs once per iteration, so
its count is the product of the known trip counts of the loops around it.

It also lists the copies a program makes of large arrays (`copies`): a re-layout of the KV
cache gives the same tokens too, and costs a trip through all of it.
"""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np

COLLECTIVE_OPS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                  "collective-permute")

_BYTES_PER_ELEMENT = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                      "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8,
                      "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s")
_INSTRUCTION = re.compile(
    r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join(COLLECTIVE_OPS) + r")(?P<start>-start)?\(")
_CALLEE = re.compile(r"\b(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
# replica_groups, as XLA prints them: listed ({{0,1},{2,3}}), as an iota ([2,2]<=[4], with a
# transpose [2,2]<=[2,2]T(1,0)), or (XLA of jax >= 0.11) as a mesh and the axes the
# collective spans (mesh['member'=2,'local'=2] {'local'}).
_LISTED_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_IOTA_GROUPS = re.compile(
    r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction: its kind, result shape text, bytes and runs per call;
    a collective-permute's source-target pairs (each sends `bytes`; 0 for other ops); the
    JAX name stack it came from (`metadata.op_name`)."""

    op: str
    shape: str
    bytes: int
    count: int
    is_async: bool
    pairs: int = 0
    scope: str = ""

    @property
    def bytes_per_call(self) -> int:
        return self.bytes * self.count


def array_bytes(shape_text: str) -> int:
    """Bytes of every array in an HLO shape ("f32[4,8]{1,0}" or a tuple of them)."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        if dtype not in _BYTES_PER_ELEMENT:
            continue
        size = _BYTES_PER_ELEMENT[dtype]
        for dim in filter(None, dims.split(",")):
            size *= int(dim)
        total += size
    return total


def _computations(hlo_text: str) -> tuple[dict[str, list[str]], str]:
    """Instruction lines of each computation, in schedule order, and the entry's name."""
    computations: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        # Computation headers start in column 0 and open a brace; instructions are indented.
        match = _COMPUTATION.match(line)
        if match and not line[:1].isspace() and line.rstrip().endswith("{"):
            current = match.group(1)
            computations[current] = []
            if line.lstrip().startswith("ENTRY"):
                entry = current
        elif current is not None:
            computations[current].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in this HLO text")
    return computations, entry


def _runs_per_call(computations: dict[str, list[str]], entry: str) -> dict[str, int]:
    """Runs per call of each computation reachable from the entry: the entry once; a while
    body or condition its loop's trip count times its caller's runs (1 when XLA did not
    record a trip count); a fused or called computation as often as its caller."""
    runs: dict[str, int] = {entry: 1}
    pending = [entry]
    while pending:
        caller = pending.pop()
        for line in computations.get(caller, ()):
            callees = _CALLEE.findall(line) + [
                name.strip().lstrip("%") for group in _BRANCHES.findall(line)
                for name in group.split(",")]
            if not callees:
                continue
            trips = _TRIP_COUNT.search(line)
            factor = int(trips.group(1)) if trips and " while(" in line else 1
            for callee in callees:
                if callee in computations and callee not in runs:
                    runs[callee] = runs[caller] * factor
                    pending.append(callee)
    return runs


def replica_groups(line: str) -> list[tuple[int, ...]] | None:
    """The device groups of one collective instruction's line, in whichever of XLA's
    spellings it has; None where the line names no replica_groups. Mesh spelling: devices
    are the mesh's positions in row-major order, and a group is the devices that differ
    only along the axes the collective spans."""
    if match := _LISTED_GROUPS.search(line):
        return [tuple(int(d) for d in group.split(",") if d)
                for group in re.findall(r"\{([\d,]*)\}", match.group(1))]
    if match := _IOTA_GROUPS.search(line):
        groups, dims, perm = ([int(d) for d in text.split(",")] if text else None
                              for text in match.groups())
        devices = np.arange(math.prod(dims)).reshape(dims)
        if perm is not None:
            devices = devices.transpose(perm)
        return [tuple(map(int, group)) for group in devices.reshape(-1, groups[-1])]
    if match := _MESH_GROUPS.search(line):
        axes = [(name.strip().strip("'"), int(size))
                for name, size in (item.split("=") for item in match.group(1).split(","))]
        spanned = {name.strip().strip("'") for name in match.group(2).split(",")}
        # Device positions of the mesh, the spanned axes moved last: each row is a group.
        devices = np.arange(math.prod(size for _, size in axes)).reshape(
            [size for _, size in axes])
        order = ([i for i, (name, _) in enumerate(axes) if name not in spanned]
                 + [i for i, (name, _) in enumerate(axes) if name in spanned])
        size = math.prod(size for name, size in axes if name in spanned)
        return [tuple(map(int, group)) for group in devices.transpose(order).reshape(-1, size)]
    return None


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of an optimized HLO module (`jax.stages.Compiled.as_text()`)."""
    computations, entry = _computations(hlo_text)
    runs = _runs_per_call(computations, entry)
    found = []
    for name, lines in computations.items():
        for line in lines:
            match = _INSTRUCTION.search(line)
            if match:
                pairs, scope = _PAIRS.search(line), _OP_NAME.search(line)
                found.append(Collective(op=match.group("op"), shape=match.group("shape"),
                                        bytes=array_bytes(match.group("shape")),
                                        count=runs.get(name, 1),
                                        is_async=match.group("start") is not None,
                                        pairs=pairs.group(1).count("{") if pairs else 0,
                                        scope=scope.group(1) if scope else ""))
    return found


def bytes_per_call(hlo_text: str) -> int:
    """Bytes of all collectives' results in one call of the program."""
    return sum(c.bytes_per_call for c in collectives(hlo_text))


# ------------------------------------------------------------------ schedule and dependences

_DEFINITION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>\(.*?\)|\S+)\s+"
    r"(?P<op>[\w\-]+)\((?P<operands>[^)]*)\)")
_OPERAND = re.compile(r"%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of a computation: name, opcode, operand names, the JAX name stack
    it came from (`metadata.op_name`, where `jax.named_scope` names show), result shape."""

    name: str
    op: str
    operands: tuple[str, ...]
    scope: str
    shape: str = ""

    @property
    def bytes(self) -> int:
        return array_bytes(self.shape)


def scheduled_instructions(hlo_text: str) -> dict[str, list[Instruction]]:
    """Every computation's instructions in schedule order (optimized HLO is scheduled: the
    order of the text is the order they are issued in)."""
    out = {}
    for name, lines in _computations(hlo_text)[0].items():
        found = []
        for line in lines:
            match = _DEFINITION.match(line)
            if match:
                scope = _OP_NAME.search(line)
                found.append(Instruction(
                    name=match.group("name"), op=match.group("op"),
                    operands=tuple(_OPERAND.findall(match.group("operands"))),
                    scope=scope.group(1) if scope else "", shape=match.group("shape")))
        out[name] = found
    return out


def depends_on(instructions: list[Instruction], name: str, predicate) -> bool:
    """Whether instruction `name` of a computation needs (transitively, inside that
    computation) any instruction for which `predicate(instruction)` holds."""
    by_name = {i.name: i for i in instructions}
    pending, seen = list(by_name[name].operands), set()
    while pending:
        operand = pending.pop()
        if operand in seen or operand not in by_name:
            continue
        seen.add(operand)
        if predicate(by_name[operand]):
            return True
        pending.extend(by_name[operand].operands)
    return False


def async_pairs(instructions: list[Instruction], op: str = "collective-permute"
                ) -> list[tuple[Instruction, Instruction, list[Instruction]]]:
    """(start, done, what is scheduled between them) for each asynchronous `op` of one
    computation: what a device can run while the transfer is in flight."""
    position = {i.name: k for k, i in enumerate(instructions)}
    pairs = []
    for k, done in enumerate(instructions):
        if done.op == f"{op}-done" and done.operands and done.operands[0] in position:
            start_at = position[done.operands[0]]
            pairs.append((instructions[start_at], done, instructions[start_at + 1:k]))
    return pairs


# ------------------------------------------------------------------ copies of large arrays

# Instructions that rewrite their whole result: a re-layout (copy, transpose; copy-start on
# GPUs) or an update that XLA could not do in place (dynamic-update-slice of a buffer it
# copied first). A step that runs one of these over the KV cache moves the whole cache.
COPY_OPS = ("copy", "copy-start", "transpose", "dynamic-update-slice")


@dataclasses.dataclass(frozen=True)
class Copy:
    """One copying instruction: its kind, result shape text, bytes, runs per call and the
    computation it is in (a fusion's own computation when fused)."""

    op: str
    shape: str
    bytes: int
    count: int
    computation: str


def copies(hlo_text: str, min_bytes: int = 0) -> list[Copy]:
    """Every copy, transpose and dynamic-update-slice of an optimized HLO module whose
    result has at least `min_bytes` bytes, fused ones included."""
    computations, entry = _computations(hlo_text)
    runs = _runs_per_call(computations, entry)
    found = []
    for name, instructions in scheduled_instructions(hlo_text).items():
        for i in instructions:
            if i.op in COPY_OPS and i.bytes >= min_bytes:
                found.append(Copy(op=i.op, shape=i.shape, bytes=i.bytes,
                                  count=runs.get(name, 1), computation=name))
    return found
