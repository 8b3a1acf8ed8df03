"""Generated hostile logs for ``kvtier check`` (kvtier.cli.check, kvtier.cli.logreader).

Every log the product writes is accepted: ``kvtier fuzz --event-log`` with each built-in
machine, ``kvtier replay --event-log``, a facade recorded directly, with one rank or two,
and the recorder writes only the attached cache's transitions (another cache alive in the
process, such as the L3 machine's instances, is left out). Every broken variant is rejected
with exit status 1, never 4: each field the checker reads x each value of a wrong type or
range; a header twice, a record outside a segment, a rank count of 0 or -5, a completion
from a rank past it; lines that are not records (not JSON, not an object, nested past
``MAX_JSON_DEPTH``, longer than ``MAX_LINE_BYTES``, not UTF-8, cut short); gzip files
truncated, corrupt, past ``MAX_GZIP_RATIO`` or the decompressed-bytes limit; ``/dev/zero``.

Each rejection asserts the rule (``format`` unless a lifecycle rule is broken), the line,
a message naming the value, that the input (file or records) is unchanged and that no file
stays open; ``/dev/zero`` is checked in a subprocess under a 1 GiB address-space limit
with a generous timeout (a hang guard, not a timing measurement).
"""

from __future__ import annotations

import copy
import gzip
import io
import json
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtier import Completion
from kvtier.cli.check import MAX_CONTEXT, check_log, check_records
from kvtier.cli import FUZZ_DEFAULT_MACHINES, main
from kvtier.eventlog import EventRecorder, active_recorder
from kvtier.fsm import ConfigError, KvtierError
from kvtier.fsm.presets import preset
from kvtier.cli.logreader import FIELDS, LogFormatError, read_log
from kvtier.tiered import TieredCache
from kvtier.replay.trace import MAX_JSON_DEPTH, MAX_LINE_BYTES

Records = list[dict[str, Any]]


# ---------------------------------------------------------------------------- product logs
def _cache(world: int = 1) -> TieredCache:
    return TieredCache(preset("llama-3-8b", num_layers=2), device_pages=8, host_pages=64,
                       policy="write_through", world_size=world)


def _drive(cache: TieredCache) -> None:
    """Four requests: a write-through to the host, a prefix hit, a loadback after eviction,
    an abort, and one refused call."""
    world = cache.core.world_size

    def engine_round() -> None:
        for cmd in cache.poll().commands:
            for rank in range(world):
                cache.complete(Completion(cmd.op_id, rank))

    for rid, units, prompt in (("a", [("s", i) for i in range(4)], 70), ("b", [("o", i) for i in range(6)], 100),
                               ("c", [("s", i) for i in range(4)], 70), ("d", [("x", i) for i in range(4)], 70)):
        adm = cache.admit(rid, units, prompt_tokens=prompt, chunk_tokens=prompt)
        assert adm is not None, rid
        engine_round()
        cache.step_done(rid, adm.chunk_tokens)
        (cache.abort if rid == "d" else cache.finish)(rid)
        engine_round()
        cache.check_invariants()
    with pytest.raises(KvtierError):
        cache.finish("never admitted")  # recorded as a refused call
    engine_round()
    cache.poll()


def product_log(world: int = 1) -> Records:
    buf = io.StringIO()
    cache = _cache(world)
    with EventRecorder(buf) as rec:
        rec.attach(cache)
        _drive(cache)
    return [json.loads(line) for line in buf.getvalue().splitlines()]


LOG1 = product_log(1)
LOG2 = product_log(2)


def test_the_product_logs_hold_every_record_kind_and_are_accepted() -> None:
    assert {r["k"] for r in LOG1} >= set(FIELDS) - {"poison"} | {"header", "call"}
    for recs in (LOG1, LOG2):
        res = check_records(enumerate(recs, 1))
        assert res.ok, res.report()
        assert res.records == len(recs) and res.segments == 1 and res.ops == 4
    assert sum(r["k"] == "completion" for r in LOG2) == 2 * sum(r["k"] == "completion" for r in LOG1)


