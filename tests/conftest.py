"""Shared pytest setup: load kvtier's Hypothesis profile (HYPOTHESIS_PROFILE, else
kvtier-ci under CI, else kvtier-dev), and the fixtures that start a real store for the L3
tests (tests/store_servers.py): ``redis_server`` and ``mooncake_master``, one per test; every
lifecycle runs in the checked mode (each event fired through both the compiled table and the
``transitions`` machine, and compared)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from store_servers import MooncakeMaster, RedisServer, mooncake_binary

from kvtier.fsm.lifecycle.machines import set_checked
from kvtier.testing import load_profile

load_profile()
set_checked(True)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        if os.environ.get("CI") or os.environ.get("KVTIER_REQUIRE_REDIS"):
            pytest.fail("redis-server is not installed (scripts/test.sh installs it with apt-get)")
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    pytest.importorskip("redis")
    srv = RedisServer(binary)
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def mooncake_master() -> Iterator[MooncakeMaster]:
    srv = MooncakeMaster(mooncake_binary())
    try:
        yield srv
    finally:
        srv.stop()
