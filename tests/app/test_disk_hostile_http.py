"""The disk tier against a hostile or broken folder, seen over HTTP (issue 38): named pipes and
links in place of block files hang nothing and are not followed, a vanished folder is recreated
or reported unhealthy, and `POST /admin/tiers` refuses folders it must not use and stores that do
not answer, with short replies (issue 39)."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.app.conftest import assert_error, free_port
from tests.app.test_tiers_http import _complete, _ids

LOAD_TIMEOUT_S = 2.0
NO_HOST = f"""
[model]
path = "tiny"

[engine]
# Steps this small never measure the prefill rate, so a disk hit is always loaded rather than
# weighed against recomputing (the tiny model recomputes faster than a disk read's latency).
max_num_batched_tokens = 128

[cache]
block_size = 16

[cache.device]
num_blocks = 48

[cache.host]
capacity_mb = 0

[cache.disk]
load_timeout_s = {LOAD_TIMEOUT_S}
persist = "on_evict"  # only evicted blocks reach the folder: its files are the prompt's, nothing rewrites them
"""
PROMPT_BLOCKS = 18  # full blocks of a 300-token prompt


def _metrics(url: str) -> dict:
    response = httpx.get(url + "/admin/metrics", timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def _on_disk(url: str, folder: Path, seed: int) -> tuple[list[int], str, list[Path]]:
    """A prompt served once, then pushed off the device pool (no host tier: straight to disk);
    its prompt, text, and the block files in the folder once every write landed."""
    prompt = _ids(seed, 300)
    text, cached = _complete(url, prompt)
    assert cached == 0
    for other in (seed + 100, seed + 200):  # two long prompts take the whole pool
        _complete(url, _ids(other, 600), max_tokens=1)
    deadline = time.monotonic() + 30
    while True:
        tiers = _metrics(url)["tiers"]
        if tiers["disk"]["blocks"] >= PROMPT_BLOCKS and tiers["chain"]["pending_writes"] == 0:
            break
        assert time.monotonic() < deadline, f"blocks never reached the disk: {tiers}"
        time.sleep(0.05)
    return prompt, text, sorted(folder.glob("*/*.kvb"))


def test_named_pipes_in_place_of_block_files_hang_nothing(start_server, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    server = start_server("--disk-cache", str(folder), config=NO_HOST)
    prompt, cold, files = _on_disk(server.url, folder, seed=1)
    for path in files:
        path.unlink()
        os.mkfifo(path)
    try:
        waited = _metrics(server.url)["tiers"]["chain"]["prefetch_wait_s"]
        t0 = time.monotonic()
        warm, cached = _complete(server.url, prompt)
        assert time.monotonic() - t0 < 10 * LOAD_TIMEOUT_S
        assert warm == cold and cached == 0  # recomputed, same text
        tiers = _metrics(server.url)["tiers"]
        assert tiers["chain"]["prefetch_wait_s"] - waited < LOAD_TIMEOUT_S  # within the deadline
        assert tiers["disk"]["corrupt"] >= PROMPT_BLOCKS and tiers["chain"]["inflight_reads"] == 0
        assert sum(not os.path.lexists(p) for p in files) >= PROMPT_BLOCKS  # the pipes read were removed
        again, _ = _complete(server.url, prompt)  # nothing is left stuck for the next request
        assert again == cold
    finally:
        for path in files:  # let go of a reader blocked on a pipe (the bug), so the server can stop
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def test_links_in_place_of_block_files_are_not_followed(start_app, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    server = start_app("--disk-cache", str(folder), config=NO_HOST)
    prompt, cold, files = _on_disk(server.url, folder, seed=2)
    outside = tmp_path / "outside"
    outside.mkdir()
    for i, path in enumerate(files):  # each a link to its own valid record: followed, it would be served
        if i == 0:
            path.unlink()
            path.symlink_to("/etc/passwd")
        else:
            target = outside / path.name
            shutil.move(path, target)
            path.symlink_to(target)
    warm, cached = _complete(server.url, prompt)
    assert warm == cold and cached == 0
    disk = _metrics(server.url)["tiers"]["disk"]
    assert disk["corrupt"] >= PROMPT_BLOCKS and disk["hits"] == 0
    assert sum(not os.path.lexists(p) for p in files) >= PROMPT_BLOCKS  # the links were removed
    assert len(list(outside.iterdir())) == len(files) - 1  # their targets were not
    prometheus = httpx.get(server.url + "/metrics", timeout=30).text  # damaged, not of an unknown codec
    assert f'kvgate_tier_corrupt_blocks_total{{tier="disk"}} {float(disk["corrupt"])}' in prometheus
    assert 'kvgate_tier_undecodable_blocks_total{tier="disk"} 0.0' in prometheus


def test_a_vanished_folder_is_recreated_or_reported_until_it_is_back(start_app, tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    server = start_app("--disk-cache", str(folder), config=NO_HOST)
    url = server.url
    prompt, cold, files = _on_disk(url, folder, seed=3)
    blocks = files[0].parent
    shutil.rmtree(blocks)
    disk = _metrics(url)["tiers"]["disk"]
    assert disk["blocks"] == 0 and disk["lost"] >= PROMPT_BLOCKS and disk["healthy"] is True
    assert blocks.is_dir()  # recreated
    # a file in its place: the folder cannot be made again, and every view says so
    shutil.rmtree(blocks)
    blocks.write_text("not a folder")
    disk = _metrics(url)["tiers"]["disk"]
    assert disk["healthy"] is False and "cannot be recreated" in disk["unhealthy_reason"]
    archetype = httpx.get(url + "/admin/archetype", timeout=30).json()
    assert archetype["tiers"]["disk"]["healthy"] is False and not archetype["tiers"]["disk"]["active"]
    assert "disk tier configured but down" in archetype["reason"]
    assert "kvgate_tier_up{tier=\"disk\"} 0.0" in httpx.get(url + "/metrics", timeout=30).text
    warm, _ = _complete(url, prompt)  # serving goes on without it
    assert warm == cold
    blocks.unlink()  # back
    disk = _metrics(url)["tiers"]["disk"]
    assert disk["healthy"] is True and disk["unhealthy_reason"] is None and blocks.is_dir()
    assert httpx.get(url + "/admin/archetype", timeout=30).json()["tiers"]["disk"]["healthy"] is True


# ---- attaching over HTTP ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def attach_server(start_app, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A server without a disk tier whose `[cache.disk] allowed_root` is a folder of its own."""
    root = tmp_path_factory.mktemp("allowed")
    server = start_app("--disk-cache", "off", config=NO_HOST + f'allowed_root = "{root}"\n')
    yield server.url, root


