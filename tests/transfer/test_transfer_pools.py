"""HostPool / DevicePool: layout, pinning fallback, memory check, registration."""

from __future__ import annotations

import pytest
import torch

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError
from kvtier.transfer import DevicePool, HostMemoryError, HostPool, pages_for_budget
from kvtier.transfer.pools import REGION_ALIGN


def _specs() -> list[CacheGroupSpec]:
    return [
        CacheGroupSpec("kv", "history", 4, 1, (0, 1, 2), (ComponentSpec("k", 48), ComponentSpec("ix", 37))),
        CacheGroupSpec("swa", "state", 2, 1, (1, 2), (ComponentSpec("s", 64),), window=4),
    ]


def test_host_pool_layout_is_layer_first_and_aligned() -> None:
    pool = HostPool(_specs(), {"kv": 5, "swa": 3})
    assert pool.pages("kv") == 5 and pool.pages("swa") == 3
    keys = list(pool.keys())
    assert keys == [("kv", "k", 0), ("kv", "ix", 0), ("kv", "k", 1), ("kv", "ix", 1), ("kv", "k", 2),
                    ("kv", "ix", 2), ("swa", "s", 1), ("swa", "s", 2)]
    assert pool.region("kv", "ix", 1).shape == (5, 37)
    assert pool.region("swa", "s", 2).dtype == torch.uint8
    offs = [pool.region_offset(*k) for k in keys]
    assert offs == sorted(offs) and all(o % REGION_ALIGN == 0 for o in offs)
    assert pool.nbytes == 3 * 5 * (48 + 37) + 2 * 3 * 64
    # regions do not overlap and live in the pool's one buffer
    buf = pool.single_buffer()
    assert buf is not None and buf.data_ptr() == pool.base_ptr
    for k in keys:
        r = pool.region(*k)
        assert r.data_ptr() - pool.base_ptr == pool.region_offset(*k)
        assert pool.region_offset(*k) + r.numel() <= pool.span_bytes


def test_host_pool_pins_only_with_cuda() -> None:
    pool = HostPool(_specs(), 2)
    assert pool.pinned == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"HostPool\(pin=True\) needs CUDA"):
            HostPool(_specs(), 2, pin=True)


def test_host_pool_checks_available_memory() -> None:
    with pytest.raises(HostMemoryError) as e:
        HostPool(_specs(), 1000, available_bytes=50_000, reserve_bytes=10_000)
    assert e.value.available == 40_000
    assert e.value.needed > 40_000
    assert "only 50000 bytes" in str(e.value) and "10000 bytes" in str(e.value)
    assert isinstance(e.value, ConfigError)


def test_cpu_device_pool_checks_available_memory() -> None:
    with pytest.raises(HostMemoryError) as e:
        DevicePool.allocate(_specs(), 10**12, device="cpu")
    assert e.value.needed > e.value.available
    assert str(e.value).startswith("device pool (on the CPU) needs ")
    assert DevicePool.allocate(_specs(), 2, device="cpu").buffer is not None


