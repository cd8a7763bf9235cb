"""The copy-engine all-reduce's schedule, run by threads standing in for ranks over shared CPU buffers.

``average_in_place`` is the code the GPUs run; here each "rank" is a thread, its peers' buffers are plain
tensors and the barrier a ``threading.Barrier``, so the parts, inbox slots and barriers are checked against
a float64 mean without GPUs. The CUDA transport (symmetric memory) is tested in test_peer_copy_gpu.py.
"""

from __future__ import annotations

import threading

import pytest
import torch

from lm_systems.parallel import DDPBucketed
from lm_systems.parallel.peer_copy import GRADS, INBOX, average_in_place, inbox_slot, part_bounds, slot_numel


class ThreadPeerMemory:
    """Rank ``rank``'s view of buffers shared by threads."""

    def __init__(self, rank: int, world_size: int, buffers: dict, barrier: threading.Barrier) -> None:
        self.rank, self.world_size = rank, world_size
        self._buffers, self._barrier = buffers, barrier

    def buffer(self, rank: int, name: str, offset: int, numel: int) -> torch.Tensor:
        buffer = self._buffers[rank, name]
        assert 0 <= offset and offset + numel <= buffer.numel(), f"{name} of rank {rank} overrun"
        return buffer.narrow(0, offset, numel)

    def barrier(self) -> None:
        self._barrier.wait(timeout=30)


def run_ranks(world_size: int, grads: list[torch.Tensor], buckets: list[tuple[int, int]]) -> None:
    """Average every ``(offset, numel)`` bucket of ``grads`` in place, one thread per rank, buckets in order."""
    slot = slot_numel(max(numel for _, numel in buckets), world_size)
    buffers = {(r, GRADS): grads[r] for r in range(world_size)}
    # Stale values in the inboxes must never reach a result.
    buffers.update({(r, INBOX): torch.full((slot * (world_size - 1),), float("nan")) for r in range(world_size)})
    barrier = threading.Barrier(world_size)
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        memory = ThreadPeerMemory(rank, world_size, buffers, barrier)
        try:
            for offset, numel in buckets:
                average_in_place(memory, offset, numel, slot)
        except BaseException as error:  # noqa: BLE001 - re-raised below, on the test's thread
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_buckets_are_averaged_in_place_on_every_rank(world_size):
    # Odd sizes (parts differ by one element), buckets smaller than the world, and a gap left untouched.
    buckets = [(0, 11), (11, 1), (12, 2), (14, 97), (120, 5)]
    total = 130
    torch.manual_seed(world_size)
    grads = [torch.randn(total, dtype=torch.float32) for _ in range(world_size)]
    expected = torch.stack([g.double() for g in grads]).mean(0)
    gap = [g[111:120].clone() for g in grads]
    run_ranks(world_size, grads, buckets)
    for rank in range(world_size):
        for offset, numel in buckets:
            torch.testing.assert_close(grads[rank][offset:offset + numel].double(), expected[offset:offset + numel],
                                       atol=1e-6, rtol=1e-6)
            # Each part is reduced by one rank and copied to the others: replicas bitwise equal.
            assert torch.equal(grads[rank][offset:offset + numel], grads[0][offset:offset + numel])
        torch.testing.assert_close(grads[rank][111:120], gap[rank], atol=0, rtol=0)


def test_part_bounds_tile_the_bucket():
    for numel in (0, 1, 5, 64, 1001):
        for world_size in (1, 2, 3, 8):
            parts = part_bounds(numel, world_size)
            assert [start for start, _ in parts] == [sum(n for _, n in parts[:k]) for k in range(world_size)]
            assert sum(n for _, n in parts) == numel
            assert max(n for _, n in parts) - min(n for _, n in parts) <= 1
            assert max(n for _, n in parts) <= slot_numel(numel, world_size)


@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_every_sender_has_its_own_inbox_slot(world_size):
    for receiver in range(world_size):
        slots = [inbox_slot(sender, receiver, world_size) for sender in range(world_size) if sender != receiver]
        assert sorted(slots) == list(range(world_size - 1))


def test_copy_engine_needs_cuda_and_says_which_option_to_change(single_rank_group):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="allreduce='process_group'"):
        DDPBucketed(model, allreduce="copy_engine")
    with pytest.raises(ValueError, match="grad_comm_dtype"):
        DDPBucketed(model, allreduce="copy_engine", grad_comm_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="allreduce must be"):
        DDPBucketed(model, allreduce="nvlink")
