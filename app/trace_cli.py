"""`kvgate trace export` and `kvgate trace replay`: request traces in the Mooncake layout.

`export` fetches `GET /admin/trace` and writes its JSON lines to a file. `replay` reads a trace
(KVGate's export or a public Mooncake file: `{"timestamp", "input_length", "output_length",
"hash_ids"}` per line) and sends it to a server: each hash id becomes `block_tokens` token ids
drawn from a generator seeded by the id, so requests that share leading ids share those prompt
blocks exactly, as the traced requests did, and nothing else. Requests go out at their
`timestamp / speed` (streaming, with usage), and the summary gives the hit rate
(cached / prompt tokens, as the server reports them) and TTFT percentiles.

What a synthetic prompt cannot repeat: reuse of a previous answer's tokens (a chat turn that
quotes the model's last reply), since the replayed answers are other tokens.

HTTP goes through the standard library (`http.client`, `urllib`): `kvgate trace` works with the
base install, whose HTTP clients (httpx, in the dev extra) are not there. Replay requests run in
a pool of `concurrency` threads, each with its own keep-alive connection.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import os
import random
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, TextIO

from app.trace import MOONCAKE_BLOCK_TOKENS

EXIT_FAILED = 1  # the server could not be reached, refused the key, or some requests failed
EXIT_USAGE = 2  # a bad file or argument: fix the command and rerun

CONNECT_TIMEOUT_S, READ_TIMEOUT_S = 10.0, 600.0
# what fails to reach a server or breaks a connection: refused, reset, timed out, a garbled reply
TRANSPORT_ERRORS = (OSError, http.client.HTTPException)
TOKEN_LOW, TOKEN_HIGH = 100, 1000  # synthetic token ids: inside any vocabulary, above most special tokens
_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


class TraceError(Exception):
    """One line for the user: what is wrong and what to do; `code` is the exit status."""

    def __init__(self, message: str, code: int = EXIT_USAGE) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True, slots=True)
class TraceLine:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: list[int]


@dataclass(slots=True)
class Outcome:
    """One replayed request: TTFT and usage, or why it failed."""

    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class Summary:
    requests: int = 0
    failures: int = 0
    clipped: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    duration_s: float = 0.0
    first_error: str | None = None
    context: int | None = None  # the server's max_model_len

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        ttft = {f"p{q}": percentile(self.ttfts_s, q) for q in (50, 90, 99)}
        return {"requests": self.requests, "failures": self.failures, "clipped": self.clipped,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "hit_rate": self.hit_rate, "ttft_s": ttft, "duration_s": self.duration_s,
                "first_error": self.first_error}


# ------------------------------------------------------------------ common


def base_url(url: str) -> str:
    """The server's root: `http://h:p`, `http://h:p/` and `http://h:p/v1` all work."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise TraceError(f"--url {url!r} is not an http(s) URL; pass e.g. --url http://127.0.0.1:8000")
    return url


def auth_headers(api_key: str | None) -> dict[str, str]:
    key = api_key or os.environ.get("KVGATE_API_KEY")
    return {"Authorization": f"Bearer {key}"} if key else {}


def _unreachable(url: str, exc: Exception) -> TraceError:
    return TraceError(f"cannot reach the server at {url} ({type(exc).__name__}: {exc}); start it "
                      f"(kvgate serve) or pass the right --url", EXIT_FAILED)


@dataclass(frozen=True, slots=True)
class Reply:
    """A whole HTTP response, read."""

    status: int
    reason: str
    text: str
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.text)


def _http_error(what: str, reply: Reply, key_hint: str) -> TraceError:
    if reply.status == 401:
        return TraceError(f"{what}: the server wants an API key ({_error_message(reply)}); pass "
                          f"--api-key {key_hint} or set KVGATE_API_KEY", EXIT_FAILED)
    if reply.status == 404:
        return TraceError(f"{what}: not found (404): is --url a KVGate server?", EXIT_FAILED)
    return TraceError(f"{what}: the server answered {reply.status}: {_error_message(reply)}", EXIT_FAILED)


def _error_message(reply: Reply) -> str:
    try:
        return str(reply.json()["error"]["message"])
    except Exception:
        return reply.text.strip()[:200] or reply.reason


