"""KV events from a running `kvgate serve` (the engine in its own process), read with pyzmq and
msgpack as a router would, checked against /admin/metrics over a scripted workload: every block
stored on the device announced once, every device eviction announced, and what the stream says
the device, host and disk hold is what the metrics count."""

from __future__ import annotations

import time

import httpx

from tests.app.test_tiers_http import SMALL_POOL, _complete, _ids
from tests.engine.kv_event_stream import EventStream

EVENTS = SMALL_POOL + """
[cache.disk]
persist = "behind"

[events]
endpoint = "tcp://127.0.0.1:*"
replay_endpoint = "tcp://127.0.0.1:*"
topic = "kvgate"
"""


def _settled(url: str, timeout_s: float = 30.0) -> dict:
    """/admin/metrics once nothing runs, no write is in flight and every event is sent."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        m = httpx.get(url + "/admin/metrics", timeout=30).json()
        quiet = (m["num_running"] == 0 and m["num_waiting"] == 0 and m["tiers"]["chain"]["pending_writes"] == 0
                 and m["tiers"]["chain"]["unpersisted_blocks"] == 0 and m["events"]["idle"])
        if quiet and last is not None and last == m["events"]["next_sequence"]:
            return m
        last = m["events"]["next_sequence"] if quiet else None
        time.sleep(0.1)
    raise AssertionError("the server did not settle")


def test_the_event_stream_matches_admin_metrics(start_server) -> None:
    server = start_server(config=EVENTS)
    events = httpx.get(server.url + "/admin/metrics", timeout=30).json()["events"]
    assert events["endpoint"].startswith("tcp://127.0.0.1:") and events["topic"] == "kvgate"
    stream = EventStream(events["endpoint"], events["replay_endpoint"], topic=b"kvgate")
    try:
        prompts = [_ids(70 + i, 500) for i in range(3)]
        for ids in prompts:
            _complete(server.url, ids)
        _complete(server.url, prompts[0])  # a device hit
        for seed in (80, 81, 82):  # the pool overflows: device → host, written behind to disk
            _complete(server.url, _ids(seed, 600), max_tokens=1)
        _complete(server.url, prompts[1])  # back from host
        m = _settled(server.url)
        stream.sync(m["events"]["next_sequence"])
        assert stream.problems == [] and stream.clears == 1
        pc = m["prefix_cache"]
        assert stream.counts[("BlockStored", "GPU")] == pc["cached"] > 0
        assert stream.counts[("BlockRemoved", "GPU")] == pc["evictions"] > 0
        assert len(stream.held["GPU"]) == m["cached_blocks"]
        assert len(stream.held["CPU"]) == m["tiers"]["host"]["blocks"] > 0
        assert len(stream.held["DISK"]) == m["tiers"]["disk"]["blocks"] > 0
        announced = m["events"]["blocks"]
        for (kind, medium), n in stream.counts.items():
            assert announced[kind][medium] == n, (kind, medium)
        assert stream.block_size == 16
        text = httpx.get(server.url + "/metrics", timeout=30).text
        stored_gpu = stream.counts[("BlockStored", "GPU")]
        assert f'kvgate_kv_event_blocks_total{{event="BlockStored",medium="GPU"}} {float(stored_gpu)}' in text
        assert "kvgate_kv_event_resyncs_total 0.0" in text
    finally:
        stream.close()