def _change(server_url: str, **body: object) -> httpx.Response:
    return httpx.post(server_url + "/admin/tiers", json=body, timeout=30)


@pytest.mark.parametrize(("path", "why"), [
    ("/etc", "system folder /etc"),
    ("kv-relative", "must be absolute"),
    ("/tmp/not-in-the-allowed-root", "allowed_root"),
])
def test_attach_refuses_folders_it_must_not_use(attach_server: tuple[str, Path], path: str, why: str) -> None:
    url, _ = attach_server
    before = sorted(os.listdir("/etc"))
    error = assert_error(_change(url, action="attach", tier="disk", path=path), 400)
    assert why in error["message"]
    assert sorted(os.listdir("/etc")) == before
    assert "disk" not in httpx.get(url + "/admin/tiers", timeout=30).json()["tiers"]


def test_attach_refuses_a_link_out_of_the_allowed_root(attach_server: tuple[str, Path]) -> None:
    url, root = attach_server
    (root / "to-etc").symlink_to("/etc")
    try:
        error = assert_error(_change(url, action="attach", tier="disk", path=str(root / "to-etc" / "kv")), 400)
        assert "system folder /etc" in error["message"]
    finally:
        (root / "to-etc").unlink()


def test_attach_and_detach_answer_what_changed(attach_server: tuple[str, Path], redis_url: str) -> None:
    url, root = attach_server
    attached = _change(url, action="attach", tier="disk", path=str(root / "kv"), capacity_mb=4)
    assert attached.status_code == 200, attached.text
    body = attached.json()
    assert set(body) == {"ok", "action", "tier", "path", "capacity_blocks", "healthy"}
    assert body["ok"] is True and (body["action"], body["tier"], body["healthy"]) == ("attach", "disk", True)
    assert body["path"].startswith(str(root / "kv")) and body["capacity_blocks"] > 0
    assert _change(url, action="detach", tier="disk").json() == {"ok": True, "action": "detach", "tier": "disk"}
    remote = _change(url, action="attach", tier="remote", url=redis_url)
    assert remote.status_code == 200, remote.text
    assert remote.json() == {"ok": True, "action": "attach", "tier": "remote", "url": redis_url, "healthy": True}
    assert _change(url, action="detach", tier="remote").json()["ok"] is True


def test_attach_refuses_a_store_nobody_listens_at(attach_server: tuple[str, Path]) -> None:
    url, _ = attach_server
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    error = assert_error(_change(url, action="attach", tier="remote", url=nowhere), 400)
    assert "cannot reach the remote store" in error["message"] and "not attached" in error["message"]
    assert "Connect" in error["message"] or "connect" in error["message"]  # the connection error itself
    assert "remote" not in httpx.get(url + "/admin/tiers", timeout=30).json()["tiers"]
