"""Generated hostile inputs for the ``kvtier`` command line: every capacity spelling, every
preset x small layer count, small traces, GPU backends without CUDA, unreadable trace files
and every exit status.
"""

from __future__ import annotations

import argparse
import io
import json
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import Any

import pytest

from kvtier import cli, replay_cli
from kvtier.cli.exitcodes import ExitCode
from kvtier.fsm import ConfigError, IllegalTransition, InvariantViolation
from kvtier.scheduler import SchedulerStalled
from kvtier.replay.trace import (
    TraceFormatError,
)

GOOD = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [0, 1]}'
HUGE = "9" * 5000  # a 5,000-digit integer: more than Python's int/str conversion limit
FIELDS = {"timestamp": "0", "input_length": "600", "output_length": "5", "hash_ids": "[0, 1]"}


def _line(**raw: str) -> str:
    """A trace line with some fields replaced by raw JSON text (``None``-like removal: '')."""
    fields = {**FIELDS, **raw}
    return "{" + ", ".join(f'"{k}": {v}' for k, v in fields.items() if v != "") + "}"


# --- command line: capacities, layers, backends, small traces, exit statuses -------------

CAPACITY_BAD: list[tuple[str, str]] = [
    *[(t, "a bare number is a fraction of the working set, at most 1") for t in ("2", "1.5", "100", "1e3",
                                                                                 "300000", "1.0001")],
    *[(t, "must be a finite number > 0") for t in ("0", "-1", "-0.5", "nan", "inf", "-inf", "0%", "-5%", "nan%",
                                                  "inf%")],
    ("150%", "a percentage must be at most 100%"),
    ("100.5%", "a percentage must be at most 100%"),
    *[(t, "a token count must be >= 1") for t in ("0t", "-3t")],
    *[(t, "expected a fraction of the working set (0.05 or 5%) or a token count (300000t)")
      for t in ("1.5t", "t", "%", "", "lots", "0x10t", "1e5t", "5%t", "5t%", "5tt")],
]
CAPACITY_GOOD: list[tuple[str, tuple[str, float]]] = [
    ("1", ("fraction", 1.0)), ("0.05", ("fraction", 0.05)), ("5%", ("fraction", 0.05)),
    ("100%", ("fraction", 1.0)), (" 5% ", ("fraction", 0.05)), ("300000t", ("tokens", 300000)),
    ("300_000t", ("tokens", 300000)), ("256T", ("tokens", 256)), ("1e-3", ("fraction", 0.001)),
    ("5 t", ("tokens", 5)),
]


@pytest.mark.parametrize(("text", "fragment"), CAPACITY_BAD, ids=[repr(c[0]) for c in CAPACITY_BAD])
def test_capacity_spellings_rejected(text: str, fragment: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError) as info:
        replay_cli._capacity(text)
    assert str(info.value).startswith(f"capacity {text!r}") and fragment in str(info.value)


@pytest.mark.parametrize(("text", "parsed"), CAPACITY_GOOD, ids=[repr(c[0]) for c in CAPACITY_GOOD])
def test_capacity_spellings_accepted(text: str, parsed: tuple[str, float]) -> None:
    assert tuple(replay_cli._capacity(text)) == parsed


def _main(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exc:  # argparse
            code = exc.code if isinstance(exc.code, int) else 2
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("option", ["--device", "--host"])
@pytest.mark.parametrize("text", ["2", "300000", "0t"])
def test_cli_capacity_errors_exit_2(option: str, text: str) -> None:
    code, _, err = _main("replay", "--backend", "none", "--limit", "2", option, text)
    assert code == ExitCode.USAGE == 2
    assert f"argument {option}: capacity {text!r}" in err and "Traceback" not in err


def _replay_json(*argv: str) -> tuple[dict[str, Any], str]:
    code, out, err = _main("replay", "--backend", "none", "--json", *argv)
    assert code == ExitCode.OK, err
    return json.loads(out), err


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("name", ["deepseek-v4", "llama-3-8b", "deepseek-v3"])
def test_every_preset_runs_with_few_layers(name: str, layers: int) -> None:
    doc, _ = _replay_json("--limit", "2", "--preset", name, "--layers", str(layers))
    configs = doc["configurations"]
    assert [c["requests"] for c in configs] == [2, 2, 2]
    assert configs[-1]["finished"] == 2 and configs[-1]["aborts"] == 0


TINY_TRACES: list[tuple[str, list[str]]] = [
    ("one token", [_line(input_length="1", hash_ids="[7]")]),
    ("one block", [_line(input_length="512", hash_ids="[7]")]),
    ("no output", [_line(output_length="0")]),
    ("two requests", [GOOD, _line(timestamp="5", hash_ids="[0, 9]")]),
    ("long and short", [_line(input_length="1", hash_ids="[1]"),
                        _line(timestamp="1", input_length="20000", output_length="300",
                              hash_ids=json.dumps(list(range(40))))]),
]


@pytest.mark.parametrize("lines", [c[1] for c in TINY_TRACES], ids=[c[0] for c in TINY_TRACES])
def test_defaults_work_for_tiny_traces(tmp_path: Path, lines: list[str]) -> None:
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(lines) + "\n")
    doc, err = _replay_json(str(path))
    for config in doc["configurations"]:
        assert config["finished"] == len(lines) and config["aborts"] == 0
    longest = max(json.loads(line)["input_length"] + json.loads(line)["output_length"] for line in lines)
    assert doc["setup"]["device_tokens"] >= longest  # raised to the longest request
    assert "raised to" in err


