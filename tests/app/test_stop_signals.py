"""Every ordinary stop flushes: SIGTERM or SIGINT to the API process, to the engine process, or
to the whole process group (what systemd, `kill -- -PGID` and `tini -g` send) all drain, write the
cached blocks to disk, exit 0, and a restarted server serves the prefix from disk."""

from __future__ import annotations

import os
import re
import signal

import httpx
import pytest

from tests.app.test_lifecycle import _is_zombie
from tests.app.test_tiers_http import PATIENT_READS, _complete, _ids, _tiers

ON_EVICT = """
[cache.disk]
persist = "on_evict"
"""


def _engine_pid(url: str) -> int:
    return int(httpx.get(url + "/admin/metrics", timeout=30).json()["engine"]["pid"])


@pytest.mark.parametrize(("target", "sig"), [("api", signal.SIGTERM), ("engine", signal.SIGTERM),
                                             ("group", signal.SIGTERM), ("group", signal.SIGINT),
                                             ("engine", signal.SIGINT)])
def test_a_stop_signal_to_any_part_flushes_and_a_restart_serves_from_disk(start_server, start_app, tmp_path,
                                                                          target, sig) -> None:
    folder = str(tmp_path / "kv")
    prompt = _ids(40 + sig, 300)  # 18 full blocks
    # on_evict: the blocks reach the disk only by the flush (behind would have written them already)
    first = start_server("--model", "tiny", "--disk-cache", folder, new_session=True, config=ON_EVICT)
    cold, cached = _complete(first.url, prompt)
    assert cached == 0
    engine_pid = _engine_pid(first.url)
    if target == "api":
        first.proc.send_signal(sig)
    elif target == "engine":
        os.kill(engine_pid, sig)
    else:
        os.killpg(first.proc.pid, sig)
    assert first.proc.wait(60) == 0, first.log()
    log = first.log()
    flushed = re.search(r"flushed (\d+) blocks to disk", log)
    assert flushed and int(flushed.group(1)) >= 18, log
    assert "stopped unexpectedly" not in log and "ERROR" not in log, log
    if target == "engine":
        assert f"engine process got {signal.Signals(sig).name}" in log, log
    assert not os.path.exists(f"/proc/{engine_pid}") or _is_zombie(engine_pid)

    second = start_app("--model", "tiny", "--disk-cache", folder, config=PATIENT_READS)  # the restart
    warm, cached = _complete(second.url, prompt)
    assert warm == cold
    assert cached == 288
    assert _tiers(second.url)["disk"]["hits"] >= 18