def test_the_recorder_leaves_out_every_cache_but_the_attached_one() -> None:
    """Transitions of a cache alive beside the attached one (the L3 machine's instances, the
    misuse machine's caches) are not in the log, nor are transitions while none is attached."""
    buf = io.StringIO()
    other, mine = _cache(), _cache()
    with EventRecorder(buf) as rec:
        _drive(other)  # before any attach: nothing recorded
        rec.attach(mine)
        _drive(mine)
        other.admit("z", [("z", 0), ("z", 1)], prompt_tokens=40, chunk_tokens=40)  # beside the attached one
        rec.detach()
        _drive(_cache())  # after detach: nothing recorded
    recs = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [r["k"] for r in recs[:2]] == ["header", "cache"]
    assert recs[2:] == LOG1[2:]  # exactly the attached cache's run, nothing of the others
    assert active_recorder() is None


def test_a_core_fetching_from_l3_while_another_cache_is_attached_is_left_out() -> None:
    """The L3 machine's case: its cores fetch from the store (fetch_submit, fetch_ack) while
    the recorder of ``kvtier fuzz --event-log`` has another cache attached."""
    from l3_helpers import KEY, FakeStore, backed, make, pump

    store = FakeStore()
    a, ta = make()
    backed(a, KEY)
    ta.offer(KEY, 0.0)
    pump(ta, store)
    buf = io.StringIO()
    with EventRecorder(buf) as rec:
        rec.attach(_cache())
        b, tb = make()
        assert tb.prefetch("r1", KEY + ("e",), 0.0)
        pump(tb, store)
        assert tb.fetched_units("r1") == 4  # the get happened, on a core not attached
    recs = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [r["k"] for r in recs] == ["header", "cache"]


