"""Command line: ``asynckv demo | bootstrap-server | gen-token | selftest | bench`` (also ``python -m asynckv``)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Iterator, Sequence

__all__ = ["main"]


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoSpec, run_demo

    spec = DemoSpec(layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim, page_size=args.page_size,
                    mla=args.mla, requests=args.requests, min_pages=args.min_pages, max_pages=args.max_pages,
                    chunk_pages=args.chunk_pages, inflight=args.inflight, seed=args.seed)
    return run_demo(spec)


@contextlib.contextmanager
def _stop_signals() -> Iterator[asyncio.Event]:
    """An event SIGINT or SIGTERM sets, from before the server says it is up. The handlers are
    installed whatever the process inherited: a server started as a script's background job
    inherits SIGINT ignored, and was then left running when sent it; SIGTERM, what supervisors
    send, killed it without a clean close."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


def _bootstrap_server(args: argparse.Namespace) -> int:
    from .service.bootstrap import BootstrapServer
    from .service.sglang_bootstrap import SglangBootstrapServer

    async def serve() -> None:
        from .config import Config

        cfg = Config.from_env()
        with _stop_signals() as stop:
            if args.wire == "sglang-0.5.10":  # SGLang ranks cannot authenticate: a token does not apply
                async with SglangBootstrapServer(args.host, args.port,
                                                 allow_unauthenticated=cfg.allow_unauthenticated) as sgl:
                    mode = "any host" if cfg.allow_unauthenticated else "protected mode: loopback clients only"
                    print(f"asynckv bootstrap server for SGLang 0.5.10 ranks on http://{sgl.addr} ({mode}; "
                          f"Ctrl-C to stop)", flush=True)
                    await stop.wait()
                return
            async with BootstrapServer(args.host, args.port, cfg.auth_token,
                                       allow_unauthenticated=cfg.allow_unauthenticated) as server:
                mode = ("authenticated" if cfg.auth_token else "unauthenticated, any host" if cfg.allow_unauthenticated
                        else "protected mode: /route for loopback clients only")
                print(f"asynckv bootstrap server on http://{server.addr} ({mode}; Ctrl-C to stop)", flush=True)
                await stop.wait()

    asyncio.run(serve())
    print("asynckv bootstrap server stopped", flush=True)
    return 0


def _gen_token(args: argparse.Namespace) -> int:
    import secrets

    print(secrets.token_urlsafe(32))
    return 0


def _selftest(args: argparse.Namespace) -> int:
    from .selftest import run_selftest

    return run_selftest()


def _selftest_probe(args: argparse.Namespace) -> int:
    from .selftest import run_probe

    return run_probe()


def _bench(args: argparse.Namespace) -> int:
    import pathlib
    import subprocess

    root = pathlib.Path(__file__).resolve().parent.parent
    if not (root / "benchmarks" / "__main__.py").exists():
        print("asynckv bench needs the repository's benchmarks/ folder (run it from a checkout)", file=sys.stderr)
        return 2
    return subprocess.call([sys.executable, "-m", "benchmarks", *args.bench_args], cwd=root)


def _worker(args: argparse.Namespace) -> int:
    from .demo import run_worker

    return run_worker(args.role, args.spec)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asynckv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="move real KV pages between a prefill and a decode process and verify them")
    demo.add_argument("--mla", action="store_true", help="one latent buffer per layer instead of K and V")
    demo.add_argument("--layers", type=_positive, default=32)
    demo.add_argument("--kv-heads", type=_positive, default=8)
    demo.add_argument("--head-dim", type=_positive, default=128)
    demo.add_argument("--page-size", type=_positive, default=16, help="tokens per page")
    demo.add_argument("--requests", type=_positive, default=64)
    demo.add_argument("--min-pages", type=_positive, default=1)
    demo.add_argument("--max-pages", type=_positive, default=64)
    demo.add_argument("--chunk-pages", type=_positive, default=16, help="pages per chunked-prefill chunk")
    demo.add_argument("--inflight", type=_positive, default=8, help="requests in flight at once")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)

    boot = sub.add_parser("bootstrap-server", help="run a standalone bootstrap server")
    boot.add_argument("--host", default="127.0.0.1")
    boot.add_argument("--port", type=int, default=8998)
    boot.add_argument("--wire", choices=["asynckv", "sglang-0.5.10"], default="asynckv",
                      help="the HTTP API to serve: asynckv's own, or SGLang 0.5.10's (for stock SGLang ranks)")
    boot.set_defaults(func=_bootstrap_server)

    token = sub.add_parser("gen-token", help="print a fresh secret for ASYNCKV_AUTH_TOKEN (256 random bits)")
    token.set_defaults(func=_gen_token)

    selftest = sub.add_parser("selftest", help="move bytes between two local agents; report the transport in use")
    selftest.set_defaults(func=_selftest)
    probe = sub.add_parser("_selftest-probe", help=argparse.SUPPRESS)
    probe.set_defaults(func=_selftest_probe)

    bench = sub.add_parser("bench", help="run the benchmark suite (benchmarks/, from a checkout)")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="passed to python -m benchmarks")
    bench.set_defaults(func=_bench)

    worker = sub.add_parser("_worker", help=argparse.SUPPRESS)
    worker.add_argument("role", choices=["prefill", "decode"])
    worker.add_argument("spec")
    worker.set_defaults(func=_worker)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.WARNING - 10 * args.verbose
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.command == "demo" and args.min_pages > args.max_pages:
        print("asynckv demo: --min-pages must be <= --max-pages", file=sys.stderr)
        return 2
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
