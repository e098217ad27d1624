"""Fixtures of the channel tests: `ring_name`, a fresh shared-memory segment name, removed after."""

import os
import uuid

import pytest

from megatron_darl.channel.shm_ring import segment_path


@pytest.fixture
def ring_name():
    name = f"darl-test-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass
