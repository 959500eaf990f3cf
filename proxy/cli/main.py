"""``mmguard``: serve, check-config, demo, status, canary-report."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from proxy import __version__
from proxy.config.model import ConfigError, load_config
from proxy.process.descriptors import raise_open_files_limit

LOG_LEVELS = ("debug", "info", "warning", "error")


def main(argv: list[str] | None = None) -> int:
    """The command; a reader that closed the pipe early (``mmguard status | head``) ends it
    quietly with 141, as a command killed by SIGPIPE does, not with a traceback."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at interpreter exit
        return code
    except BrokenPipeError:
        # Python would flush stdout again at exit and print a second error: point it at
        # /dev/null first (the recipe of Python's signal module documentation).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="mmguard", description="Guard proxy for model serving")
    parser.add_argument("--version", action="version", version=f"mmguard {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the proxy (embedded default without --config)")
    serve.add_argument("--config", type=Path, help="YAML config file (default: $MMGUARD_CONFIG; "
                       "the embedded demo when neither is given)")
    serve.add_argument("--http-port", type=int, help="KServe v2 HTTP port (default 9000)")
    serve.add_argument("--grpc-port", type=int, help="KServe v2 gRPC port (default 9001)")
    serve.add_argument("--admin-port", type=int, help="admin port: /metrics, /healthz (9002)")
    serve.add_argument("--log-level", choices=LOG_LEVELS, help="log level (default: the "
                       "config's telemetry.log_level, info)")
    serve.add_argument("--workers", help="worker processes sharing the ports, or 'auto' (the "
                       "CPUs this process may use); default: the config's `workers`, 1")
    check = sub.add_parser("check-config", help="validate a config file without serving")
    check.add_argument("file", type=Path)
    check.add_argument("--offline", action="store_true", help="check everything but the files "
                       "and variables that exist only where mmguard runs (secrets, TLS files, "
                       "model directories, filter files): for CI, on a ConfigMap as it is")
    demo = sub.add_parser("demo", help="walk through what mmguard does, against a running "
                          "`mmguard serve` (the embedded default)")
    demo.add_argument("--url", default="127.0.0.1:9001", help="gRPC address of mmguard")
    demo.add_argument("--http", default="127.0.0.1:9000", help="HTTP address of mmguard")
    demo.add_argument("--admin", default="http://127.0.0.1:9002", help="admin API base URL")
    demo.add_argument("--text", default="a photo of a cat")
    status = sub.add_parser("status", help="live state of a running mmguard from its admin API")
    status.add_argument("--admin", default="http://127.0.0.1:9002", help="admin API base URL")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    report = sub.add_parser("canary-report", help="canary verdicts from the admin API; exit 0 "
                            "when none aborts, 3 when one does, 2 when the API is unreachable")
    report.add_argument("--admin", default="http://127.0.0.1:9002", help="admin API base URL")
    report.add_argument("--html", type=Path, help="also write a self-contained HTML report here")
    report.add_argument("--json", action="store_true", help="print the raw JSON, not the table")
    report.add_argument("--timeout", type=float, default=5.0, help="seconds per request")
    args = parser.parse_args(argv)
    if args.command == "status":
        from proxy.cli.status import main as status_main
        return status_main(args)
    if args.command == "canary-report":
        from proxy.cli.report import main as report_main
        return report_main(args)
    if args.command == "check-config":
        return check_config(args.file, offline=args.offline)
    if args.command == "demo":
        from proxy.cli.demo import run_demo
        return run_demo(args.url, args.text, args.http, args.admin)
    return serve_main(args)


def check_config(path: Path, offline: bool = False) -> int:
    """Everything ``serve`` would refuse: the document, and the files it names on this
    machine; ``offline``: all but what exists only where mmguard runs, named as not checked."""
    from proxy.config.model import pod_files
    from proxy.config.refs import offline as offline_checks

    try:
        if not offline:
            cfg = load_config(path, check_files=True)
        else:
            with offline_checks() as skipped:
                cfg = load_config(path)
            skipped += pod_files(cfg)
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 1
    print(f"{path}: ok ({len(cfg.backends)} backends, {len(cfg.models)} models)"
          + (f"; offline, not checked: {', '.join(skipped) or 'nothing'}" if offline else ""))
    return 0


def serve_main(args: argparse.Namespace) -> int:
    from proxy.cli.embedded import embedded_config
    from proxy.process.server import Ports, Server
    from proxy.telemetry import setup_logging, setup_tracing

    path = args.config or (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
    try:
        # A config that was asked for and is missing refuses to start: serving the demo
        # instead would say Ready for a pod that serves none of its models.
        config = load_config(path, check_files=True) if path else embedded_config()
    except ConfigError as err:
        print(err, file=sys.stderr)
        return 1
    from proxy.process.supervisor import become_supervisor, become_worker, resolve_workers

    worker = become_worker()
    try:
        workers = 1 if worker else resolve_workers(args.workers, config)
    except ValueError:
        print(f"--workers: expected a number of workers or 'auto', got {args.workers!r}",
              file=sys.stderr)
        return 1
    if workers > 1 and config.shared_memory.system:
        print("shared_memory.system needs one process: client regions are registered with the "
              "worker a connection reaches; run with workers: 1 (docs/workers.md)",
              file=sys.stderr)
        return 1
    _raise_open_files_limit()
    if workers > 1:
        metrics_dir = become_supervisor(workers)
    setup_logging(args.log_level or config.telemetry.log_level, config.telemetry.log_format)
    setup_tracing(config.telemetry.otlp_endpoint, config.telemetry.service_name)
    ports = Ports(args.http_port, args.grpc_port, args.admin_port)

    async def run() -> None:
        if workers > 1:
            from proxy.process.supervisor import Supervisor
            from proxy.telemetry import Telemetry, pod_exposition

            telemetry = Telemetry()
            telemetry.exposition = pod_exposition(str(metrics_dir))
            pod = Supervisor(config, path, ports, workers, telemetry)
            await pod.start()
            await pod.run_until_signalled()
            return
        server = Server(config, path, ports)
        await server.start()
        await server.run_until_signalled()

    try:
        _run_loop(run())
    except ImportError as err:
        if err.name != "onnxruntime":
            raise
        print(f"mmguard: {err}", file=sys.stderr)  # one line, not a traceback
        return 1
    return 0


def _run_loop(main: Coroutine[Any, Any, None]) -> None:
    try:
        import uvloop  # libuv's loop: ~30% more requests per CPU second here, gRPC included
    except ImportError:
        asyncio.run(main)
    else:
        uvloop.run(main)


CONFIG_ENV = "MMGUARD_CONFIG"


def _raise_open_files_limit() -> None:
    """Up to the hard limit: every client connection is a descriptor, and the listeners'
    connection caps are derived from the limit (``proxy.process.descriptors``)."""
    raise_open_files_limit()


if __name__ == "__main__":
    sys.exit(main())
