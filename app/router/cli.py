"""`kvgate route`: the command line of the router (app/router/server.py)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

logger = logging.getLogger("app.router")

EPILOG = """\
how it routes:
  Every replica publishes KV events ([events] endpoint in its config): which salted block keys
  it holds on the device, in host memory and on disk. The router keeps an index per replica from
  them, turns each request's prompt into the same salted keys the replicas compute (the model's
  tokenizer and chat template, the tenant's salt from the shared secret), and sends the request
  to the replica where
      cost = prompt tokens not cached there + load_weight x tokens in flight there
  is lowest (a block on disk counts 0.9 of one in memory). --load-weight 0 routes on the prefix
  alone, a large one on load alone. Replicas that fail /ready twice, or a connection, leave the
  rotation until they answer again; a request that could not reach one goes to the next.

configuration:
  --config is the replicas' own file: [[tenants]] and [server] secret (or KVGATE_SECRET) must be
  the same so that the router derives the same salts; [admin] api_key lets it read
  /admin/replica (model fingerprint, block size, event endpoints) and guards /admin/router;
  [model] path gives the tokenizer (or --tokenizer); [[public_prefixes]] are matched as there.

examples:
  kvgate route --config kvgate.toml --replica http://10.0.0.5:8000 --replica http://10.0.0.6:8000
  kvgate route --replica http://a:8000=tcp://a:5557 --replica http://b:8000=tcp://b:5557 --port 8080
"""


def add_parser(commands: Any) -> None:
    route = commands.add_parser(
        "route", help="run the prefix-aware router in front of KVGate replicas",
        description="Serve the OpenAI API of the replicas behind it, sending each request to the replica "
                    "that holds the longest part of its prompt's KV prefix (learnt from the replicas' KV "
                    "events), weighed against its load; streams are relayed as they come.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    route.add_argument("--replica", action="append", required=True, metavar="URL[=EVENTS]",
                       help="a replica's base URL, e.g. http://10.0.0.5:8000, optionally with its KV events "
                            "endpoint (default: the one /admin/replica names, on the replica's host); repeat "
                            "for each replica")
    route.add_argument("--config", metavar="FILE", help="the replicas' TOML configuration (default: $KVGATE_CONFIG)")
    route.add_argument("--host", default="127.0.0.1", metavar="H", help="address to bind (default 127.0.0.1)")
    route.add_argument("--port", type=int, default=8080, metavar="P", help="port to bind (default 8080)")
    route.add_argument("--load-weight", type=float, default=1.0, metavar="W",
                       help="weight of a replica's tokens in flight against tokens it would have to compute "
                            "(default 1.0; 0: prefix only)")
    route.add_argument("--policy", choices=["prefix", "round_robin"], default="prefix",
                       help="prefix: the score above (default); round_robin: every healthy replica in turn, "
                            "blind to prefixes and load (a baseline to compare with)")
    route.add_argument("--health-interval", type=float, default=1.0, metavar="S",
                       help="seconds between two health checks of each replica (default 1.0)")
    route.add_argument("--tokenizer", metavar="PATH",
                       help="tokenizer folder or hub id (default: the [model] path's, as the replicas load it)")
    route.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                       help="log level (default: info)")
    route.set_defaults(func=run)


def parse_replica(text: str) -> tuple[str, str | None]:
    """``URL`` or ``URL=EVENTS`` → (url, events endpoint or None); ValueError with the reason."""
    url, _, events = text.partition("=")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--replica {text!r}: the URL must start with http:// or https://")
    if events and not events.startswith(("tcp://", "ipc://")):
        raise ValueError(f"--replica {text!r}: the events endpoint must be tcp://HOST:PORT or ipc://PATH")
    return url, events or None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from app.cli import _bind_error_message, _usage_error, bind_listener
    from app.logging import configure_logging
    from app.router.replicas import Replicas
    from app.router.server import create_router_app
    from app.settings import ConfigError, load_settings

    configure_logging(args.log_level)
    try:
        replicas = [parse_replica(r) for r in args.replica]
        if args.load_weight < 0 or args.health_interval <= 0:
            raise ValueError("--load-weight must be >= 0 and --health-interval > 0")
        settings = load_settings(args.config)
        settings.tenant_registry()
    except (ValueError, ConfigError) as exc:
        return _usage_error(str(exc))
    try:
        listener = bind_listener(args.host, args.port)
    except OSError as exc:
        return _usage_error(_bind_error_message(args.host, args.port, exc))
    try:
        tokenizer = _tokenizer(args.tokenizer or settings.model.path)
    except (OSError, ValueError) as exc:
        listener.close()
        return _usage_error(f"cannot load the tokenizer: {exc} (pass --tokenizer PATH)")
    pool = Replicas([u for u, _ in replicas], [e for _, e in replicas], settings.admin.api_key,
                    interval_s=args.health_interval)
    app = create_router_app(settings, pool, tokenizer, args.load_weight, args.policy)
    config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="on")
    logger.info("routing on http://%s:%d over %d replica(s), policy %s, load_weight %g", args.host,
                listener.getsockname()[1], len(replicas), args.policy, args.load_weight)
    try:
        uvicorn.Server(config).run(sockets=[listener])
    finally:
        listener.close()
    return 0


def _tokenizer(model: str) -> Any:
    from engine.model_source import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(model))
