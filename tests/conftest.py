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
