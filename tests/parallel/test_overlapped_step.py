"""OverlappedStepOptimizer: each stage steps as soon as its buckets are averaged; its state is the plain optimizer's.

Its training against single-process AdamW on two ranks, and its state dict after it, are in
test_parallel_containers.py (the ``*_overlapped_step`` runs)."""

import copy

import pytest
import torch

from lm_systems.parallel import DDPBucketed, NaiveDDP, OverlappedStepOptimizer
from lm_systems.parallel.runs import cut_into_runs
from parallel_workers import VOCAB, ToyNet


def one_step(model: DDPBucketed, optimizer: OverlappedStepOptimizer, seed: int) -> None:
    optimizer.zero_grad()
    tokens = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(seed))
    model(tokens, use_rank0_only=True).sum().backward()
    optimizer.step()


def test_each_stage_steps_once_its_last_bucket_is_averaged(single_rank_group):
    model = DDPBucketed(ToyNet(), bucket_size_mb=0.0005)  # 512 bytes: a bucket per parameter
    optimizer = OverlappedStepOptimizer(model.parameters(), model, torch.optim.AdamW, stages=2, lr=0.01)
    stage_of_unit = cut_into_runs([sum(p.numel() for p in unit) for unit in model.units], 2)
    assert len(model.units) > 2 and stage_of_unit[0] == 0 and stage_of_unit[-1] == 1
    events = []
    averaged_units = model.averaged_units

    def recorded():
        for unit in averaged_units():
            events.append(f"averaged {unit}")
            yield unit

    model.averaged_units = recorded
    for index, stage in enumerate(optimizer._stages):
        stage.register_step_post_hook(lambda *_, index=index: events.append(f"step {index}"))
    one_step(model, optimizer, seed=0)
    last_of_first = max(u for u, s in enumerate(stage_of_unit) if s == 0)
    expected = [f"averaged {u}" for u in range(last_of_first + 1)] + ["step 0"]
    expected += [f"averaged {u}" for u in range(last_of_first + 1, len(model.units))] + ["step 1"]
    assert events == expected


def test_load_state_dict_resumes_the_same_trajectory(single_rank_group):
    torch.manual_seed(0)
    model = DDPBucketed(ToyNet(), bucket_size_mb=0.002)
    optimizer = OverlappedStepOptimizer(model.parameters(), model, torch.optim.AdamW, stages=3, lr=0.05)
    one_step(model, optimizer, seed=1)
    saved_weights, saved_state = copy.deepcopy(model.module.state_dict()), copy.deepcopy(optimizer.state_dict())
    one_step(model, optimizer, seed=2)
    resumed = DDPBucketed(ToyNet(), bucket_size_mb=0.002)
    resumed.module.load_state_dict(saved_weights)
    resumed_optimizer = OverlappedStepOptimizer(resumed.parameters(), resumed, torch.optim.AdamW, stages=3, lr=0.05)
    resumed_optimizer.load_state_dict(saved_state)
    assert all(stage.state is resumed_optimizer.state for stage in resumed_optimizer._stages)
    one_step(resumed, resumed_optimizer, seed=2)
    for name, value in model.module.state_dict().items():
        torch.testing.assert_close(resumed.module.state_dict()[name], value, atol=0, rtol=0, msg=name)


def test_a_schedulers_learning_rate_reaches_every_stage(single_rank_group):
    model = DDPBucketed(ToyNet(), bucket_size_mb=0.002)
    optimizer = OverlappedStepOptimizer(model.parameters(), model, torch.optim.AdamW, stages=3, lr=0.05)
    torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    one_step(model, optimizer, seed=3)
    assert [group["lr"] for stage in optimizer._stages for group in stage.param_groups] == [0.025] * 3


def test_bad_arguments_are_refused(single_rank_group):
    model = DDPBucketed(ToyNet(), bucket_size_mb=0.002)
    with pytest.raises(ValueError, match="stages must be at least 1"):
        OverlappedStepOptimizer(model.parameters(), model, torch.optim.AdamW, stages=0)
    with pytest.raises(TypeError, match="averages during backward"):
        OverlappedStepOptimizer(model.parameters(), NaiveDDP(ToyNet()), torch.optim.AdamW)
