"""`benchmarks/sass_issue_model.py` on SASS whose timing is worked out by hand."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

# loaded from its file: benchmarks/ on sys.path would shadow the repository's `kernels`
_SPEC = importlib.util.spec_from_file_location(
    "sass_issue_model", Path(__file__).resolve().parents[2] / "benchmarks" / "sass_issue_model.py")
model = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = model  # dataclasses look their module up while the class is made
_SPEC.loader.exec_module(model)

LOOP = """\
.L_x_0:
        /*0000*/                   SHFL.BFLY PT, R1, R0, 0x1, 0x1f ;
        /*0010*/                   FADD R0, R0, R1 ;
        /*0020*/                   FMUL R2, R3, R3 ;
        /*0030*/               @P0 BRA `(.L_x_1) ;
        /*0040*/                   FADD R5, R5, R5 ;
.L_x_1:
        /*0050*/                   BRA `(.L_x_0) ;
"""


def test_a_shuffle_chain_sets_the_iteration_and_the_fast_path_skips_its_branch(tmp_path: Path) -> None:
    # SHFL at t, its FADD at t + 32 (the shuffle's latency), FMUL, the taken branch and the
    # loop's branch issue one a cycle; the next SHFL waits for R0 until t + 32 + 4
    path = tmp_path / "k.sass"
    path.write_text(LOOP)
    (fast,) = model.main([str(path)])
    assert (fast.cycles, fast.issued) == (36, 5)
    assert fast.stalls[0] == (31, "/*0010*/                   FADD R0, R0, R1 ;")
    # taking no branch: the skipped FADD issues too, and the loop's branch comes a cycle later
    (slow,) = model.main([str(path), "--fallthrough"])
    assert (slow.cycles, slow.issued) == (37, 6)


def test_operands_that_write_two_predicates_or_several_registers() -> None:
    (setp, load), _ = model.parse([
        "        /*0000*/                   FSETP.GT.AND P5, P1, |R29|, 8.5e+37, PT ;",
        "        /*0010*/              @!P2 LDG.E.128 R8, desc[UR18][R4.64] ;",
    ])
    assert setp.writes == ["P5", "P1"] and setp.reads == ["R29"]
    assert load.writes == ["R8", "R9", "R10", "R11"] and set(load.reads) == {"UR18", "R4", "P2"}
