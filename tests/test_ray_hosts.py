"""serving.ray_hosts without Ray: what a host actor does with its process (start it, relay
its output, report its exit). Through Ray, with a real replica: tests/test_ray_cluster.py."""

import time

from serving.ray_hosts import HostActor


def _wait_exit(actor: HostActor, timeout_s: float = 30.0) -> int:
    deadline = time.monotonic() + timeout_s
    while actor.poll() is None:
        assert time.monotonic() < deadline, "the process did not exit"
        time.sleep(0.05)
    return actor.poll()


def test_a_host_actor_relays_its_process_output_once_and_its_exit_code():
    actor = HostActor()
    assert actor.poll() is None                      # nothing started yet
    code = ("import os, sys; print('out', os.environ['MEDHA_PROCESS_ID']); "
            "print('err', file=sys.stderr); sys.exit(75)")
    actor.start(["-c", code], {"MEDHA_PROCESS_ID": "1"})
    assert _wait_exit(actor) == 75
    deadline = time.monotonic() + 10                 # the reader threads may trail the exit
    while len(actor.read(0)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sorted(actor.read(0)) == [("stderr", "err\n"), ("stdout", "out 1\n")]
    assert actor.read(2) == []                      # read lines are dropped, not re-sent
    assert actor.read(0) == []


def test_a_host_actor_signals_its_process():
    actor = HostActor()
    actor.start(["-c", "import time; time.sleep(60)"], {})
    actor.send_signal(15)
    assert _wait_exit(actor) == -15
    actor.send_signal(15)                            # already gone: nothing to do
    assert actor.poll() == -15
