"""hopper.partition_exit's PTX rewrite on a dispatcher loop of the shape Triton 3.6 lowers ``warp_specialize`` to.

The PTX below is cut down from the compiled two-warpgroup dQ kernel (benchmarks/attention_hopper_compile.py prints
what ptxas makes of the real ones): the default warps branch to their code, the worker warps to the loop's preheader
and on into the dispatcher loop, whose blocks return to its head after a partition (one falls through into it).
The expected output is written out by hand.
"""

import sys

import pytest

if sys.platform != "linux":  # triton is a dependency on Linux only
    pytest.skip("triton is installed on Linux only", allow_module_level=True)

from lm_systems.attention.hopper.partition_exit import EXIT_LABEL, exit_after_partition  # noqa: E402

DISPATCHER_PTX = """\
.visible .entry kernel(
)
.reqntid 384
.maxnreg 168
{
\tsetp.lt.u32 \t%p1, %r2, 4;
\t@%p1 bra \t$L__BB0_9;
\tbra.uni \t$L__BB0_1;
$L__BB0_9:
\tsetmaxnreg.inc.sync.aligned.u32 \t256;
\tbarrier.sync \t1;
$L__BB0_8:                              // %common.ret
\tret;
$L__BB0_1:                              // %.preheader.preheader
\tmov.u32 \t%r3, %tid.x;
\tbra.uni \t$L__BB0_2;
$L__BB0_5:                              //   in Loop: Header=BB0_2 Depth=1
\tsetmaxnreg.dec.sync.aligned.u32 \t24;
\tbarrier.sync \t1;
\tsetmaxnreg.inc.sync.aligned.u32 \t120;
$L__BB0_2:                              // %.preheader
                                        // =>This Loop Header: Depth=1
                                        //     Child Loop BB0_7 Depth 2
\tsetmaxnreg.dec.sync.aligned.u32 \t120;
\tbarrier.sync \t1;
\tld.shared.b8 \t%r11, [%r13+32908];
\tsetp.gt.u32 \t%p2, %r11, 3;
\t@%p2 bra \t$L__BB0_4;
// %bb.3:                               // %.preheader
                                        //   in Loop: Header=BB0_2 Depth=1
\t$L_brx_0: .branchtargets
\t\t$L__BB0_6,
\t\t$L__BB0_5,
\t\t$L__BB0_8;
\tbrx.idx \t%r11, $L_brx_0;
$L__BB0_6:                              //   in Loop: Header=BB0_2 Depth=1
\tsetmaxnreg.inc.sync.aligned.u32 \t240;
$L__BB0_7:                              //   Parent Loop BB0_2 Depth=1
                                        // =>  This Inner Loop Header: Depth=2
\t@%p3 bra \t$L__BB0_7;
// %bb.10:                              //   in Loop: Header=BB0_2 Depth=1
\t@%p4 bra \t$L__BB0_2;
\tbarrier.sync \t1;
\tsetmaxnreg.dec.sync.aligned.u32 \t120;
\tbra.uni \t$L__BB0_2;
$L__BB0_4:                              //   in Loop: Header=BB0_2 Depth=1
\tbarrier.sync \t1;
\tbarrier.sync \t1;
\tbra.uni \t$L__BB0_2;
$L__tmp5:
$L__func_end0:
                                        // -- End function
}
"""


def _rewritten_lines() -> list[str]:
    return exit_after_partition(DISPATCHER_PTX).split("\n")


def test_the_branch_into_the_dispatcher_stays():
    lines = _rewritten_lines()
    preheader = lines.index("$L__BB0_1:                              // %.preheader.preheader")
    assert lines[preheader + 2] == "\tbra.uni \t$L__BB0_2;"


def test_every_branch_back_from_the_loop_goes_to_the_exit_instead():
    lines = _rewritten_lines()
    assert [line for line in lines if "$L__BB0_2;" in line] == ["\tbra.uni \t$L__BB0_2;"]  # only the preheader's
    assert "\t@%p4 bra \t$L__partition_exit;" in lines  # a conditional one keeps its predicate
    assert lines.count(f"\tbra.uni \t{EXIT_LABEL};") == 3  # two unconditional, one added for the fall-through


def test_a_block_falling_through_into_the_loop_head_branches_to_the_exit():
    lines = _rewritten_lines()
    head = next(i for i, line in enumerate(lines) if line.startswith("$L__BB0_2:"))
    assert lines[head - 2 : head] == ["\tsetmaxnreg.inc.sync.aligned.u32 \t120;", f"\tbra.uni \t{EXIT_LABEL};"]


def test_the_exit_waits_at_the_dispatcher_barrier_and_returns_inside_the_function():
    lines = _rewritten_lines()
    exit_block = lines.index(f"{EXIT_LABEL}:")
    assert lines[exit_block : exit_block + 4] == [f"{EXIT_LABEL}:", "\tbarrier.sync \t1;", "\tret;", "$L__func_end0:"]


def test_other_blocks_are_left_alone():
    before, after = DISPATCHER_PTX.split("\n"), _rewritten_lines()
    changed = [line for line in before if line not in after]
    assert changed == ["\t@%p4 bra \t$L__BB0_2;"]  # the unconditional back branches are textually the entry's
    assert "\t@%p3 bra \t$L__BB0_7;" in after  # the partition's own loop


@pytest.mark.parametrize(
    "ptx,message",
    [
        (DISPATCHER_PTX.replace("\tbrx.idx \t%r11, $L_brx_0;\n", ""), "found 0"),
        (DISPATCHER_PTX.replace("\tbrx.idx", "\tbrx.idx \t%r12, $L_brx_0;\n\tbrx.idx"), "found 2"),
        (DISPATCHER_PTX.replace("$L__func_end0:\n", ""), "function ends"),
    ],
)
def test_ptx_of_another_shape_is_refused(ptx, message):
    with pytest.raises(ValueError, match=message):
        exit_after_partition(ptx)
