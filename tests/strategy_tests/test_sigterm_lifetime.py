"""The SIGTERM agreement lets its gloo group go when closed, though the trainer keeps the agreement's handlers."""

import signal
from datetime import timedelta

import pytest
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


def test_a_ctrl_c_after_sigterm_goes_to_the_previous_handler_and_the_ranks_still_stop_on_sigterm():
    """A second signal hands Ctrl-C to the handler that was there before; if that one returns (a handler that only
    notes the signal), the SIGTERM already received still decides: the agreement stops the run as SIGTERM (crash
    checkpoint on every rank), not as a Ctrl-C."""
    original = signal.getsignal(signal.SIGINT)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{find_free_network_port()}", rank=0, world_size=1, timeout=TIMEOUT
    )
    try:
        agreement = HostSigtermAgreement(dist.new_group(backend="gloo", timeout=TIMEOUT))
        noted = []
        agreement._previous_sigint = lambda signum, frame: noted.append(signum)
        agreement.notify(signal.SIGTERM, None)
        agreement.interrupt(signal.SIGINT, None)
        assert noted == [signal.SIGINT]
        try:
            stopped = agreement.agree()
        except KeyboardInterrupt:
            pytest.fail("the SIGTERM was downgraded to a Ctrl-C")
        assert stopped is True
        agreement.close()
    finally:
        dist.destroy_process_group()
        signal.signal(signal.SIGINT, original)
