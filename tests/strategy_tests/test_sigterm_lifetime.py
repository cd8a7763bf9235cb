"""The SIGTERM agreement lets its gloo group go when closed, though the trainer keeps the agreement's handlers."""

from datetime import timedelta

import torch.distributed as dist
from group_threads import group_threads
from lightning.fabric.plugins.environments.lightning import find_free_network_port

from strategies.sigterm import HostSigtermAgreement

TIMEOUT = timedelta(seconds=60)


def test_a_closed_agreement_holds_no_group():
    before = group_threads()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{find_free_network_port()}", rank=0, world_size=1, timeout=TIMEOUT
    )
    try:
        agreement = HostSigtermAgreement(dist.new_group(backend="gloo", timeout=TIMEOUT))
        assert agreement.agree() is False
        agreement.close()
    finally:
        dist.destroy_process_group()
    left = group_threads() - before
    assert not left, f"threads of the destroyed groups still running while the agreement is kept: {dict(left)}"
