"""The ``duoserve`` subcommands: each ``run_*`` takes the parsed flags and returns the exit status.

Heavy imports (torch, uvicorn, the engine) happen inside the runners, so ``--help`` and a
refused flag are instant; a ``ConfigError`` raised here is printed as one line by ``main``.
"""

from __future__ import annotations

import argparse
import socket

from duoserve.bench import serve as bench
from duoserve.cli.configs import (cluster_config_from_args, disagg_config_from_args, engine_config_from_args,
                                  models_config_from_args, server_config_from_args)
from duoserve.config import ClusterConfig, check_engine_address, parse_cpu_list
from duoserve.errors import ConfigError, DuoserveError


def run_command(args: argparse.Namespace, extra_args: list[str]) -> int:
    """Run ``args.command``; ``extra_args`` are the unknown arguments (only ray-node takes them)."""
    if args.command == "ray-node":
        return run_ray_node(args, extra_args)
    if args.command == "serve" and args.dry_run:
        return run_dry_run(args)
    runners = {"generate": run_generate, "serve": run_serve, "prefill": run_engine, "decode": run_engine,
               "keygen": run_keygen, "ray-stop": run_ray_stop, "bench": run_bench,
               "build-kernels": run_build_kernels}
    return runners[args.command](args)


def check_port(host: str, port: int) -> None:
    """Refuse a port out of range or taken before anything loads."""
    if not 0 < port < 65536:
        raise ConfigError("port", port, "a TCP port from 1 to 65535")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as uvicorn binds it
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError("port", port, f"a free port: {host}:{port} cannot be bound ({exc.strerror})") from None


def serve_plan(args: argparse.Namespace):
    """(the server's config, the models' specs or one engine config, the layout, the cluster,
    the models' limits) of ``serve``'s flags, checked before anything loads."""
    import dataclasses

    from duoserve.cli.models import model_specs, several_models

    disagg, server = disagg_config_from_args(args), server_config_from_args(args)
    cluster, limits = cluster_config_from_args(args), models_config_from_args(args)
    if not several_models(args):
        # a launched engine's own SIGTERM drains it as long as the server's drains the server
        return server, dataclasses.replace(engine_config_from_args(args), shutdown_timeout=server.shutdown_timeout), \
            disagg, cluster, limits
    if (disagg and (disagg.decode_addrs or disagg.prefill_addrs)) or cluster.kind != "local":
        raise ConfigError("model", args.model, "one model where the engines run elsewhere (--decode-addrs, "
                          "--prefill-addrs, --cluster ray): several models are launched here")
    specs = [dataclasses.replace(spec, engine_config=dataclasses.replace(
        spec.engine_config, shutdown_timeout=server.shutdown_timeout)) for spec in model_specs(args, server)]
    return server, specs, disagg, cluster, limits


def run_serve(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from duoserve.model.paths import resolve_model_path

    server, models, disagg, cluster, limits = serve_plan(args)
    check_port(server.host, server.port)
    if not (disagg and disagg.decode_addrs and disagg.prefill_addrs) and cluster.kind == "local":
        for config in models if isinstance(models, list) else [models]:
            config = getattr(config, "engine_config", config)
            resolve_model_path(config.model.model)   # a launched engine loads it: refuse a wrong path now
        from duoserve.frontend.launcher import start_engine_server
        start_engine_server()   # engines' imports beside the web server's below

    import uvicorn

    from duoserve.cli.start_signals import stop_start_on_signal
    from duoserve.entrypoints.api_server import DrainingServer, create_app
    from duoserve.frontend.engine_client import EngineStartError
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(models, server, disagg, cluster, limits)
    registry = app.state.models
    # uvicorn cancels what still runs a little after the engine ended it with a final event
    config = uvicorn.Config(app, host=server.host, port=server.port, log_level=server.uvicorn_log_level,
                            access_log=server.access_log, timeout_graceful_shutdown=int(server.shutdown_timeout) + 5)

    async def main() -> int | None:
        """The signal that stopped the start, if one did; else serve until stopped."""
        with stop_start_on_signal(registry.clients) as received:
            try:
                await registry.start()   # launched engines first: the port opens once they serve
            except asyncio.CancelledError:
                if not received:
                    raise
                await registry.shutdown()
                logging.getLogger("duoserve.api").info("engines stopped; exiting")
                return received[0]
            except EngineStartError as exc:
                await registry.shutdown()
                if exc.config_error:
                    raise DuoserveError(str(exc)) from None
                raise
        await DrainingServer(config, registry, server.shutdown_timeout).serve()
        return None

    try:
        stopped_by = asyncio.run(main())
    except KeyboardInterrupt:   # uvicorn re-raises the Ctrl-C it drained on: a clean stop
        return 0
    if stopped_by == signal.SIGTERM:   # as uvicorn does once it drained: the exit says what stopped it
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)
    return 0


