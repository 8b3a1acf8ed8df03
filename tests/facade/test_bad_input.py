"""Bad input gets a clear error naming the value, never a traceback or a silent wrong result
(found by a fresh user's attack on the CLI and the facade)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.fsm import CacheGroupSpec, ComponentSpec, ConfigError, Family, UsageError
from kvtier.fsm import CacheCore
from kvtier.fsm.presets import preset
from kvtier.tiered import TieredCache


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvtier", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args, message", [
    (("replay", "--device", "inf"), "capacity 'inf' must be a finite number > 0"),
    (("replay", "--device", "0"), "capacity '0' must be a finite number > 0"),
    (("replay", "--device=inf%"), "capacity 'inf%' must be a finite number > 0"),
    (("replay", "--device=nan%"), "capacity 'nan%' must be a finite number > 0"),
    (("replay", "--device=-5%"), "capacity '-5%' must be a finite number > 0"),
    (("replay", "--device=150%"), "capacity '150%': a percentage must be at most 100%"),
    (("replay", "--layers", "100000000"), "argument --layers: '100000000' must be between 1 and 4096"),
    (("replay", "--limit", "0"), "argument --limit: '0' must be >= 1"),
    (("replay", "--layers", "-1"), "argument --layers: '-1' must be between 1 and 4096"),
    (("replay", "--byte-scale", "0"), "argument --byte-scale: '0' must be >= 1"),
    (("replay", "--device", "1t", "--limit", "3", "--backend", "none"), "--device 1t is less than one cache unit"),
    (("replay", "--device", "2", "--limit", "3", "--backend", "none"), "a bare number is a fraction of the working set, at most 1; write 2t"),
    (("replay", "--plot", "out.txt", "--limit", "3"), "expected a .png file name"),
    (("fuzz", "--faults", "2"), "argument --faults: '2' must be between 0 and 1"),
    (("fuzz", "--minutes", "nan"), "must be a finite number > 0"),
    (("fuzz", "--replay", "/nonexistent/seq.json"),
     "kvtier fuzz: cannot read sequence file /nonexistent/seq.json: No such file or directory"),
    (("replay", "/nonexistent/trace.jsonl", "--backend", "none"),
     "kvtier replay: cannot read trace file /nonexistent/trace.jsonl: No such file or directory"),
    (("verify", "--depth", "-3"), "argument --depth: '-3' must be >= 1"),
])
def test_cli_rejects_bad_values_with_a_message(args: tuple[str, ...], message: str) -> None:
    out = _kvtier(*args)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_core_rejects_bad_values() -> None:
    lay = preset("llama-3-8b", page_tokens=16)
    with pytest.raises(ConfigError) as exc:
        CacheCore("llama-3-8b", 10)  # type: ignore[arg-type]
    assert str(exc.value) == "layout must be a CacheLayout (see kvtier.fsm.presets.preset), got 'llama-3-8b'"
    with pytest.raises(UsageError) as exc:  # misuse of a call, not a configuration
        CacheCore(lay, 64, 64).complete(999)  # type: ignore[arg-type]
    assert type(exc.value) is UsageError and str(exc.value) == "complete() takes a Completion, got 999"


def test_facade_and_core_reject_bad_values() -> None:
    lay = preset("llama-3-8b", page_tokens=16)
    c = TieredCache(lay, 64, 64)
    with pytest.raises(UsageError, match="^complete\\(\\) takes a Completion, got 999$"):  # the core's refusal
        c.complete(999)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="units must be a list or tuple"):
        c.admit("a", "abcd", prompt_tokens=64, chunk_tokens=64)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="unit keys must be hashable"):
        c.admit("a", [[1], [2], [3], [4]], prompt_tokens=64, chunk_tokens=64)
    adm = c.admit("a", list("abcd"), prompt_tokens=64, chunk_tokens=64)
    assert adm is not None
    with pytest.raises(UsageError, match="computed_tokens must be an int >= 0, got -5"):
        c.step_done("a", -5)
    for bad in (-1, 32, "x"):
        with pytest.raises(UsageError, match="layer must be an int in 0..31"):
            c.layer_ready("a", bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="layers must be a sequence"):
        CacheGroupSpec("g", Family.HISTORY, 4, 1, True, (ComponentSpec("k", 64),))  # type: ignore[arg-type]


@pytest.mark.parametrize(("make", "message"), [
    (lambda lay: CacheCore(lay, {"llama.full_attention": "3"}),
     "device_pages: pages of group 'llama.full_attention' must be an int >= 0, got '3'"),
    (lambda lay: CacheCore(lay, {"llama.full_attention": 8.9}),
     "device_pages: pages of group 'llama.full_attention' must be an int >= 0, got 8.9"),
    (lambda lay: CacheCore(lay, 8, {"llama.full_attention": True}),
     "host_pages: pages of group 'llama.full_attention' must be an int >= 0, got True"),
    (lambda lay: CacheCore(lay, 8, op_deadline_steps=True),
     "op_deadline_steps must be None or an int >= 1, got True"),
    (lambda lay: TieredCache(lay, 8, 8, history_replay="no"), "history_replay must be True or False, got 'no'"),
    (lambda lay: TieredCache(lay, 8, 8, finish_writeback="yes"),
     "finish_writeback (or None) must be True or False, got 'yes'"),
])
def test_constructor_values_are_checked_not_converted(make, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        make(preset("llama-3-8b", page_tokens=16))
    assert str(exc.value) == message


def test_abort_arguments_are_checked() -> None:
    c = TieredCache(preset("llama-3-8b", page_tokens=16), 64, 64)
    assert c.admit("a", list("abcd"), prompt_tokens=64, chunk_tokens=64) is not None
    for call, message in [
        (lambda: c.abort("a", None), "abort: reason must be a non-empty str, got None"),  # type: ignore[arg-type]
        (lambda: c.abort("a", ""), "abort: reason must be a non-empty str, got ''"),
        (lambda: c.abort_victim(None), "abort_victim: blocked must be a list of request ids, got None"),  # type: ignore[arg-type]
        (lambda: c.abort_victim("a"), "abort_victim: blocked must be a list of request ids, got 'a'"),
        (lambda: c.abort_victim(["a"], None), "abort_victim: reason must be a non-empty str, got None"),  # type: ignore[arg-type]
    ]:
        with pytest.raises(UsageError) as exc:
            call()
        assert str(exc.value) == message
        assert c.state("a") == "running"
