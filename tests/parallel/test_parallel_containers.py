"""NaiveDDP, PerParameterDDP and BucketedDDP on two gloo ranks against single-process training."""

import copy

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
        torch.testing.assert_close(
            actual[name], expected[name], atol=atol, rtol=1e-4, msg=lambda m, name=name: f"{name}: {m}"
        )


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


@pytest.mark.parametrize(
    "name", ["individual", "bucketed", "bucketed_keep_grads", "bucketed_bf16_comm", "bucketed_compiled_layer"]
)
def test_overlapping_containers_communicate_during_backward(runs, name):
    # Rank 0 uses every parameter but ``never_used``, whose unit comes last: all earlier units launch early.
    assert min(runs[0][name]["all_reduces_during_backward"]) > 0


@pytest.mark.parametrize("name", ["individual_launch_thread", "bucketed_launch_thread"])
def test_launch_thread_takes_the_all_reduces_off_the_backward_thread(runs, name):
    # Rank 0 (which uses every parameter but never_used) averages on the launch thread during backward;
    # the presence flags' all-reduce and never_used's late launch come from finish on the main thread.
    # (Rank 1 never uses rank0_only, so its units from there on all launch late, from the main thread.)
    assert runs[0][name]["launching_threads"] == ["MainThread", "lm_systems-launch"]
    assert runs[0]["bucketed"]["launching_threads"] == ["MainThread"]


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


def test_bucketed_averages_autograds_own_gradients_in_place(single_rank_group):
    """Each .grad after the synchronisation is the very tensor autograd accumulated (averaged in place, no
    bucket buffer copied into or out of), a parameter no backward reached stays None, and after
    zero_grad(set_to_none=True) the next step's gradients are new tensors: the container holds none."""
    from lm_systems.parallel import BucketedDDP

    model = BucketedDDP(ToyNet(), bucket_size_mb=0.002)
    trainable = {name: p for name, p in model.module.named_parameters() if p.requires_grad}
    assert len(model.buckets) > 1
    accumulated: dict[str, torch.Tensor] = {}
    for name, p in trainable.items():  # registered after the container's hooks: sees what it launched on
        p.register_post_accumulate_grad_hook(lambda p, name=name: accumulated.__setitem__(name, p.grad))
    seen = []
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        accumulated.clear()
        model(torch.randint(0, VOCAB, (2, 5)), use_rank0_only=True).sum().backward()
        model.finish_gradient_synchronization()
        assert trainable["never_used.weight"].grad is None
        grads = {name: p.grad for name, p in trainable.items() if not name.startswith("never_used")}
        assert accumulated.keys() == grads.keys()
        assert all(grads[name] is accumulated[name] for name in grads), "the gradient autograd made, averaged in place"
        seen.append({name: g.untyped_storage().data_ptr() for name, g in grads.items()})
    assert len(set(seen[0].values())) == len(seen[0]), "no shared flat buffer"


class _Switch(torch.nn.Module):
    """Uses ``b`` only when asked: a parameter that had a gradient last step and gets none this step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        return self.b(self.a(x)) if use_b else self.a(x)


@pytest.mark.parametrize("zero_grad_after_forward", [False, True])
def test_bucketed_matches_one_process_when_a_parameter_drops_out(single_rank_group, zero_grad_after_forward):
    """Lightning zeroes gradients after the forward, before backward: a parameter with a gradient in step 1
    and none in step 2 must end step 2 with grad None (AdamW then skips it), exactly as in one process."""
    from lm_systems.parallel import BucketedDDP

    torch.manual_seed(0)
    reference = _Switch()
    model = BucketedDDP(copy.deepcopy(reference), bucket_size_mb=1e-4)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (reference, model.module)]
    x = torch.randn(3, 4)
    for use_b in (True, False, False):
        for net, optimizer, finish in (
            (reference, optimizers[0], None),
            (model, optimizers[1], model.finish_gradient_synchronization),
        ):
            if not zero_grad_after_forward:
                optimizer.zero_grad(set_to_none=True)
            loss = net(x, use_b).square().sum()
            if zero_grad_after_forward:
                optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if finish:
                finish()
        assert (model.module.b.weight.grad is None) == (reference.b.weight.grad is None)
        for optimizer in optimizers:
            optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.module.state_dict()[name], value, msg=name)
