"""Staleness gate under asyncio with a fake learner as the version source."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from megatron_darl.rollout.staleness import StalenessGate

B = 4


def _reference_capacity(eta: int, version: int, batch: int, accepted: int, running: int) -> int:
    return max(0, (eta + version + 1) * batch - (accepted + running))


def test_capacity_is_the_areal_formula():
    for eta, version, accepted, running in itertools.product([0, 1, 4], [0, 3], [0, 5, 17], [0, 2, 9]):
        gate = StalenessGate(eta, B, version=version)
        gate.accepted, gate.running = accepted, running
        assert gate.capacity() == _reference_capacity(eta, version, B, accepted, running)


async def _run(eta: int, versions: int, learner_waits: bool) -> tuple[StalenessGate, dict[int, int], list[str]]:
    """Workers generate as fast as the gate lets them; a fake learner consumes one batch per
    version. Returns the gate, admissions per version, and any violations seen."""
    gate = StalenessGate(eta, B)
    admitted: dict[int, int] = {}
    violations: list[str] = []
    done = asyncio.Event()

    async def worker():
        while not done.is_set():
            try:
                await gate.aacquire(timeout=0.05)
            except TimeoutError:
                continue
            admitted[gate.version] = admitted.get(gate.version, 0) + 1
            if gate.accepted + gate.running > (eta + gate.version + 1) * B:
                violations.append(f"v={gate.version} accepted={gate.accepted} running={gate.running}")
            await asyncio.sleep(0)  # generating
            gate.release(accepted=True)

    workers = [asyncio.create_task(worker()) for _ in range(3 * B)]
    for v in range(versions):
        while gate.accepted < (v + 1 + (eta if not learner_waits else 0)) * B or gate.running:
            await asyncio.sleep(0.001)
        for _ in range(20):  # let the workers try to get past the bound
            await asyncio.sleep(0)
        gate.on_version(v + 1)  # the learner consumed a batch and published a new version
    for _ in range(20):
        await asyncio.sleep(0)
    done.set()
    await asyncio.gather(*workers)
    return gate, admitted, violations


def test_eta_zero_admits_exactly_one_batch_per_version():
    gate, admitted, violations = asyncio.run(_run(eta=0, versions=5, learner_waits=True))
    assert not violations
    assert admitted == {v: B for v in range(6)}  # version 5 too: its batch fills before the end


def test_eta_four_admits_at_most_five_batches_ahead():
    async def scenario():
        gate = StalenessGate(4, B)
        started = 0
        while gate.try_acquire():
            started += 1
        assert started == 5 * B  # exactly five batches ahead of a learner at version 0
        with pytest.raises(TimeoutError, match="no admission"):
            await gate.aacquire(timeout=0.02)
        for _ in range(started):
            gate.release(accepted=True)
        assert gate.capacity() == 0
        waiter = asyncio.create_task(gate.aacquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        gate.on_version(1)  # one batch consumed: exactly one more batch may start
        await asyncio.wait_for(waiter, 1)
        assert gate.capacity() == B - 1

    asyncio.run(scenario())
    gate, admitted, violations = asyncio.run(_run(eta=4, versions=4, learner_waits=False))
    assert not violations
    assert admitted[0] == 5 * B and all(admitted[v] == B for v in range(1, 5))


def test_rejected_generation_frees_its_place_and_wakes_a_waiter():
    async def scenario():
        gate = StalenessGate(0, 1)
        await gate.aacquire()
        waiter = asyncio.create_task(gate.aacquire())
        await asyncio.sleep(0.01)
        assert not waiter.done()
        gate.release(accepted=False)
        await asyncio.wait_for(waiter, 1)
        assert gate.running == 1 and gate.rejected == 1

    asyncio.run(scenario())
    with pytest.raises(RuntimeError, match="without acquire"):
        StalenessGate(0, 1).release(True)


def test_state_round_trip_and_resume():
    gate = StalenessGate(2, B)
    for _ in range(3 * B):
        assert gate.try_acquire()
    for _ in range(3 * B):
        gate.release(True)
    gate.on_version(1)
    restored = StalenessGate(2, B)
    restored.load_state_dict(gate.state_dict())
    assert (restored.version, restored.accepted, restored.running) == (1, 3 * B, 0)
    assert restored.capacity() == gate.capacity() == (2 + 1 + 1) * B - 3 * B
    lossy = StalenessGate(2, B)
    lossy.load_state_dict(gate.state_dict(), lost_accepted=B)  # one batch was only in the ring
    assert lossy.accepted == 2 * B and lossy.capacity() == 2 * B
    gate.on_version(0)  # stale notifications are ignored
    assert gate.version == 1
    with pytest.raises(ValueError, match="max_head_offpolicyness"):
        StalenessGate(-1, B)
