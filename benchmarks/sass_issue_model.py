"""Cycles per iteration of a kernel's loop, predicted from its sm_90 SASS without a GPU.

A single warp issues in order, one instruction a cycle at most: each instruction issues
when the one before it has and its source registers are ready, and its result is ready a
fixed latency later. That is the regime of a latency-bound scan with one warp per program
(`kernels/triton/osdn.py`): its time per step is either its chain of dependent
instructions or its instruction count, whichever the schedule makes dominant, and this
model sees both. Inside the loop a forward branch is taken (the fast path skips
out-of-line work; `--fallthrough` takes none), a `BRA.DIV` (divergence check) is not.

    ARCHSPEC_DUMP=/tmp/sass python -m archspec.kernels.triton.compile_report osdn   # writes *.sass
    python benchmarks/sass_issue_model.py /tmp/sass/osdn_forward_kernel.sass --steps 8 [--list] [--loop N]

Latencies (cycles): `LDG` 750, `SHFL` 32, `MUFU` 16, the rest 4 (session 3's calibration
on the first AHEAD form of the OSDN scan: 803 and 1341 cycles per step predicted against
the ~800 and ~1400 measured on the H200). The current sequential OSDN forward (AHEAD,
STATS, PREFETCH 8) models at 263 cycles per step against 380 measured (0.79 ms for 4,096
steps at ~1.98 GHz): the model leaves out the load/store unit's own throughput, so it
ranks schedules rather than timing them.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path

LATENCY = {"LDG": 750, "SHFL": 32, "MUFU": 16, "S2R": 20, "LDS": 30, "F2F": 6, "F2FP": 6, "I2F": 6, "F2I": 6}
DEFAULT_LATENCY = 4
CONTROL = {"BRA", "EXIT", "NOP", "BSYNC", "BSSY", "WARPSYNC", "YIELD", "DEPBAR", "BAR"}
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_.]+)\s*(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


def _registers(text: str) -> list[str]:
    return re.findall(r"\b(U?R\d+|U?P\d+)\b", text)


@dataclass
class Instruction:
    opcode: str  # with its modifiers, e.g. "SHFL.BFLY"
    writes: list[str] = field(default_factory=list)
    reads: list[str] = field(default_factory=list)
    target: str | None = None  # a branch's label
    text: str = ""

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def parse(lines: list[str]) -> tuple[list[Instruction], dict[str, int]]:
    """The instructions of SASS lines (`nvdisasm -c`) and where each label points."""
    out: list[Instruction] = []
    labels: dict[str, int] = {}
    for line in lines:
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(out)
            continue
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        guard, opcode, rest = m.group(1) or "", m.group(2), m.group(3)
        ins = Instruction(opcode, text=line.strip())
        base = ins.base
        operands = [t.strip() for t in rest.split(",")]
        if base in CONTROL:
            target = _TARGET.search(rest)
            ins.target = target.group(1) if target else None
        elif base.startswith("ST") or base in ("RED", "ATOM"):
            ins.reads = _registers(rest)
        elif base == "SHFL":  # SHFL.BFLY PT, Rd, Ra, ...: the predicate out first
            ins.writes, ins.reads = _registers(operands[1]), [r for t in operands[2:] for r in _registers(t)]
        else:
            ins.writes = _registers(operands[0]) if operands else []
            first_read = 1
            if base in ("FSETP", "ISETP", "DSETP") and len(operands) > 1:  # two predicates out
                ins.writes += _registers(operands[1])
                first_read = 2
            ins.reads = [r for t in operands[first_read:] for r in _registers(t)]
            width = 4 if ".128" in opcode else 2 if (".64" in opcode or ".WIDE" in opcode) else 1
            if width > 1 and ins.writes and ins.writes[0].startswith("R"):
                first = int(ins.writes[0][1:])
                ins.writes = [f"R{first + i}" for i in range(width)]
        ins.reads += _registers(guard)
        out.append(ins)
    return out, labels


def loops(instructions: list[Instruction], labels: dict[str, int]) -> list[tuple[int, int]]:
    """`(first, last)` instruction indices of every backward branch's body, in file order."""
    found = []
    for i, ins in enumerate(instructions):
        if ins.base == "BRA" and "DIV" not in ins.opcode and ins.target in labels and labels[ins.target] <= i:
            found.append((labels[ins.target], i))
    return found


@dataclass
class Prediction:
    cycles: int  # per iteration, in the steady state
    issued: int  # instructions issued per iteration (a taken branch skips the rest)
    stalls: list[tuple[int, str]]  # (cycles waited, instruction) of the last iteration, largest first


def simulate(body: list[Instruction], labels: dict[str, int], offset: int = 0, iterations: int = 8,
             fallthrough: bool = False) -> Prediction:
    """Run the loop body `iterations` times on the in-order model; the last iteration's
    cycles are the steady state (loop-carried registers and loads from earlier ones)."""
    ready: dict[str, int] = {}
    t = 0
    start = issued = 0
    stalls: list[tuple[int, str]] = []
    for it in range(iterations):
        last = it == iterations - 1
        start, k = t, 0
        while k < len(body):
            ins = body[k]
            at = max([t] + [ready.get(r, 0) for r in ins.reads])
            if last:
                issued += 1
                if at > t:
                    stalls.append((at - t, ins.text))
            t = at + 1
            jump = labels.get(ins.target or "", -1) - offset
            if not fallthrough and ins.base == "BRA" and "DIV" not in ins.opcode and k < jump <= len(body):
                k = jump
                continue
            for r in ins.writes:
                ready[r] = at + LATENCY.get(ins.base, DEFAULT_LATENCY)
            k += 1
    return Prediction(t - start, issued, sorted(stalls, reverse=True))


def main(argv: list[str] | None = None) -> list[Prediction]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sass", help="a .sass file (compile_report with ARCHSPEC_DUMP)")
    parser.add_argument("--steps", type=int, default=1, help="steps per loop iteration (the unroll factor)")
    parser.add_argument("--loop", type=int, default=0, help="which backward branch's body (see --list)")
    parser.add_argument("--list", action="store_true", help="every loop body found")
    parser.add_argument("--fallthrough", action="store_true", help="take no forward branch (the slow paths run)")
    parser.add_argument("--stalls", type=int, default=8, help="the largest waits to print")
    args = parser.parse_args(argv)
    instructions, labels = parse(Path(args.sass).read_text().splitlines())
    bodies = loops(instructions, labels)
    if not bodies:
        parser.error(f"{args.sass}: no loop (no backward branch)")
    predictions = []
    for n, (first, last) in enumerate(bodies):
        if not args.list and n != args.loop:
            continue
        p = simulate(instructions[first:last + 1], labels, offset=first, fallthrough=args.fallthrough)
        predictions.append(p)
        print(f"loop {n}: instructions {first}-{last}, {p.issued} issued, {p.cycles} cycles per iteration; "
              f"per step ({args.steps} an iteration): {p.cycles / args.steps:.0f} cycles, {p.issued / args.steps:.0f} instructions")
        if not args.list:
            for wait, text in p.stalls[:args.stalls]:
                print(f"  waits {wait:4d}: {text}")
    return predictions


if __name__ == "__main__":
    main()
