"""Worker partitions that exit when done: a PTX rewrite that keeps ptxas from serialising their wgmma (Triton 3.6).

Triton lowers ``gl.warp_specialize`` to a dispatcher loop for the worker warps: they wait at a barrier, read their
partition's number from shared memory, branch to its code (which raises or lowers their registers with
``setmaxnreg``), and when it is done branch back to wait for the next ``warp_specialize`` of the kernel or the exit.
With a ``setmaxnreg.dec`` inside that loop (the producer warp's, the loop's own idle count) ptxas allocates every
partition in the loop at about 120 registers, whatever ``setmaxnreg.inc`` the partition asks for, and serialises
every wgmma there ("C7512 ... insufficient register resources", docs/attention.md, "Hopper kernels in Gluon"). The
same code without the branch back is allocated what it needs.

A kernel that enters one ``warp_specialize`` once never uses the branch back for more than the exit: the worker waits
at the loop's barrier for the exit the default warps signal at the kernel's end, reads it and returns. The rewrite
sends the workers there directly: every branch from inside the loop to its head becomes a branch to a new block that
waits at the same barrier and returns. Apply it only to such kernels (one ``warp_specialize``, not in a loop):
``exit_partitions_of(name, ...)`` rewrites the PTX of the kernels of those names as Triton compiles them, through
Triton's stages hook. Triton's compile cache does not key on the hook: a kernel so named must never be compiled
without it (register the names where the kernels are defined).
"""

from __future__ import annotations

import hashlib
import re

from triton import knobs

EXIT_LABEL = "$L__partition_exit"
SWITCH_LOOP_BARRIER = "barrier.sync \t1;"  # the all-warps barrier Triton's dispatcher waits at (barrier 1)
_BLOCK_START = re.compile(r"^(?:(\$L__BB\d+_\d+):|// %bb\.\d+:)(.*)$")


def _blocks(lines: list[str]) -> list[tuple[int, int, str]]:
    """(first line, end line, annotation) of each basic block the PTX prints: a block starts at a label or at
    LLVM's ``// %bb.N:`` comment; its annotation is that line and the comment lines right after it, where LLVM
    names the loops the block is in (``=>This Loop Header: Depth=1``, ``in Loop: Header=BB0_2 Depth=1``)."""
    starts = [i for i, line in enumerate(lines) if _BLOCK_START.match(line.strip())]
    blocks = []
    for first, end in zip(starts, starts[1:] + [len(lines)], strict=True):
        annotation = [lines[first]]
        for line in lines[first + 1 : end]:
            if not line.strip().startswith("//"):
                break
            annotation.append(line)
        blocks.append((first, end, " ".join(annotation)))
    return blocks


def exit_after_partition(ptx: str) -> str:
    """The PTX with every branch back to the dispatcher loop's head replaced by a wait for the exit and a return.

    Raises ValueError where the PTX does not have the shape this was written against (one dispatcher, in a loop),
    so that a Triton whose lowering differs fails loudly rather than running a kernel rewritten wrongly."""
    lines = ptx.split("\n")
    dispatches = [i for i, line in enumerate(lines) if "brx.idx" in line]
    if len(dispatches) != 1:
        raise ValueError(f"expected one warp_specialize dispatcher (brx.idx) in the PTX, found {len(dispatches)}")
    blocks = _blocks(lines)
    holder = next(b for b in reversed(blocks) if b[0] < dispatches[0])
    loop = re.search(r"(?:in Loop: Header=(BB\d+_\d+) Depth=1)", holder[2])
    head = loop.group(1) if loop else _BLOCK_START.match(lines[holder[0]].strip()).group(1).removeprefix("$L__")
    if f"$L__{head}:" not in ptx or "=>This Loop Header: Depth=1" not in _annotation_of(blocks, lines, head):
        raise ValueError("the warp_specialize dispatcher is not in a top-level loop of the PTX")
    branch_back = re.compile(rf"^(\s*(?:@!?%p\d+\s+)?bra(?:\.uni)?\s+)\$L__{head};(.*)$")
    rewritten = 0
    for first, end, annotation in blocks:
        if "in Loop:" not in annotation and "=>This Loop Header" not in annotation:
            continue  # outside every loop: the branch into the dispatcher, which stays
        for i in range(first, end):
            match = branch_back.match(lines[i])
            if match:
                lines[i] = f"{match.group(1)}{EXIT_LABEL};{match.group(2)}"
                rewritten += 1
        if end < len(lines) and lines[end].startswith(f"$L__{head}:") and not _ends_block(lines[first:end]):
            lines[end - 1] += f"\n\tbra.uni \t{EXIT_LABEL};"  # an in-loop block falling through into the head
            rewritten += 1
    if rewritten == 0:
        raise ValueError(f"no branch back to the dispatcher loop's head {head} in the PTX")
    ends = [i for i, line in enumerate(lines) if re.match(r"\$L__func_end\d+:", line)]
    if len(ends) != 1:
        raise ValueError(f"expected one kernel in the PTX, found {len(ends)} function ends")
    end = ends[0]
    lines[end:end] = [f"{EXIT_LABEL}:", f"\t{SWITCH_LOOP_BARRIER}", "\tret;"]
    return "\n".join(lines)


def _annotation_of(blocks: list[tuple[int, int, str]], lines: list[str], head: str) -> str:
    return next(annotation for first, _, annotation in blocks if lines[first].startswith(f"$L__{head}:"))


def _ends_block(block: list[str]) -> bool:
    """Whether a block's last instruction leaves it unconditionally (no fall-through into the next block)."""
    for line in reversed(block):
        text = line.strip()
        if text and not text.startswith("//") and not text.startswith(".loc"):
            return text.startswith("bra.uni") or text.startswith("ret;")
    return False


_KERNELS: set[str] = set()
_previous_hook = None


def exit_partitions_of(*kernel_names: str) -> None:
    """Rewrite the PTX of the kernels of these names with ``exit_after_partition`` whenever Triton compiles them
    (other kernels pass through, and a stages hook installed before this one still runs)."""
    global _previous_hook
    _KERNELS.update(kernel_names)
    if knobs.runtime.add_stages_inspection_hook is not _rewrite_ptx_stage:
        _previous_hook = knobs.runtime.add_stages_inspection_hook
        knobs.runtime.add_stages_inspection_hook = _rewrite_ptx_stage


def _rewrite_ptx_stage(*args):
    """Triton's stages hook: ``(backend, stages, options, language, capability)``; Triton 3.9 also calls it without
    arguments for its part of the compile cache's key (``(key, hash)``)."""
    if not args:
        key = "lm_systems partition_exit:" + ",".join(sorted(_KERNELS))
        if _previous_hook is not None:
            key += _previous_hook()[0]
        return key, hashlib.sha256(key.encode()).hexdigest()
    if _previous_hook is not None:
        _previous_hook(*args)
    stages = args[1]
    if "ptx" not in stages:
        return
    make_ptx = stages["ptx"]

    def ptx_stage(src, metadata):
        ptx = make_ptx(src, metadata)
        return exit_after_partition(ptx) if metadata.get("name") in _KERNELS else ptx

    stages["ptx"] = ptx_stage
