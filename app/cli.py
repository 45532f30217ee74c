"""The `kvgate` command: `serve` and `build-tiny-model`.

Heavy imports (torch, transformers, the app) happen inside the subcommands, so `kvgate --help`
and configuration errors answer at once.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Generator
from types import FrameType
from typing import Any

import uvicorn

_SERVE_EPILOG = """\
configuration:
  TOML file from --config, else $KVGATE_CONFIG, else built-in defaults; flags override it.
  Sections: [model] path/dtype/max_model_len, [server] host/port/max_queue/secret/
  max_body_bytes/shutdown_timeout_s, [engine] device/max_num_seqs/max_num_batched_tokens/
  num_threads/enable_prefix_caching/pack_weights, [cache] block_size/eviction (lru|s3fifo),
  [cache.device] num_blocks, [cache.host] capacity_mb (0 = off), [cache.disk] path/capacity_mb
  (0 = off), [cache.remote] url/cluster/ttl_s/write (through|back; section absent = off),
  [admin] api_key, [[tenants]] name/api_keys/share_group/quota. Unknown keys are errors.

environment:
  KVGATE_CONFIG     config file when --config is absent
  KVGATE_CACHE_DIR  cache folder (models, server secret, disk KV tier); default ~/.cache/kvgate
  KVGATE_SECRET     server secret for tenant salts when [server] secret is absent

KV-cache tiers: device blocks evicted from the pool move to CPU memory (--host-cache-mb, on
  by default), then to files on disk (--disk-cache, on by default); with --remote-cache they are
  also shared through Redis with every replica on the same store. A later request with the same
  prefix loads them instead of recomputing, also after a restart.

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
                    "/ready, /admin/metrics, /admin/tiers). With nothing configured it serves "
                    "SmolLM2-135M-Instruct on 127.0.0.1:8000 without auth.",
        epilog=_SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--config", metavar="FILE", help="TOML configuration file (default: $KVGATE_CONFIG)")
    serve.add_argument("--model", metavar="PATH_OR_ID",
                       help="model folder, hub id, 'tiny' (built test model) or 'default' "
                            "(overrides [model] path)")
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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return args.func(args)


def _build_tiny_model(args: argparse.Namespace) -> int:
    from engine.tiny_model import main as tiny_main

    return tiny_main([args.dir, "--seed", str(args.seed), "--size", args.size])


def _serve(args: argparse.Namespace) -> int:
    from app.logging import configure_logging
    from app.settings import ConfigError, load_settings, log_settings_warnings

    configure_logging(args.log_level)
    overrides = {"model.path": args.model, "server.host": args.host, "server.port": args.port,
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
        print(f"kvgate: error: {exc}", file=sys.stderr)
        return 2
    log_settings_warnings(settings)

    from app.main import create_app

    app = create_app(settings)
    config = uvicorn.Config(app, host=settings.server.host, port=settings.server.port, log_config=None,
                            access_log=False, lifespan="on",
                            timeout_graceful_shutdown=int(settings.server.shutdown_timeout_s) + 5)
    server = _Server(config, app)
    exit_code = 0

    def fatal(exc: BaseException) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    app.state.on_fatal = fatal
    server.run()
    return exit_code


class _Server(uvicorn.Server):
    """uvicorn's server, marking the app as draining on SIGTERM/SIGINT and exiting 0 after it."""

    def __init__(self, config: Any, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        from app.main import begin_drain

        loop = self._app.state.loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(begin_drain, self._app)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        # uvicorn re-raises the captured signal after a graceful shutdown (exit status -15);
        # a drained server should exit 0, so install the handlers without re-raising.
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