@pytest.mark.parametrize("option", ["--device", "--host"])
def test_capacity_above_the_unbounded_configuration_is_lowered(option: str) -> None:
    doc, err = _replay_json("--limit", "3", option, f"{10**15}t")
    unbounded = doc["configurations"][-1]["device_tokens"]
    assert doc["setup"]["device_tokens" if option == "--device" else "host_tokens"] == unbounded < 10**15
    assert f"note: {option} lowered to {unbounded:,} tokens" in err


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_gpu_backend_without_cuda_names_the_cli_options(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _main("replay", "--limit", "2", "--backend", backend)
    assert code == ExitCode.USAGE
    assert f"--backend {backend} needs a CUDA GPU" in err
    assert "use --backend cpu (real copies in host memory) or --backend none (metadata only)" in err
    assert "device='cpu'" not in err and out == ""


def _raise(exc: BaseException) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        raise exc

    return run


EXIT_CASES: list[tuple[str, BaseException, int, str]] = [
    ("fingerprint mismatch", __import__("kvtier.replay.fingerprint", fromlist=["x"]).FingerprintMismatch(
        "r1", "g", "kv", 0, 3, "differs"), 1, "FingerprintMismatch: request 'r1'"),
    ("stalled", SchedulerStalled("no progress", 10, ["r1"]), 1, "SchedulerStalled: no progress"),
    ("invariant", InvariantViolation("pages_conserved", "pool", "leak"), 1, "InvariantViolation: invariant"),
    ("trace format", TraceFormatError("t.jsonl", 4, "hash_ids", "bad"), 2, "t.jsonl, line 4, field 'hash_ids': bad"),
    ("config", ConfigError("bad value"), 2, "kvtier replay: bad value"),
    ("os", FileNotFoundError(2, "No such file or directory", "x.jsonl"), 2, "No such file or directory"),
    ("value", ValueError("bad"), 2, "kvtier replay: bad"),
    ("illegal transition", IllegalTransition("request", "request 'r1'", "loading", "retract"), 4, "internal error"),
    ("runtime", RuntimeError("boom"), 4, "internal error (exit status 4); this is a kvtier bug"),
    ("key", KeyError("k"), 4, "internal error"),
    ("interrupt", KeyboardInterrupt(), 130, "kvtier replay: interrupted"),
]


@pytest.mark.parametrize(("exc", "code", "fragment"), [c[1:] for c in EXIT_CASES], ids=[c[0] for c in EXIT_CASES])
def test_exit_status_of_each_error_class(monkeypatch: pytest.MonkeyPatch, exc: BaseException, code: int,
                                         fragment: str) -> None:
    monkeypatch.setattr("kvtier.replay.run_replay", _raise(exc))
    got, _, err = _main("replay", "--limit", "2", "--backend", "none")
    assert got == code and fragment in err
    assert ("Traceback" in err) == (code == ExitCode.INTERNAL)


@pytest.mark.parametrize("trace", ["/nonexistent/t.jsonl", "/", "/dev/zero"])
def test_unreadable_trace_files_exit_2(trace: str) -> None:
    code, _, err = _main("replay", trace, "--backend", "none")
    assert code == ExitCode.USAGE and err.startswith("kvtier replay: ") and "Traceback" not in err


@pytest.mark.parametrize("command", [[], ["replay"], ["fuzz"], ["verify"], ["diagram"]])
def test_help_lists_every_exit_status(command: list[str]) -> None:
    code, out, _ = _main(*command, "--help")
    assert code == 0
    tail = out[out.index("exit status:"):]
    for status in ExitCode:
        assert f"\n  {int(status):<3}  " in tail