@pytest.mark.parametrize("pages, match", [
    ({"kv": 2}, r"missing a page count for cache group 'swa'"),
    ({"kv": 2, "swa": 0}, r"pages of cache group 'swa' must be a positive int, got 0"),
    ({"kv": 2, "swa": 1, "x": 1}, r"unknown cache groups \['x'\]"),
    ("3", r"must be an int or a mapping"),
])
def test_host_pool_rejects_bad_pages(pages: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HostPool(_specs(), pages)  # type: ignore[arg-type]


def test_region_errors_name_the_key() -> None:
    pool = HostPool(_specs(), 2)
    with pytest.raises(ConfigError, match=r"unknown cache group 'nope'"):
        pool.region("nope", "k", 0)
    with pytest.raises(ConfigError, match=r"has no component 'v'; it has \['k', 'ix'\]"):
        pool.region("kv", "v", 0)
    with pytest.raises(ConfigError, match=r"does not use layer 0; its layers are \[1, 2\]"):
        pool.region("swa", "s", 0)


def test_pages_for_budget() -> None:
    specs = _specs()
    kv_page = 3 * (48 + 37)  # 255 bytes over all layers and components
    swa_page = 2 * 64
    got = pages_for_budget(specs, 10_000)
    assert got == {"kv": 5000 // kv_page, "swa": 5000 // swa_page}
    got = pages_for_budget(specs, 10_000, {"kv": 3.0, "swa": 1.0})
    assert got == {"kv": 7500 // kv_page, "swa": 2500 // swa_page}
    with pytest.raises(ConfigError, match=r"less than one page \(255 bytes"):
        pages_for_budget(specs, 300)
    with pytest.raises(ConfigError, match=r"budget_bytes must be a positive int, got -1"):
        pages_for_budget(specs, -1)
    pool = HostPool.for_budget(specs, 10_000)
    assert pool.pages("kv") == 5000 // kv_page


def test_device_pool_allocate_cpu() -> None:
    pool = DevicePool.allocate(_specs(), {"kv": 4, "swa": 2}, "cpu")
    assert pool.device.type == "cpu"
    assert pool.region("kv", "ix", 2).shape == (4, 37)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"needs CUDA"):
            DevicePool.allocate(_specs(), 2, "cuda")


def _tensors(pages: int = 4) -> dict[tuple[str, str, int], torch.Tensor]:
    t: dict[tuple[str, str, int], torch.Tensor] = {}
    for layer in (0, 1, 2):
        t[("kv", "k", layer)] = torch.zeros(pages, 2, 12, dtype=torch.bfloat16)      # 48 bytes
        t[("kv", "ix", layer)] = torch.zeros(pages, 37, dtype=torch.float8_e4m3fn)  # 37 bytes
    for layer in (1, 2):
        t[("swa", "s", layer)] = torch.zeros(3, 16, dtype=torch.float32)            # 64 bytes
    return t


def test_device_pool_register_any_dtype_as_bytes() -> None:
    tensors = _tensors()
    pool = DevicePool.register(_specs(), tensors)
    assert pool.single_buffer() is None
    assert pool.pages("kv") == 4 and pool.pages("swa") == 3
    r = pool.region("kv", "k", 1)
    assert r.shape == (4, 48) and r.dtype == torch.uint8
    r[2].fill_(0x3F)  # the pool is a view: writes reach the engine's tensor
    assert tensors[("kv", "k", 1)][2].view(torch.uint8).eq(0x3F).all()
    for k in pool.keys():
        assert pool.region(*k).data_ptr() - pool.base_ptr == pool.region_offset(*k)


def test_device_pool_register_validates() -> None:
    t = _tensors()
    t[("kv", "k", 1)] = torch.zeros(4, 13, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"\('kv', 'k', 1\): one page is 52 bytes .* expected page_bytes=48"):
        DevicePool.register(_specs(), t)
    t = _tensors()
    t[("kv", "ix", 2)] = torch.zeros(5, 37, dtype=torch.uint8)
    with pytest.raises(ConfigError, match=r"has 5 pages, but other tensors of cache group 'kv' have 4"):
        DevicePool.register(_specs(), t)
    t = _tensors()
    t[("swa", "s", 1)] = torch.zeros(16, 3, dtype=torch.float32).t()
    with pytest.raises(ConfigError, match=r"must be contiguous"):
        DevicePool.register(_specs(), t)
    t = _tensors()
    del t[("swa", "s", 2)]
    with pytest.raises(ConfigError, match=r"missing for 1 keys, e.g. \[\('swa', 's', 2\)\]"):
        DevicePool.register(_specs(), t)
    t = _tensors()
    t[("swa", "s", 0)] = torch.zeros(3, 16, dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"keys no cache group has: \[\('swa', 's', 0\)\]"):
        DevicePool.register(_specs(), t)


def test_specs_are_checked() -> None:
    s = _specs()
    with pytest.raises(ConfigError, match=r"unique, got 'kv' twice"):
        HostPool([s[0], s[0]], 2)
    with pytest.raises(ConfigError, match=r"must be CacheGroupSpec objects, got 'x'"):
        HostPool(["x"], 2)  # type: ignore[list-item]
