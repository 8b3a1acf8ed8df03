"""``kvtier replay --instances N --l3 URL``: the router, the command line against a REAL
redis-server, its table and JSON, and the options it refuses."""

from __future__ import annotations

import json

import pytest

from kvtier import cli
from kvtier.fsm import ConfigError
from kvtier.replay.l3replay import main as l3replay_main
from kvtier.replay.router import conversation_ids, route
from kvtier.replay.trace import TraceRequest

from store_servers import RedisServer


def _tr(i: int, blocks: list[int], tokens: int) -> TraceRequest:
    return TraceRequest(i, float(i), tokens, 1, tuple(blocks))


def test_conversations_follow_hash_id_chains() -> None:
    reqs = [
        _tr(0, [0, 1, 2], 1300),       # conversation 0: 2 full blocks (0, 1), a partial one (2)
        _tr(1, [0, 5, 6], 1500),       # conversation 1 (shares only the system block 0)
        _tr(2, [0, 1, 7, 8], 1800),    # turn 2 of conversation 0: repeats its full blocks 0, 1
        _tr(3, [0, 5, 6, 9], 1600),    # turn 2 of conversation 1
        _tr(4, [0, 1, 7, 8, 10], 2100),  # turn 3 of conversation 0 (longest chain: request 2)
        _tr(5, [0], 100),              # one block: a conversation of its own
        _tr(6, [0, 1], 1024),          # repeats request 0's full blocks: conversation 0
    ]
    assert conversation_ids(reqs) == [0, 1, 0, 1, 0, 2, 0]
    assert route(reqs, 2, "conversation") == [0, 1, 0, 1, 0, 0, 0]
    assert route(reqs, 3, "round-robin") == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(ConfigError, match="router must be one of"):
        route(reqs, 2, "random")
    with pytest.raises(ConfigError, match="instances must be"):
        route(reqs, 0, "round-robin")


def _trace(tmp_path: object, n: int = 48) -> str:
    """Conversations of 3 turns, arriving interleaved: round-robin over 4 instances puts a
    conversation's turns on different instances."""
    lines = []
    next_id = 100
    convs: list[list[int]] = []
    for i in range(n):
        c = i % 6
        if c >= len(convs) or i // 6 % 3 == 0:
            blocks = [0, next_id, next_id + 1]
            next_id += 2
            if c >= len(convs):
                convs.append(blocks)
            else:
                convs[c] = blocks
        else:
            convs[c] = convs[c] + [next_id, next_id + 1]
            next_id += 2
        blocks = convs[c]
        lines.append(json.dumps({"timestamp": i, "input_length": 512 * len(blocks), "output_length": 4,
                                 "hash_ids": blocks}))
    path = f"{tmp_path}/trace.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    return path


def test_cli_multi_instance_table_and_json(redis_server: RedisServer, tmp_path: object,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    trace = _trace(tmp_path)
    args = ["replay", trace, "--instances", "4", "--l3", redis_server.url, "--device", "4096t", "--host", "12288t",
            "--l3-deadline", "60"]  # a deadline no load reaches: the store answers every operation
    assert cli.main(args + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["runs"]) == {"no-l3", "l3", "single"}
    no, l3, one = (doc["runs"][k][-1] for k in ("no-l3", "l3", "single"))
    assert len(doc["runs"]["l3"]) == 5 and doc["runs"]["l3"][-1]["name"] == "all"
    for r in (no, l3, one):
        assert r["requests"] == 48
        assert r["hit_tokens"] == r["device_hit_tokens"] + r["host_hit_tokens"] + r["l3_hit_tokens"]
    assert no["l3_hit_tokens"] == 0 and one["l3_hit_tokens"] == 0
    assert one["hit_tokens"] > no["hit_tokens"]  # routing loses hits
    assert l3["l3_hit_tokens"] > 0 and l3["l3_failures"] == 0 and l3["l3_bytes_in"] > 0
    assert doc["recovered"] == pytest.approx((l3["hit_tokens"] - no["hit_tokens"]) / (one["hit_tokens"] - no["hit_tokens"]))
    assert doc["recovered"] >= 0.75  # puts are asynchronous: a turn can come before the last put ended
    assert doc["store"]["keys"] > 0 and doc["object_bytes_full"] == 512 * 2 * 2 * 8 * 128 * 2
    assert l3["fingerprint_pages_checked"] >= l3["l3_hit_tokens"] // 512
    # the table, and the conversation router: every turn on one instance, so nothing is lost to routing
    assert cli.main(args + ["--router", "conversation"]) == 0
    out = capsys.readouterr().out
    assert "| 4 x (device+host) + L3 | **all** | 48 |" in out and "routed conversation" in out
    assert "routing lost no hit rate" in out or "L3 recovered" in out


def test_l3replay_module_is_an_alias(redis_server: RedisServer, tmp_path: object,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    out_json = f"{tmp_path}/out.json"
    assert l3replay_main(["--trace", _trace(tmp_path, 16), "--instances", "2", "--l3", redis_server.url,
                          "--device-tokens", "4096", "--host-tokens", "12288", "--json", out_json]) == 0
    assert "| 2 x (device+host) + L3 | **all** | 16 |" in capsys.readouterr().out
    with open(out_json, encoding="utf-8") as f:
        doc = json.load(f)
    assert doc["runs"]["l3"][-1]["requests"] == 16


@pytest.mark.parametrize("extra, message", [
    (["--l3", "redis://127.0.0.1:1"], "need(s) --instances"),
    (["--router", "conversation"], "need(s) --instances"),
    (["--instances", "2", "--backend", "none"], "moves real host bytes"),
    (["--instances", "2", "--plot", "x.png"], "not available with --instances"),
    (["--instances", "2", "--preset", "deepseek-v4", "--l3", "redis://127.0.0.1:1"], "continuation-state"),
    (["--instances", "2", "--l3", "memcached://127.0.0.1:1"], "unknown store URL scheme"),
])
def test_cli_refuses(extra: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", "--limit", "4"] + extra) == 2
    assert message in capsys.readouterr().err


def test_cli_unreachable_store_fails_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("redis")  # kvtier[l3]; without it the run stops as a missing dependency
    assert cli.main(["replay", "--limit", "4", "--instances", "2", "--l3", "redis://127.0.0.1:1",
                     "--l3-deadline", "0.5"]) == 2
    assert "the store does not answer" in capsys.readouterr().err