def run_dry_run(args: argparse.Namespace) -> int:
    """``serve --dry-run``: the memory plan of each model's engine, without loading it."""
    from duoserve.worker.memory import describe_plan, plan

    _, models, _, _, _ = serve_plan(args)
    for spec in models if isinstance(models, list) else [None]:
        if spec is not None:
            print(f"model {spec.name}:")
        print(describe_plan(plan(models if spec is None else spec.engine_config)))
    return 0


def run_engine(args: argparse.Namespace) -> int:
    """``duoserve prefill|decode --listen ADDR``: one engine in this process until SIGTERM/SIGINT."""
    import dataclasses
    import logging

    import msgspec

    from duoserve.engine.lifecycle import StopSignals
    from duoserve.engine.process import engine_main
    from duoserve.transport.auth import check_listen, load_key

    check_engine_address(args.listen, "listen")
    key = load_key(args.auth_key_file)
    check_listen(args.listen, key, args.insecure_no_auth)
    config = dataclasses.replace(engine_config_from_args(args), role=args.command,
                                 cpus=parse_cpu_list(args.cpus, "cpus"),
                                 kv_lease_timeout=getattr(args, "kv_lease_timeout", 30.0))
    # SIGTERM/SIGINT: at once while starting, a drain once serving (its frontends send it nothing
    # new, it finishes what it holds, then exits), at once again on a second one
    signals = StopSignals().install()
    try:
        return engine_main(msgspec.msgpack.encode(config), args.listen, logging.INFO,
                           auth_secret=None if key is None else key.secret, signals=signals)
    except (KeyboardInterrupt, SystemExit) as exc:   # before the engine was up
        logging.getLogger("duoserve").info("%s engine stopped while starting", args.command)
        return exc.code if isinstance(exc, SystemExit) and isinstance(exc.code, int) else 0


def run_keygen(args: argparse.Namespace) -> int:
    from duoserve.transport.auth import AuthKey

    key = AuthKey.generate()
    try:
        key.save(args.path)
    except OSError as exc:
        raise ConfigError("path", args.path, f"a new file that can be created ({exc.strerror})") from None
    print(f"wrote a deployment key to {args.path} (public part {key.public.decode()}); give every frontend and "
          "engine --auth-key-file with a copy of it")
    return 0


def run_build_kernels(args: argparse.Namespace) -> int:
    """Build (or find) the op library of this machine's CPU where every engine will look for it.
    Exits 0 when it cannot (no compiler, DUOSERVE_C_KERNELS=0), saying so: duoserve then runs its
    torch paths, and the README's `... && duoserve build-kernels && duoserve serve` still serves."""
    import logging
    import sys
    import time

    from duoserve.kernels.build import c_kernels_enabled, kernel_dir, op_library

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not c_kernels_enabled():
        print("DUOSERVE_C_KERNELS=0: nothing to build", file=sys.stderr)
        return 0
    start = time.monotonic()
    library = op_library()
    if library is None:
        print(f"the C kernels could not be built in {kernel_dir()} (the reason is above); duoserve runs "
              "its torch paths without them", file=sys.stderr)
        return 0
    print(f"the C kernels of this machine are in {library} ({time.monotonic() - start:.1f} s)")
    return 0


def run_ray_node(args: argparse.Namespace, ray_args: list[str]) -> int:
    import subprocess

    from duoserve.frontend.ray_cluster import ray_start_command

    if args.engines < 1:
        raise ConfigError("engines", args.engines, "a positive number of engines")
    command = ray_start_command(args.role, args.engines, args.address, [a for a in ray_args if a != "--"])
    print(" ".join(command), flush=True)
    return subprocess.call(command)


def run_ray_stop(args: argparse.Namespace) -> int:
    from duoserve.frontend.ray_cluster import stop_engines

    stopped = stop_engines(ClusterConfig(kind="ray", ray_address=args.ray_address, ray_namespace=args.ray_namespace))
    print(f"stopped {len(stopped)} engine actor(s) in namespace {args.ray_namespace}: {', '.join(stopped) or 'none'}")
    return 0


def run_generate(args: argparse.Namespace) -> int:
    from duoserve.engine.builder import build_engine
    from duoserve.entrypoints.llm import LLM
    from duoserve.sampling_params import SamplingParams

    llm = LLM.from_engine(build_engine(engine_config_from_args(args)))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def run_bench(args: argparse.Namespace) -> int:
    return {"serve": bench.run_bench_serve, "sweep": bench.run_bench_sweep, "prompts": bench.run_bench_prompts,
            "compare": bench.run_bench_compare}[args.bench_command](args)