@pytest.mark.parametrize("machine", [*FUZZ_DEFAULT_MACHINES, None], ids=lambda m: m or "the-default-mix")
def test_a_fuzz_log_of_every_machine_is_accepted(machine: str | None, tmp_path: Path) -> None:
    """Each built-in machine alone, and the default mix (the README's ``kvtier fuzz
    --event-log fuzz.kvlog``: the L3 machine's cores run while a facade's cache is attached)."""
    log = tmp_path / f"{machine}.kvlog"
    only = ["--machine", machine] if machine else []
    done = subprocess.run([sys.executable, "-m", "kvtier", "fuzz", "--steps", "300" if machine else "1500",
                           "--seed", "4", "--no-progress", *only, "--event-log", str(log)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    checked = subprocess.run([sys.executable, "-m", "kvtier", "check", str(log)], cwd=tmp_path,
                             capture_output=True, text=True, timeout=600, check=False)
    assert checked.returncode == 0, checked.stdout[-3000:] + checked.stderr[-2000:]
    assert "conforms" in checked.stdout


def test_a_replay_log_is_accepted(tmp_path: Path) -> None:
    log = tmp_path / "replay.kvlog"
    done = subprocess.run([sys.executable, "-m", "kvtier", "replay", "--limit", "20", "--backend", "none",
                           "--event-log", str(log)], cwd=tmp_path, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    res = check_log(log)
    assert res.ok, res.report()
    assert res.segments == 3 and res.transitions > 100  # the replay's three configurations
    gz = tmp_path / "replay.kvlog.gz"
    gz.write_bytes(gzip.compress(log.read_bytes()))
    assert check_log(gz).records == res.records  # gzip read transparently, within MAX_GZIP_RATIO


# ---------------------------------------------------------------------------- hostile records
#: wrong values for each field kind of kvtier.cli.logreader.FIELDS (null is added for the
#: kinds that do not accept it)
BAD_VALUES: dict[str, list[Any]] = {
    "count": [-1, 1.5, "1", True, [1], {"n": 1}],
    "ranks": [0, -5, 1.0, "2", True],
    "name": [5, ["a"], {"a": 1}, False],
    "flag": ["yes", 1, 0, "false", []],
    "ids": ["1,2", [1, "x"], [-1], [True], {"1": 1}, 3],
    "counts": [[1], {"dev": -1}, {"dev": "1"}, {"dev": True}, {"dev": 1.0}, "dev"],
    "flags": [[True], {"unlocked": 1}, {"unlocked": "true"}, {"unlocked": None}, True],
}


def _valid(kind: str, recs: Records) -> tuple[Records, dict[str, Any]]:
    """The product log up to its first record of ``kind`` (a poison record, which the
    product log lacks, right after the cache record), and that record."""
    if kind == "poison":
        return recs[:2], {"k": "poison", "op": 1}
    i = next(i for i, r in enumerate(recs) if r["k"] == kind)
    return recs[:i], recs[i]


def _field_cases() -> list[Any]:
    out = []
    for kind, fields in FIELDS.items():
        for name, spec, required in fields:
            values = BAD_VALUES[spec.rstrip("?")] + ([] if spec.endswith("?") else [None])
            for value in values:
                out.append(pytest.param(kind, name, value, id=f"{kind}.{name}={value!r}"))
            if required:
                out.append(pytest.param(kind, name, KeyError, id=f"{kind}.{name}-missing"))
    return out


def _rejected(recs: Records, line: int, rule: str, *fragments: str) -> None:
    """check_records rejects ``recs`` at ``line`` under ``rule`` naming ``fragments``, and
    leaves the records as they were."""
    before = copy.deepcopy(recs)
    res = check_records(enumerate(recs, 1))
    v = res.violation
    assert v is not None, f"accepted: {res.report()}"
    assert (v.line, v.rule) == (line, rule), v.render()
    for f in fragments:
        assert f in v.message, v.message
    assert "REJECTED at line" in res.report() and "events leading to it" in v.render()
    assert recs == before, "check_records changed its input"


@pytest.mark.parametrize(("kind", "name", "value"), _field_cases())
def test_every_field_of_a_wrong_type_is_a_format_violation_naming_it(kind: str, name: str, value: Any) -> None:
    head, rec = _valid(kind, LOG1)
    assert check_records(enumerate(head + [rec], 1)).ok  # the control: the record as written
    bad = {k: v for k, v in rec.items() if k != name}
    if value is not KeyError:
        bad[name] = value
    frag = "is missing" if value is KeyError else repr(value)[:37]
    _rejected(head + [bad], len(head) + 1, "format", f"malformed {kind!r} record", f"field {name!r}", frag)


def _with(recs: Records, kind: str, change: Callable[[dict[str, Any]], dict[str, Any]], nth: int = 0) -> Records:
    out, seen = [], 0
    for r in recs:
        if r["k"] == kind:
            if seen == nth:
                r = change(dict(r))
            seen += 1
        out.append(r)
    return out


def _line_of(recs: Records, kind: str, nth: int = 0, **match: Any) -> int:
    hits = [i for i, r in enumerate(recs, 1) if r["k"] == kind and all(r.get(k) == v for k, v in match.items())]
    return hits[nth]


def _set(**kw: Any) -> Callable[[dict[str, Any]], dict[str, Any]]:
    return lambda r: {**r, **kw}


HOSTILE_LOGS: list[Any] = [
    pytest.param(_with(LOG1, "cache", _set(world_size=0)), 2, "format", ("world_size", "0"), id="world_size-0"),
    pytest.param(_with(LOG1, "cache", _set(world_size=-5)), 2, "format", ("world_size", "-5"), id="world_size--5"),
    # two ranks declared, one acknowledged: the first writeback_ack is refused
    pytest.param(_with(LOG1, "cache", _set(world_size=2)), _line_of(LOG1, "node", ev="writeback_ack"),
                 "host_means_acked", ("before every rank acknowledged it (1 of 2)",), id="world_size-2-one-rank-acks"),
    pytest.param(_with(LOG2, "completion", _set(rank=2), nth=1), _line_of(LOG2, "completion", 1), "format",
                 ("rank 2", "world_size 2"), id="rank-past-world_size"),
    pytest.param(LOG1[:10] + [LOG1[0]] + LOG1[10:], 11, "format", ("a second header",), id="second-header"),
    pytest.param(LOG1[:1] + LOG1[2:], 2, "format", ("before the first 'cache' record",), id="no-cache-record"),
    pytest.param(LOG1 + [LOG1[0]], len(LOG1) + 1, "format", ("a second header",), id="header-at-the-end"),
    pytest.param([dict(LOG1[0], version=True)] + LOG1[1:], 1, "format", ("version True",), id="version-true"),
    pytest.param(LOG1[:5] + [["not", "a", "record"]] + LOG1[5:], 6, "format",  # type: ignore[list-item]
                 ("a record must be a JSON object", "['not', 'a', 'record']"), id="record-not-an-object"),
    pytest.param(LOG1[:5] + [{"k": ["node"]}] + LOG1[5:], 6, "format", ("field 'k'", "['node']"),
                 id="kind-not-a-string"),
]


@pytest.mark.parametrize(("recs", "line", "rule", "fragments"), HOSTILE_LOGS)
def test_hostile_logs_are_rejected_at_their_line(recs: Records, line: int, rule: str, fragments: tuple[str, ...],
                                                 tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _rejected(recs, line, rule, *fragments)
    log = tmp_path / "hostile.kvlog"
    log.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert main(["check", str(log)]) == 1
    assert f"REJECTED at line {line}: {rule}: " in capsys.readouterr().out


def test_a_record_nested_past_the_interpreter_s_recursion_limit_is_rejected() -> None:
    """Given to check_records directly (no reader bounds it): a guards object nested 10,000
    deep is rejected as malformed, and rendering it does not recurse."""
    deep: Any = True
    for _ in range(10_000):
        deep = {"g": deep}
    recs = _with(LOG1, "node", _set(guards=deep))
    res = check_records(enumerate(recs, 1))
    assert res.violation is not None and res.violation.rule == "format", res.report()
    assert "field 'guards'" in res.violation.message and len(res.report()) < 10_000


@pytest.mark.parametrize("context", [-1, 1.5, "3", None, True])
def test_a_bad_context_is_refused(context: Any) -> None:
    with pytest.raises(ConfigError, match=re.escape(f"context must be an int >= 0, got {context!r}")):
        check_records(enumerate(LOG1, 1), context=context)


@pytest.mark.parametrize("context", [MAX_CONTEXT + 1, 2**63, 10**30])
def test_a_context_past_its_bound_is_refused_by_the_api_and_the_command_line(
        context: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The context is a window of records kept in memory: one past ``MAX_CONTEXT`` is refused
    naming it (``kvtier check --context 10**30`` exited 4, an OverflowError from the window's
    deque; 2**62 kept every record of the log), and ``MAX_CONTEXT`` itself is taken."""
    with pytest.raises(ConfigError) as info:
        check_records(enumerate(LOG1, 1), context=context)
    assert str(info.value) == f"context must be at most {MAX_CONTEXT} records, got {context}"
    assert check_records(enumerate(LOG1, 1), context=MAX_CONTEXT).ok
    log = tmp_path / "run.kvlog"
    log.write_bytes(_text(LOG1))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:  # argparse's usage error
        main(["check", "--context", str(context), str(log)])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert f"--context: '{context}' must be between 1 and {MAX_CONTEXT}" in err and "Traceback" not in err
    assert main(["check", "--context", str(MAX_CONTEXT), str(log)]) == 0


# ---------------------------------------------------------------------------- hostile files
def _text(recs: Records) -> bytes:
    return "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in recs).encode()


GOOD = _text(LOG1)
N = len(LOG1)


def _deep(depth: int) -> bytes:
    return b'{"k":"node","x":' + b"[" * depth + b"]" * depth + b"}\n"


def _corrupt_gzip() -> bytes:
    data = bytearray(gzip.compress(GOOD))
    for i in range(20, 40):
        data[i] ^= 0x5A
    return bytes(data)


#: (file content, the line rejected (None: one past the last record), fragments of the message)
HOSTILE_FILES: list[Any] = [
    pytest.param(b"not json\n", 1, ("not JSON",), id="not-json"),
    pytest.param(GOOD[:-200], GOOD[:-200].count(b"\n") + 1, ("no line break", "looks truncated"),
                 id="plain-cut-mid-line"),
    pytest.param(b"[1, 2]\n", 1, ("not a JSON object", "list"), id="an-array"),
    pytest.param(b'"header"\n', 1, ("not a JSON object", "str"), id="a-string"),
    pytest.param(GOOD + b'{"k":"call","n":' + b"9" * 5000 + b"}\n", N + 1, ("not JSON",), id="int-of-5000-digits"),
    pytest.param(GOOD + b'{"k":"call","name":"\xff\xfe"}\n', N + 1, ("not JSON",), id="not-utf-8"),
    pytest.param(GOOD + _deep(MAX_JSON_DEPTH + 1), N + 1, ("MAX_JSON_DEPTH = 32",), id="nested-33-deep"),
    pytest.param(GOOD + _deep(100_000), N + 1, ("MAX_JSON_DEPTH = 32",), id="nested-100000-deep"),
    pytest.param(GOOD + b'{"k":"call","pad":"' + b"a" * MAX_LINE_BYTES + b'"}\n', N + 1,
                 ("MAX_LINE_BYTES = 1,048,576",), id="line-over-1-MiB"),
    pytest.param(b"\n" * 5 + b"x" * (MAX_LINE_BYTES + 1), 6, ("MAX_LINE_BYTES",), id="no-line-break"),
    pytest.param(gzip.compress(GOOD)[:-30], N, (), id="gzip-truncated"),
    pytest.param(gzip.compress(GOOD + b"\n")[:-8], N + 2, ("the gzip stream ends early", "truncated"),
                 id="gzip-truncated-in-the-trailer"),
    pytest.param(_corrupt_gzip(), 1, ("invalid gzip data",), id="gzip-corrupt"),
    # (rejected once 4 MiB are out: at a blank line past the last record)
    pytest.param(gzip.compress(GOOD + b"\n" * (8 << 20)), None, ("MAX_GZIP_RATIO = 200", "gzip bomb"),
                 id="gzip-bomb"),
    pytest.param(b"", 0, ("empty log",), id="empty"),
    pytest.param(b"\n \n\t\n", 0, ("empty log",), id="blank-lines-only"),
    pytest.param(gzip.compress(b""), 0, ("empty log",), id="gzip-of-nothing"),
]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize(("content", "line", "fragments"), HOSTILE_FILES)
def test_hostile_files_are_rejected_with_exit_status_1(content: bytes, line: int | None, fragments: tuple[str, ...],
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "hostile.kvlog"
    log.write_bytes(content)
    fds = _open_fds()
    res = check_log(log)
    v = res.violation
    assert v is not None and v.rule == "format", res.report()
    if line is None:
        line = v.line
        assert line > N and res.records == N, res.report()
    assert v.line == line, res.report()
    for f in fragments:
        assert f in v.message, v.message
    assert _open_fds() == fds, "a file was left open"
    assert main(["check", str(log)]) == 1
    out, err = capsys.readouterr()
    assert f"REJECTED at line {line}: format" in out and "Traceback" not in err
    assert log.read_bytes() == content
    assert _open_fds() == fds


def test_the_decompressed_bytes_limit_is_the_trace_reader_s_and_can_be_given(tmp_path: Path) -> None:
    log = tmp_path / "run.kvlog.gz"
    log.write_bytes(gzip.compress(GOOD))
    assert check_log(log).ok
    v = check_log(log, max_decompressed_bytes=1000).violation
    assert v is not None and v.rule == "format" and "more than 1,000 bytes" in v.message, v
    with pytest.raises(ConfigError, match="max_decompressed_bytes must be an int >= 1, got 0"):
        read_log(log, max_decompressed_bytes=0)


def test_a_reader_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    log = tmp_path / "x.kvlog"
    log.write_bytes(GOOD + b"oops\n")
    with pytest.raises(LogFormatError) as info:
        list(read_log(log))
    assert str(info.value).startswith(f"{log}: line {N + 1}: not JSON") and info.value.line == N + 1


def test_a_file_that_cannot_be_opened_is_exit_status_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", str(tmp_path / "missing.kvlog")]) == 2
    assert main(["check", str(tmp_path)]) == 2  # a directory
    err = capsys.readouterr().err
    assert "missing.kvlog" in err and "Traceback" not in err


def _bounded(*argv: str) -> subprocess.CompletedProcess[str]:
    """``kvtier check`` in a subprocess limited to 1 GiB of address space (a log read without
    bound would fail with MemoryError, exit 4) and a generous timeout (a hang guard)."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run([sys.executable, "-m", "kvtier", "check", *argv], capture_output=True, text=True,
                          timeout=300, check=False, preexec_fn=limit)


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_dev_zero_is_rejected_after_one_line_in_bounded_memory() -> None:
    done = _bounded("/dev/zero")
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "REJECTED at line 1: format: the line is longer than MAX_LINE_BYTES" in done.stdout
