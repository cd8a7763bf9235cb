"""NaiveDDP, DDPIndividualParameters and DDPBucketed on two gloo ranks against single-process training."""

import pytest
import torch

from parallel_workers import CONTAINERS, TOLERANCE, VOCAB, ToyNet, run_containers

RUNS = [*CONTAINERS, "bucketed_keep_grads"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, spawn_two_ranks):
    """One spawn trains every container (process start-up dominates the cost); results per rank."""
    out = tmp_path_factory.mktemp("containers")
    spawn_two_ranks(run_containers, out)
    return [torch.load(out / f"containers_rank{r}.pt") for r in range(2)]


def assert_state_close(actual: dict, expected: dict, atol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", RUNS)
def test_ranks_start_different_and_the_broadcast_makes_them_equal(runs, name):
    rank0, rank1 = runs[0][name], runs[1][name]
    assert not torch.equal(rank0["before"]["hidden.weight"], rank1["before"]["hidden.weight"])
    assert not torch.equal(rank0["before"]["scale"], rank1["before"]["scale"])
    assert_state_close(rank1["initial"], rank0["initial"], atol=0)
    assert_state_close(rank0["initial"], rank0["before"], atol=0)


@pytest.mark.parametrize("name", RUNS)
def test_training_matches_single_process_on_the_global_batch(runs, name):
    """Tied, frozen, unused and rank-0-only parameters included; 2 micro-batches accumulated per step."""
    reference = runs[0][name]["reference"]
    for rank in range(2):
        assert_state_close(runs[rank][name]["final"], reference, atol=TOLERANCE.get(name, 1e-5))
    assert_state_close(runs[1][name]["final"], runs[0][name]["final"], atol=0)  # replicas identical
    assert torch.equal(runs[0][name]["final"]["frozen.weight"], runs[0][name]["initial"]["frozen.weight"])


@pytest.mark.parametrize("name", RUNS)
def test_gradient_presence_is_agreed_across_ranks(runs, name):
    for rank in range(2):
        assert runs[rank][name]["rank0_only_grad_is_none"] is False, "used on rank 0, so averaged everywhere"
        assert runs[rank][name]["never_used_grad_is_none"] is True, "unused everywhere: left None, like one process"


@pytest.mark.parametrize("name", RUNS)
def test_no_communication_inside_no_sync(runs, name):
    for rank in range(2):
        assert runs[rank][name]["no_sync_all_reduces"] == 0


@pytest.mark.parametrize("name", ["individual", "bucketed", "bucketed_keep_grads", "bucketed_bf16_comm"])
def test_overlapping_containers_communicate_during_backward(runs, name):
    # Rank 0 uses every parameter but ``never_used``, whose unit comes last: all earlier units launch early.
    assert min(runs[0][name]["all_reduces_during_backward"]) > 0


@pytest.mark.parametrize("name", ["naive", "naive_flat"])
def test_naive_containers_communicate_only_after_backward(runs, name):
    assert max(runs[0][name]["all_reduces_during_backward"]) == 0


@pytest.mark.parametrize("name", CONTAINERS)
def test_containers_stay_ordinary_modules(single_rank_group, name):
    """A wrapper's own bookkeeping must not shadow nn.Module internals (state_dict, buffers, attributes)."""
    model = ToyNet()
    wrapper = CONTAINERS[name](model)
    assert wrapper.state_dict().keys() == {f"module.{k}" for k in model.state_dict()}
    assert [b.data_ptr() for b in wrapper.buffers()] == [b.data_ptr() for b in model.buffers()]
    wrapper.require_backward_grad_sync = False
    assert "require_backward_grad_sync" not in wrapper._buffers


def test_bf16_gradient_communication_sends_bf16(runs):
    """The bf16 run is not the fp32 one in disguise: its weights differ, by bf16 rounding of the means only."""
    bf16, fp32 = runs[0]["bucketed_bf16_comm"]["final"], runs[0]["bucketed"]["final"]
    largest = max((bf16[name] - fp32[name]).abs().max().item() for name in fp32)
    assert 0 < largest < TOLERANCE["bucketed_bf16_comm"]


def test_bucketed_gradients_live_in_the_buckets(single_rank_group):
    """After zero_grad(set_to_none=True), the next forward points each .grad at its bucket view, so backward
    accumulates in place and the mean needs no copy out; a parameter no backward reached goes back to None."""
    from lm_systems.parallel import DDPBucketed

    model = DDPBucketed(ToyNet(), bucket_size_mb=0.002)
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        loss = model(torch.randint(0, VOCAB, (2, 5)), use_rank0_only=True).sum()
        views = {id(p): p.grad for p in model.module.parameters() if p.requires_grad}
        assert all(v is not None for v in views.values())
        loss.backward()
        model.finish_gradient_synchronization()
        for name, p in model.module.named_parameters():
            if not p.requires_grad:
                continue
            if name.startswith("never_used"):
                assert p.grad is None
            else:
                assert p.grad is views[id(p)], name