def http_get(url: str, headers: dict[str, str], timeout: float) -> Reply:
    """GET ``url``; an error status is a `Reply` too, a transport failure one of `TRANSPORT_ERRORS`."""
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Reply(response.status, response.reason, response.read().decode("utf-8", "replace"),
                         dict(response.headers.items()))
    except urllib.error.HTTPError as exc:
        with exc:
            return Reply(exc.code, str(exc.reason), exc.read().decode("utf-8", "replace"), dict(exc.headers.items()))
    except urllib.error.URLError as exc:
        reason = exc.reason
        raise reason if isinstance(reason, OSError) else ConnectionError(str(reason)) from None


class Client:
    """Blocking HTTP/1.1 to one server, one keep-alive connection per thread.

    A connection the server closed while it sat idle (uvicorn drops them after 5 s) fails on
    reuse before any reply: the request is then sent once more on a new connection.
    """

    def __init__(self, root: str, headers: dict[str, str]) -> None:
        parts = urllib.parse.urlsplit(root)
        self._https = parts.scheme == "https"
        self._host, self._port = parts.hostname or "127.0.0.1", parts.port
        self._prefix = parts.path.rstrip("/")
        self._headers = headers
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection, and whether it served a request before."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            return conn, True
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = kind(self._host, self._port, timeout=CONNECT_TIMEOUT_S)
        conn.connect()
        assert conn.sock is not None
        conn.sock.settimeout(READ_TIMEOUT_S)
        self._local.conn = conn
        with self._lock:
            self._all.append(conn)
        return conn, False

    def drop(self) -> None:
        """Close this thread's connection (after a failure that left it mid-reply)."""
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
            self._local.conn = None

    def open(self, method: str, path: str, body: Any = None) -> http.client.HTTPResponse:
        """Send a request; returns the response with its body unread (read it all before the
        next request of this thread)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {**self._headers, **({"Content-Type": "application/json"} if data is not None else {})}
        while True:
            conn, reused = self._connection()
            try:
                conn.request(method, self._prefix + path, body=data, headers=headers)
                response = conn.getresponse()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.drop()
                if reused:
                    continue
                raise
            except BaseException:
                self.drop()
                raise
            if response.will_close:
                self._local.conn = None  # the server closes it after this reply
            return response

    def get(self, path: str) -> Reply:
        try:
            with self.open("GET", path) as response:
                return Reply(response.status, response.reason, response.read().decode("utf-8", "replace"),
                             dict(response.getheaders()))
        except BaseException:
            self.drop()
            raise

    def close(self) -> None:
        """Close every connection, also those a thread is reading from (they fail at once)."""
        with self._lock:
            conns, self._all = self._all, []
        for conn in conns:
            sock = conn.sock
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            conn.close()


# ------------------------------------------------------------------ export


def export(url: str, api_key: str | None, out: str, limit: int | None, block_tokens: int,
           stderr: TextIO = sys.stderr) -> int:
    """Write the server's trace to `out` ('-': stdout); returns the exit status."""
    root = base_url(url)
    params: dict[str, int] = {"block_tokens": block_tokens}
    if limit is not None:
        params["limit"] = limit
    try:
        response = http_get(f"{root}/admin/trace?{urllib.parse.urlencode(params)}", auth_headers(api_key), 120)
    except TRANSPORT_ERRORS as exc:
        raise _unreachable(root, exc) from None
    if response.status != 200:
        raise _http_error("GET /admin/trace", response, "<admin key>")
    body = response.text
    count = body.count("\n")
    used = next((value for name, value in response.headers.items() if name.lower() == "x-kvgate-block-tokens"),
                str(block_tokens))
    if out == "-":
        sys.stdout.write(body)
        sys.stdout.flush()
    else:
        try:
            Path(out).write_text(body)
        except OSError as exc:
            raise TraceError(f"cannot write {out}: {exc.strerror or exc}; pass another --out") from None
    where = "stdout" if out == "-" else out
    hint = "Mooncake's block size" if used == str(MOONCAKE_BLOCK_TOKENS) else \
        f"replay with: kvgate trace replay {where} --block-tokens {used}"
    print(f"kvgate: wrote {count} requests to {where}; block_tokens={used} ({hint})", file=stderr)
    if count == 0:
        print("kvgate: the trace is empty: no generation request has finished since the server started",
              file=stderr)
    return 0


