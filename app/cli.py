"""The `kvgate` command: `serve`, `route` (`app.router.cli`), `build-tiny-model` and `trace
export|replay` (`app.trace_cli`).

Heavy imports (torch, transformers, the app) happen inside the subcommands, and `serve` checks
what can fail fast (the configuration, the listening address, whether the model exists) before
anything slow starts, so each of those answers at once with one line and a non-zero status.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger("app.cli")

EXIT_FATAL = 1  # the model failed to load after start, or the engine process kept crashing
EXIT_USAGE = 2  # bad configuration, address in use, model not found: fix the command and rerun

_SERVE_EPILOG = """\
configuration:
  TOML file from --config, else $KVGATE_CONFIG, else built-in defaults; flags override it.
  Sections: [model] path/dtype/max_model_len, [server] host/port/max_queue/secret/
  max_body_bytes/shutdown_timeout_s/max_fanout (most engine sequences one request may start,
  prompts x n; default 128)/docs (public|auth|off: /docs and /openapi.json; default public,
  auth once tenants exist)/role (both: a whole replica, default; prefill or decode: one side of a
  Disaggregated-Pipeline, the KV shipped through [cache.remote]; docs/disaggregated.md), [engine] device/max_num_seqs/max_num_batched_tokens/
  num_threads/enable_prefix_caching/pack_weights/native_kernels (CPU attention kernel and
  fused ops, built once with the machine's C++ compiler)/fast_decoder (Llama-family layers
  without transformers' modules)/metrics (TTFT parts and block lives in
  /admin/metrics; default true), [cache] block_size/eviction (lru|s3fifo)/admit (always:
  every block leaving CPU memory goes to disk; second_use: only blocks a later request reused,
  or computed again after being dropped; default always),
  [cache.device] num_blocks, [cache.host] capacity_mb (0 = off), [cache.disk] path/capacity_mb
  (0 = off)/persist (behind: blocks are also written in the background as computed, so a
  crash loses only the last moments'; idle: the same, on idle CPU only, which under full load
  keeps throughput and writes only what leaves CPU memory; on_evict: a block is written when it
  leaves CPU memory, and all at a stop; default behind)/behind_delay_s (behind: while steps run
  back to back a block's write waits up to this long, at once when the engine idles; a crash
  under load loses at most this long's blocks; default 10, 0 = write at once)/codec (none: lossless, default; fp16: half the bytes,
  99.98 % top-1 agreement; bf16: half, 99.91 %; int8: a quarter, 98.60 % top-1 agreement, below
  99 %: greedy output after a hit may differ from a cold run; docs/benchmarks.md)/load_timeout_s (deadline of one batch of block reads; default 0.5)/allowed_root
  (where POST /admin/tiers may attach a disk tier), [cache.remote] url/cluster/ttl_s/write
  (through: every block as computed; back: as it leaves CPU memory, if admitted; selective: on
  its first reuse; default through)/codec (as [cache.disk]; section absent = off),
  [events] endpoint (a ZMQ PUB address such as tcp://*:5557: every block stored or dropped is
  announced in vLLM's KV event layout, for `kvgate route`; unset = off)/replay_endpoint/topic/
  max_queue (docs/events.md),
  [admin] api_key, [[tenants]] name/api_keys/share_group/quota, [[public_prefixes]]
  name/text|system|token_ids (shared by every tenant). Unknown keys are errors.

environment:
  KVGATE_CONFIG     config file when --config is absent
  KVGATE_CACHE_DIR  cache folder (models, server secret, disk KV tier, CPU kernel builds);
                    default ~/.cache/kvgate
  KVGATE_KERNEL_DIR where the native CPU kernels are built (default <KVGATE_CACHE_DIR>/kernels)
  CXX               C++ compiler for those kernels (default c++ or g++ on PATH)
  KVGATE_SECRET     server secret for tenant salts when [server] secret is absent
  HF_HUB_OFFLINE=1  a hub id is served only from the local Hugging Face cache (no network)
  THP_MEM_ALLOC_ENABLE  1 (set unless given): torch puts the KV pool and weights on transparent
                    huge pages where the kernel allows; 0 keeps 4 KiB pages

KV-cache tiers: device blocks evicted from the pool move to CPU memory (--host-cache-mb, on
  by default), then to files on disk (--disk-cache, on by default); with --remote-cache they are
  also shared through Redis with every replica on the same store. A later request with the same
  prefix loads them instead of recomputing, also after a restart.

signals: SIGTERM or Ctrl-C (SIGINT), to the server, to its engine process or to the whole
  process group, drains: new requests get 503 with Retry-After while in-flight ones get
  [server] shutdown_timeout_s to finish; the engine writes its cached blocks to the disk tier;
  then the server exits 0. A second one exits at once (sent to the server).
  SIGHUP re-reads the config file's [[tenants]] and [admin] (as POST /admin/reload does): a removed
  key stops working at once, running requests finish; a broken file is logged and changes nothing.

exit status: 0 after a drain; 1 if the model failed to load or the engine process kept
  crashing; 2 for a bad configuration, an address in use or a model that cannot be found
  (checked before anything slow starts).

examples:
  kvgate serve --model tiny --port 8000
  kvgate serve --host-cache-mb 4096 --disk-cache /mnt/nvme/kvgate
  kvgate serve --remote-cache redis://127.0.0.1:6379/0
  kvgate serve --host-cache-mb 0 --disk-cache off     # device pool only
  kvgate serve --config /etc/kvgate.toml
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvgate",
        description="KVGate: an OpenAI-compatible LLM server whose KV cache is a memory hierarchy.",
    )
    parser.add_argument("--version", action="version", version="kvgate 0.1.0")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve /v1/models, /v1/completions and /v1/chat/completions (plus /health, "
                    "/ready, /admin/metrics, /admin/tiers, /admin/archetype). With nothing configured it serves "
                    "SmolLM2-135M-Instruct on 127.0.0.1:8000 without auth.",
        epilog=_SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--config", metavar="FILE", help="TOML configuration file (default: $KVGATE_CONFIG)")
    serve.add_argument("--model", metavar="PATH_OR_ID",
                       help="any local Hugging Face folder (Llama, Qwen2, Mistral), a hub id, 'tiny' "
                            "(built test model) or 'default' (SmolLM2-135M-Instruct from a 4-bit GGUF; "
                            "overrides [model] path)")
    serve.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                       help="weights and KV cache dtype (overrides [model] dtype; default float32). bfloat16 "
                            "halves memory; its matmuls run on the CPU's bfloat16 instructions (AVX512-BF16) "
                            "where present, else widened to float32 on AVX2")
    serve.add_argument("--host", metavar="H", help="address to bind (overrides [server] host; default 127.0.0.1)")
    serve.add_argument("--port", metavar="P", type=int, help="port to bind (overrides [server] port; default 8000)")
    serve.add_argument("--host-cache-mb", metavar="N", type=int,
                       help="CPU-memory KV tier size in MiB; 0 turns it off (overrides [cache.host] "
                            "capacity_mb; default 1024)")
    serve.add_argument("--disk-cache", metavar="PATH|off",
                       help="folder of the local-disk KV tier, or 'off' (overrides [cache.disk] path; "
                            "default <KVGATE_CACHE_DIR>/kv, 10 GiB)")
    serve.add_argument("--remote-cache", metavar="URL|off",
                       help="Redis URL of the shared KV tier (redis://host:port/db), or 'off' (overrides "
                            "[cache.remote] url; default off)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log level (default: info)")
    serve.set_defaults(func=_serve)

    from app.router.cli import add_parser as add_route_parser

    add_route_parser(commands)

    tiny = commands.add_parser(
        "build-tiny-model", help="write a small deterministic Llama model + tokenizer to DIR",
        description="Write a small deterministic Llama-architecture causal LM and its ChatML "
                    "tokenizer to DIR, loadable offline with AutoModelForCausalLM/AutoTokenizer. "
                    "The same seed and size always give identical files.")
    tiny.add_argument("dir", metavar="DIR", help="output folder (created if missing)")
    tiny.add_argument("--seed", type=int, default=0, metavar="N", help="weights seed (default: 0)")
    tiny.add_argument("--size", choices=["tiny", "small"], default="tiny",
                      help="tiny: ~1 MB, for tests; small: ~110 MB (default: tiny)")
    tiny.set_defaults(func=_build_tiny_model)
    _add_trace_parser(commands)
    return parser


