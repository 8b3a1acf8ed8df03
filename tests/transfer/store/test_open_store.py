"""The store registry (``kvtier.transfer.store.open_store``): a bad store URL is a
``ConfigError`` naming the URL, before any connection is tried."""

from __future__ import annotations

import pytest

from kvtier.fsm import ConfigError
from kvtier.transfer.store import open_store


@pytest.mark.parametrize("url, says", [
    ("redis://127.0.0.1:99999", "Port out of range"),
    ("redis://[::1", "Invalid IPv6 URL"),
    ("redis://127.0.0.1:port", "Port could not be cast"),
    ("mooncake://[::1:50051", "Invalid IPv6 URL"),
])
def test_a_malformed_url_is_a_config_error_naming_it(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match="malformed store URL") as err:
        open_store(url)
    assert repr(url) in str(err.value) and says in str(err.value)


@pytest.mark.parametrize("url, says", [
    (123, "store URL must be a string"),
    ("ftp://127.0.0.1:21", "unknown store URL scheme 'ftp'"),
])
def test_a_url_that_is_not_a_store_is_refused(url: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        open_store(url)  # type: ignore[arg-type]