# ------------------------------------------------------------------ reading a trace


def read_trace(path: str) -> list[TraceLine]:
    """Every record of a JSON-lines trace; a bad line is a `TraceError` naming file and line."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise TraceError(f"cannot read {path}: no such file; pass the path of a JSON-lines trace "
                         f"(kvgate trace export writes one)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read {path}: {exc}; pass a JSON-lines trace file") from None
    lines = [parse_line(path, number, raw) for number, raw in enumerate(text.splitlines(), 1) if raw.strip()]
    if not lines:
        raise TraceError(f"{path} holds no records; a trace has one JSON object per line")
    return lines


def parse_line(path: str, number: int, raw: str) -> TraceLine:
    where = f"{path}:{number}"
    try:
        item = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg}); each line must be one object like "
                         f'{{"timestamp": 0, "input_length": 600, "output_length": 20, "hash_ids": [0, 1]}}') from None
    if not isinstance(item, dict):
        raise TraceError(f"{where}: a line must be a JSON object, not {type(item).__name__}")
    missing = [name for name in _FIELDS if name not in item]
    if missing:
        raise TraceError(f"{where}: missing {', '.join(missing)}; Mooncake records have "
                         f"{', '.join(_FIELDS)}")
    timestamp, hash_ids = item["timestamp"], item["hash_ids"]
    if not _number(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a number of milliseconds >= 0, not {timestamp!r}")
    for name in ("input_length", "output_length"):
        if not _integer(item[name]) or item[name] < 0:
            raise TraceError(f"{where}: {name} must be an integer >= 0, not {item[name]!r}")
    if not isinstance(hash_ids, list) or not all(_integer(h) for h in hash_ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    return TraceLine(float(timestamp), item["input_length"], item["output_length"], hash_ids)


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ------------------------------------------------------------------ synthetic prompts


@lru_cache(maxsize=8192)
def block_token_ids(hash_id: int, block_tokens: int, seed: int = 0) -> tuple[int, ...]:
    """The same `block_tokens` token ids for the same hash id (and seed), in every run and process."""
    rng = random.Random(f"kvgate-block:{seed}:{block_tokens}:{hash_id}")
    return tuple(rng.choices(range(TOKEN_LOW, TOKEN_HIGH), k=block_tokens))


def synthesize(line: TraceLine, index: int, block_tokens: int, length: int, seed: int = 0) -> list[int]:
    """`length` prompt tokens: the blocks of `line.hash_ids`, then tokens of this request alone."""
    tokens: list[int] = []
    for hash_id in line.hash_ids:
        if len(tokens) >= length:
            break
        tokens.extend(block_token_ids(hash_id, block_tokens, seed))
    if len(tokens) < length:  # fewer ids than blocks: the rest is shared with nobody
        rng = random.Random(f"kvgate-unique:{seed}:{index}")
        tokens.extend(rng.choices(range(TOKEN_LOW, TOKEN_HIGH), k=length - len(tokens)))
    return tokens[:length]


def blocks_mismatch(lines: list[TraceLine], block_tokens: int) -> int:
    """Lines whose number of hash ids is not ceil(input_length / block_tokens)."""
    return sum(len(line.hash_ids) != math.ceil(line.input_length / block_tokens) for line in lines)


# ------------------------------------------------------------------ replay


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    url: str
    api_key: str | None = None
    speed: float = 1.0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    max_requests: int | None = None
    max_output_tokens: int | None = None
    concurrency: int = 64
    model: str | None = None
    seed: int = 0


def replay(path: str, options: ReplayOptions, as_json: bool = False,
           stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr) -> int:
    """Replay the trace at `path`; prints the summary; returns the exit status."""
    _check_options(options)
    lines = sorted(read_trace(path), key=lambda line: line.timestamp_ms)  # stable: ties keep file order
    if options.max_requests is not None:
        lines = lines[:options.max_requests]
    mismatched = blocks_mismatch(lines, options.block_tokens)
    if mismatched:
        print(f"kvgate: warning: {mismatched} of {len(lines)} lines do not have ceil(input_length / "
              f"{options.block_tokens}) hash ids: was the trace written with another block size? "
              f"(kvgate trace export prints it; pass --block-tokens)", file=stderr)
    summary = asyncio.run(_replay(lines, options, stderr))
    if summary.clipped:
        print(f"kvgate: warning: {summary.clipped} of {summary.requests} prompts did not fit the server's "
              f"context ({summary.context} tokens) and were clipped", file=stderr)
    print(json.dumps(summary.as_dict()) if as_json else format_summary(path, options, summary), file=stdout)
    if summary.failures:
        print(f"kvgate: error: {summary.failures} of {summary.requests} requests failed; first: "
              f"{summary.first_error}", file=stderr)
        return EXIT_FAILED
    return 0


def _check_options(options: ReplayOptions) -> None:
    if options.speed < 0 or not math.isfinite(options.speed):
        raise TraceError("--speed must be a number >= 0 (1 = the trace's pace, 0 = as fast as --concurrency allows)")
    for name, value in (("--block-tokens", options.block_tokens), ("--concurrency", options.concurrency),
                        ("--max-requests", options.max_requests),
                        ("--max-output-tokens", options.max_output_tokens)):
        if value is not None and value < 1:
            raise TraceError(f"{name} must be at least 1, not {value}")


async def _replay(lines: list[TraceLine], options: ReplayOptions, stderr: TextIO) -> Summary:
    root = base_url(options.url)
    client = Client(root, auth_headers(options.api_key))
    pool = ThreadPoolExecutor(max_workers=options.concurrency, thread_name_prefix="kvgate-replay")
    try:
        model, max_len = _server_model(client, root, options.model)
        summary = Summary(requests=len(lines), context=max_len)
        progress = Progress(len(lines), stderr)
        gate = asyncio.Semaphore(options.concurrency)
        tasks: list[asyncio.Task[None]] = []
        start = time.perf_counter()
        for index, line in enumerate(lines):
            if options.speed:
                delay = start + line.timestamp_ms / 1000 / options.speed - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
            await gate.acquire()  # requests start in trace order, at most `concurrency` at a time
            body = _request_body(line, index, model, max_len, options, summary)
            tasks.append(asyncio.create_task(_run_one(pool, client, body, gate, summary, progress)))
        await asyncio.gather(*tasks)
        summary.duration_s = time.perf_counter() - start
        progress.close()
    finally:
        client.close()  # also ends the requests of an interrupted replay
        pool.shutdown(wait=True, cancel_futures=True)
    return summary


def _server_model(client: Client, root: str, model: str | None) -> tuple[str, int | None]:
    """The model to ask for and the server's context length, from `GET /v1/models`."""
    try:
        response = client.get("/v1/models")
    except TRANSPORT_ERRORS as exc:
        raise _unreachable(root, exc) from None
    if response.status != 200:
        raise _http_error("GET /v1/models", response, "<tenant key>")
    cards = response.json().get("data") or []
    card = next((c for c in cards if model is None or c.get("id") == model), None)
    if card is None:
        served = ", ".join(str(c.get("id")) for c in cards) or "none"
        raise TraceError(f"the server does not serve model {model!r} (it serves: {served}); fix --model",
                         EXIT_FAILED)
    return str(card["id"]), card.get("max_model_len")