_TRACE_EPILOG = """\
format: one JSON object per line, the layout of Mooncake's public traces:
  {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}
  timestamp: ms from the first request; hash_ids: one per block of block_tokens prompt tokens (the
  last one partial); equal ids at a position mean the same prompt up to the end of that block.
  No token, text, tenant, key or salt is in a trace (docs/traces.md).

examples:
  kvgate trace export --url http://127.0.0.1:8000 --out trace.jsonl
  kvgate trace export --url http://127.0.0.1:8000 --out trace.jsonl --block-tokens 16
  kvgate trace replay trace.jsonl --url http://127.0.0.1:8001 --block-tokens 16
  kvgate trace replay mooncake_trace.jsonl --url http://127.0.0.1:8000 --speed 10 --max-requests 500
"""


def _add_trace_parser(commands: Any) -> None:
    trace = commands.add_parser(
        "trace", help="export a server's request trace, or replay a trace against a server",
        description="Request traces in the Mooncake layout (AIPerf, guidellm and Dynamo's data "
                    "generator read them): export KVGate's from GET /admin/trace, replay KVGate's or "
                    "public ones.", epilog=_TRACE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = trace.add_subparsers(dest="trace_command", metavar="ACTION")
    key_help = "bearer key ({}); default $KVGATE_API_KEY, none if unset"

    export = actions.add_parser(
        "export", help="write the server's recent requests (GET /admin/trace) to a file",
        description="Write the server's trace ring (its most recent requests, up to 10,000) as "
                    "Mooncake JSON lines, and print how many and their block size.",
        epilog=_TRACE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    export.add_argument("--url", required=True, metavar="URL", help="server root, e.g. http://127.0.0.1:8000")
    export.add_argument("--api-key", metavar="KEY", help=key_help.format("the admin key"))
    export.add_argument("--out", default="trace.jsonl", metavar="FILE",
                        help="file to write, '-' for stdout (default: trace.jsonl)")
    export.add_argument("--limit", type=int, metavar="N", help="only the last N requests (default: all)")
    export.add_argument("--block-tokens", type=int, default=512, metavar="N",
                        help="prompt tokens per hash id: 512 (default, Mooncake's) or a multiple of the "
                             "server's KV block size; the block size itself (16 by default) makes a "
                             "replay share exactly what the cache shared")
    export.set_defaults(func=_trace_export)

    replay = actions.add_parser(
        "replay", help="send a trace's requests to a server; print hit rate and TTFT percentiles",
        description="Replay a trace (KVGate's export or a public Mooncake file) against an "
                    "OpenAI-compatible server: each hash id becomes block-tokens synthetic token ids "
                    "(the same for the same id), so prompts share exactly the traced prefixes. "
                    "Requests go out at timestamp / speed, streamed; the summary gives requests, "
                    "failures, hit rate (cached / prompt tokens from the server's usage), TTFT "
                    "p50/p90/p99 and duration. Prompts longer than the server's context are clipped.",
        epilog=_TRACE_EPILOG + "\nexit status: 0 when every request succeeded; 1 when the server "
                               "could not be reached or a request failed; 2 for a bad file or flag.\n",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    replay.add_argument("file", metavar="FILE", help="JSON-lines trace")
    replay.add_argument("--url", required=True, metavar="URL", help="server root, e.g. http://127.0.0.1:8000")
    replay.add_argument("--api-key", metavar="KEY", help=key_help.format("a tenant's key"))
    replay.add_argument("--speed", type=float, default=1.0, metavar="X",
                        help="time factor: 2 sends twice as fast as traced, 0 as fast as --concurrency "
                             "allows (default: 1)")
    replay.add_argument("--block-tokens", type=int, default=512, metavar="N",
                        help="prompt tokens per hash id, as the trace was written (default: 512, "
                             "Mooncake's; kvgate trace export prints it)")
    replay.add_argument("--max-requests", type=int, metavar="N", help="replay only the first N requests")
    replay.add_argument("--max-output-tokens", type=int, metavar="N",
                        help="cap each request's output (default: the traced output_length)")
    replay.add_argument("--concurrency", type=int, default=64, metavar="N",
                        help="most requests in flight; 1 replays strictly one after another (default: 64)")
    replay.add_argument("--model", metavar="NAME", help="model to ask for (default: the server's first)")
    replay.add_argument("--seed", type=int, default=0, metavar="N",
                        help="seed of the synthetic token ids (default: 0); another seed replays the "
                             "trace on a server that already saw it as if its cache were cold")
    replay.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    replay.set_defaults(func=_trace_replay)
    trace.set_defaults(func=lambda args: _usage_error("trace needs an action: export or replay "
                                                      "(kvgate trace --help)"))


def main(argv: list[str] | None = None) -> int:
    prefer_huge_pages()
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


def prefer_huge_pages() -> None:
    """Ask torch to put its large CPU tensors (the KV pool, the packed weights) on transparent
    huge pages, unless the user chose otherwise: a decode step streams both, and 2 MiB pages
    spare it most of the TLB misses of 4 KiB ones (docs/engine.md). Torch reads the variable at
    its first allocation, so this runs before any subcommand imports it; the engine process
    inherits it. Where the kernel's THP mode is `never` it changes nothing."""
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def _build_tiny_model(args: argparse.Namespace) -> int:
    from app.logging import progress_bars_only_on_terminal
    from engine.tiny_model import main as tiny_main

    progress_bars_only_on_terminal()

    return tiny_main([args.dir, "--seed", str(args.seed), "--size", args.size])


def _trace_export(args: argparse.Namespace) -> int:
    from app.trace_cli import TraceError, export

    try:
        return export(args.url, args.api_key, args.out, args.limit, args.block_tokens)
    except TraceError as exc:
        print(f"kvgate: error: {exc.message}", file=sys.stderr, flush=True)
        return exc.code


def _trace_replay(args: argparse.Namespace) -> int:
    from app.trace_cli import ReplayOptions, TraceError, replay

    options = ReplayOptions(url=args.url, api_key=args.api_key, speed=args.speed, block_tokens=args.block_tokens,
                            max_requests=args.max_requests, max_output_tokens=args.max_output_tokens,
                            concurrency=args.concurrency, model=args.model, seed=args.seed)
    try:
        return replay(args.file, options, as_json=args.json)
    except TraceError as exc:
        print(f"kvgate: error: {exc.message}", file=sys.stderr, flush=True)
        return exc.code
    except KeyboardInterrupt:
        print("kvgate: replay interrupted", file=sys.stderr, flush=True)
        return 130


def _serve(args: argparse.Namespace) -> int:
    from app.logging import configure_logging
    from app.settings import ConfigError, load_settings, log_settings_warnings
    from engine.model_source import ModelSourceError, check_model_source

    configure_logging(args.log_level)
    overrides = {"model.path": args.model, "model.dtype": args.dtype, "server.host": args.host, "server.port": args.port,
                 "cache.host.capacity_mb": args.host_cache_mb}
    if args.disk_cache == "off":
        overrides["cache.disk.capacity_mb"] = 0
    elif args.disk_cache is not None:
        overrides["cache.disk.path"] = args.disk_cache
    if args.remote_cache is not None:
        overrides["cache.remote.url"] = "" if args.remote_cache == "off" else args.remote_cache
    try:
        settings = load_settings(args.config, overrides)
        settings.tenant_registry()  # fail fast on bad tenants or secret
    except ConfigError as exc:
        return _usage_error(str(exc))
    host, port = settings.server.host, settings.server.port
    try:
        listener = bind_listener(host, port)
    except OSError as exc:
        return _usage_error(_bind_error_message(host, port, exc))
    try:
        note = check_model_source(settings.model.path)
    except ModelSourceError as exc:
        listener.close()
        return _usage_error(str(exc))
    if note:
        logger.warning("%s", note)
    log_settings_warnings(settings)

    from app.main import create_app

    app = create_app(settings, reload=lambda: load_settings(args.config, overrides))
    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(settings.server.shutdown_timeout_s) + 5)
    server = _Server(config, app)
    exit_code = 0

    def fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = EXIT_FATAL
        server.should_exit = True

    def drained() -> None:
        server.should_exit = True

    app.state.on_fatal = fatal
    app.state.on_drained = drained
    shown = f"[{host}]" if ":" in host else host
    logger.info("listening on http://%s:%d (Ctrl-C or SIGTERM drains and stops)", shown,
                listener.getsockname()[1])
    try:
        server.run(sockets=[listener])
    finally:
        listener.close()
    return exit_code


def _usage_error(message: str) -> int:
    print(f"kvgate: error: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def bind_listener(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """Create the server's listening socket now, so a taken address fails before the model loads.

    uvicorn would bind only after its startup, by when the lifespan has begun loading (and
    possibly downloading and converting) the model. The socket is handed to uvicorn as is.
    """
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    infos.sort(key=lambda info: info[0] != socket.AF_INET)  # "localhost": 127.0.0.1, what clients try
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT, as uvicorn
        sock.bind(address)
        sock.listen(backlog)
        sock.set_inheritable(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _bind_error_message(host: str, port: int, exc: OSError) -> str:
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (f"cannot listen on {where}: the address is already in use; pass another --port "
                f"(or [server] port) or stop the process that holds it")
    if exc.errno == errno.EACCES:
        return (f"cannot listen on {where}: permission denied (ports below 1024 need privileges); "
                f"pass --port 1024 or higher")
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return (f"cannot listen on {where}: {exc.strerror or exc}; pass --host with an address of this "
                f"machine (127.0.0.1, 0.0.0.0 or ::)")
    return f"cannot listen on {where}: {exc.strerror or exc}; pass another --host/--port"


class _Server(uvicorn.Server):
    """uvicorn's server, draining on SIGTERM/SIGINT with the listener open, and exiting 0 after it.

    The first signal does not set `should_exit` (that would close the listener at once and
    refuse new connections): it starts the app's drain, whose end calls `should_exit` through
    `app.state.on_drained`. A second signal exits at once, status 128 + signal number.
    """

    def __init__(self, config: Any, app: Any) -> None:
        super().__init__(config)
        self._app = app
        self._signals = 0

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        from app.main import begin_drain

        self._signals += 1
        if self._signals > 1:
            _exit_now(sig)
        loop = self._app.state.loop
        if loop is None or loop.is_closed():  # the app has not started: nothing to drain
            self.should_exit = True
            return
        loop.call_soon_threadsafe(begin_drain, self._app)

    def handle_reload(self, sig: int, frame: FrameType | None) -> None:
        """SIGHUP: re-read the tenants on the event loop (app.auth.reload_tenants); a broken file is
        logged and the tenants in use stay."""
        loop = self._app.state.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(_reload_logged, self._app.state)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the captured signal after a graceful shutdown (exit status -15);
        # a drained server should exit 0, so install the handlers without re-raising.
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        original[signal.SIGHUP] = signal.signal(signal.SIGHUP, self.handle_reload)
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def _reload_logged(state: Any) -> None:
    from app.auth import reload_tenants
    from app.settings import ConfigError

    try:
        reload_tenants(state)
    except ConfigError as exc:
        logger.error("SIGHUP: reload failed, the tenants in use are unchanged: %s", exc)


def _exit_now(sig: int) -> None:
    """Second signal: leave without draining. The engine process dies with us (see engine.backends)."""
    name = signal.Signals(sig).name
    message = f"kvgate: {name} again: exiting now without finishing the drain\n"
    with contextlib.suppress(OSError):
        os.write(sys.stderr.fileno(), message.encode())
    os._exit(128 + sig)


if __name__ == "__main__":
    sys.exit(main())