def _request_body(line: TraceLine, index: int, model: str, max_len: int | None, options: ReplayOptions,
                  summary: Summary) -> dict[str, Any]:
    max_tokens = max(1, line.output_length)
    if options.max_output_tokens is not None:
        max_tokens = min(max_tokens, options.max_output_tokens)
    length = max(1, line.input_length)
    if max_len is not None and length + max_tokens > max_len:
        if length >= max_len:  # the prompt alone does not fit: clip it, leaving room for the output
            max_tokens = max(1, min(max_tokens, max_len // 2))
            length = max_len - max_tokens
            summary.clipped += 1
        else:  # the prompt fits: the output stops at the end of the context
            max_tokens = max_len - length
    return {"model": model, "prompt": synthesize(line, index, options.block_tokens, length, options.seed),
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def _run_one(pool: ThreadPoolExecutor, client: Client, body: dict[str, Any], gate: asyncio.Semaphore,
                   summary: Summary, progress: Progress) -> None:
    try:
        outcome = await asyncio.get_running_loop().run_in_executor(pool, _stream, client, body)
    except (*TRANSPORT_ERRORS, ValueError) as exc:  # transport failures, a malformed event
        outcome = Outcome(error=f"{type(exc).__name__}: {exc}")
    finally:
        gate.release()
    if outcome.error is not None:
        summary.failures += 1
        summary.first_error = summary.first_error or outcome.error
    else:
        summary.prompt_tokens += outcome.prompt_tokens
        summary.cached_tokens += outcome.cached_tokens
        if outcome.ttft_s is not None:
            summary.ttfts_s.append(outcome.ttft_s)
    progress.update(failed=outcome.error is not None)


def _stream(client: Client, body: dict[str, Any]) -> Outcome:
    """One streamed completion (on a pool thread): time to the first token, and the final usage chunk."""
    outcome = Outcome()
    sent = time.perf_counter()
    try:
        with client.open("POST", "/v1/completions", body) as response:
            if response.status != 200:
                reply = Reply(response.status, response.reason, response.read().decode("utf-8", "replace"), {})
                return Outcome(error=f"{reply.status}: {_error_message(reply)}")
            _read_events(response, outcome, sent)
    except BaseException:
        client.drop()  # a connection left mid-reply cannot carry the next request
        raise
    return Outcome(error=outcome.error) if outcome.error else outcome


def _read_events(response: http.client.HTTPResponse, outcome: Outcome, sent: float) -> None:
    """The server-sent events of a completion stream, into ``outcome``."""
    for line in response:
        raw = line.decode("utf-8").rstrip("\r\n")
        if not raw.startswith("data: ") or raw == "data: [DONE]":
            continue
        chunk = json.loads(raw[6:])
        if "error" in chunk:  # read on to the end all the same: the connection carries the next request
            outcome.error = outcome.error or f"stream error: {chunk['error'].get('message')}"
            continue
        if chunk.get("choices") and outcome.ttft_s is None:
            outcome.ttft_s = time.perf_counter() - sent
        usage = chunk.get("usage")
        if usage:
            outcome.prompt_tokens = usage.get("prompt_tokens", 0)
            outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


class Progress:
    """A tqdm bar on a terminal; elsewhere a plain line at every tenth of the requests."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream, self.done, self.failed = total, stream, 0, 0
        self._bar: Any = None
        if _is_terminal(stream):
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="req", desc="replay", file=stream, dynamic_ncols=True)

    def update(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        if self._bar is not None:
            self._bar.update(1)
            if failed:
                self._bar.set_postfix(failed=self.failed)
            return
        step = max(1, self.total // 10)
        if self.done % step == 0 or self.done == self.total:
            print(f"replay: {self.done}/{self.total} requests done ({self.failed} failed)", file=self.stream,
                  flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


# ------------------------------------------------------------------ summary


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile, interpolated between the closest ranks (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def format_summary(path: str, options: ReplayOptions, summary: Summary) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value * 1000:.1f} ms"

    rows = [
        ("trace", f"{path} (block_tokens={options.block_tokens}, speed={options.speed:g})"),
        ("requests", str(summary.requests)),
        ("failures", str(summary.failures)),
        ("clipped", str(summary.clipped)),
        ("prompt tokens", f"{summary.prompt_tokens:,}"),
        ("cached tokens", f"{summary.cached_tokens:,}"),
        ("hit rate", f"{summary.hit_rate * 100:.1f} %"),
        ("TTFT p50", ms(percentile(summary.ttfts_s, 50))),
        ("TTFT p90", ms(percentile(summary.ttfts_s, 90))),
        ("TTFT p99", ms(percentile(summary.ttfts_s, 99))),
        ("duration", f"{summary.duration_s:.1f} s"),
    ]
    return "\n".join(f"{name:<14} {value}" for name, value in rows)
