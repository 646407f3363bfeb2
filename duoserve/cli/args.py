"""The ``duoserve`` command's flags: one function per flag group, and the parser of every
subcommand; an engine's flags are ``duoserve.engine_args.EngineArgs``' fields. Nothing here
imports torch or the engine, so ``--help`` is instant; the flags become a config tree in
``duoserve.cli.configs`` and run in ``duoserve.cli.commands``.
"""

from __future__ import annotations

import argparse

from duoserve import __version__
from duoserve.bench.serve import add_args as add_bench_serve_args
from duoserve.bench.serve import add_sweep_args
from duoserve.config import ClusterConfig, DisaggConfig, EngineConfig, Role
from duoserve.engine_args import EngineArgs
from duoserve.entrypoints.server_config import ModelsConfig, ServerConfig
from duoserve.flags import add_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="duoserve", description="duoserve: prefill/decode-disaggregated LLM serving")
    parser.add_argument("--version", action="version", version=f"duoserve {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_generate_command(commands)
    _add_serve_command(commands)
    _add_engine_commands(commands)
    _add_deployment_commands(commands)
    _add_bench_commands(commands)
    commands.add_parser("build-kernels", help="build the C kernels for this machine now (the README's install does; "
                                              "else the first start builds them, about 15 s)")
    return parser


def _add_generate_command(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help="complete one prompt and print the text")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_engine_args(gen)


class ModelsGiven(argparse.Action):
    """``serve --model``: the last one is the model (as for every command), and every one given
    is kept in ``models_given``, each a model behind the server (``--model NAME=PATH`` again)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values)
        namespace.models_given = [*(getattr(namespace, "models_given", None) or []), values]


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server and its engine")
    add_server_args(serve)
    add_flags(serve, ModelsConfig)
    add_engine_args(serve, actions={"model": ModelsGiven})
    serve.add_argument("--dry-run", action="store_true",
                       help="print what the engine would allocate (weights, KV pool, swap, prefill scratch) and the "
                            "largest batch it allows, then exit; refuse a config that cannot fit")


def _add_engine_commands(commands: argparse._SubParsersAction) -> None:
    """``duoserve prefill`` and ``duoserve decode``: one engine of a disaggregated deployment."""
    for role in (Role.PREFILL, Role.DECODE):
        engine = commands.add_parser(
            role, help=f"run a {role} engine on its own, for `serve --mode disaggregated --{role}-addrs`")
        engine.add_argument("--listen", required=True,
                            help="address to listen on: tcp://HOST:PORT (e.g. tcp://0.0.0.0:7100), or ipc://PATH")
        engine.add_argument("--cpus", default=None, help="pin the engine to these CPUs (0, 0-1, 0,2)")
        if role is Role.PREFILL:
            engine.add_argument("--kv-lease-timeout", type=float, default=EngineConfig.kv_lease_timeout,
                                help="seconds KV waits for the decode engine's acknowledgement "
                                     f"(default: {EngineConfig.kv_lease_timeout:g})")
        add_auth_args(engine)
        add_engine_args(engine)


def _add_deployment_commands(commands: argparse._SubParsersAction) -> None:
    """A deployment's key and its Ray nodes."""
    keygen = commands.add_parser("keygen", help="write a new deployment auth key (CURVE secret) to a file, "
                                                "for --auth-key-file on every frontend and engine")
    keygen.add_argument("path", help="the file to create (mode 0600; an existing file is not overwritten)")
    node = commands.add_parser(
        "ray-node", help="start a Ray node for duoserve engines on this host: `ray start` with the resources of the "
                         "role (prints the command; the rest of the arguments go to ray start)")
    node.add_argument("--role", required=True, choices=["prefill", "decode", "both"],
                      help="which engines this host runs (both: one of each)")
    node.add_argument("--engines", type=int, default=1, help="engines of the role this host runs (default: 1)")
    node.add_argument("--address", default=None, help="the head node to join, HOST:PORT (default: start a head)")
    stop = commands.add_parser("ray-stop", help="remove the engine actors of a --cluster ray deployment")
    stop.add_argument("--ray-address", default="auto", help="the cluster (default: auto, the one running here)")
    stop.add_argument("--ray-namespace", default="duoserve", help="the deployment's namespace (default: duoserve)")


def _add_bench_commands(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure a server").add_subparsers(dest="bench_command",
                                                                               metavar="BENCH", required=True)
    add_bench_serve_args(bench.add_parser("serve", help="load an OpenAI-compatible server and report latency, "
                                          "throughput, goodput and errors"))
    add_sweep_args(bench.add_parser("sweep", help="a workload at several rates or concurrencies: the highest that "
                                    "meets the goodput SLO"))
    prompts = bench.add_parser("prompts", help="the prompt-length histogram of a JSONL of requests, and the "
                               "settings it suggests")
    prompts.add_argument("file", help="one JSON object a line, with prompt or messages")
    prompts.add_argument("--tokenizer", default=None, help="an HF directory or GGUF file (default: the default model)")
    prompts.add_argument("--output-len", type=int, default=256, help="expected output tokens (default: 256)")
    prompts.add_argument("--kv-bytes-per-token", type=int, default=46080,
                         help="the model's KV bytes a token (default: 46080, the default model in fp32)")
    compare = bench.add_parser("compare", help="several --result-json documents side by side, and one figure")
    compare.add_argument("results", nargs="+", help="result documents of duoserve bench serve")
    compare.add_argument("--plot", default=None, metavar="PNG", help="draw them all on one figure here")


def add_engine_args(parser: argparse.ArgumentParser, actions: dict[str, type[argparse.Action]] | None = None) -> None:
    """Every flag of an engine (``duoserve.engine_args.EngineArgs``: model, memory and scheduling,
    speculative decoding, the KV store)."""
    EngineArgs.add_cli_args(parser, actions)


def add_auth_args(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = parser.add_argument_group(
        "authentication", "Frontends and engines of one deployment share a key (ZeroMQ CURVE): a peer without it "
        "cannot connect, and the traffic is encrypted. Engines a frontend launches get a fresh key when none is given.")
    g.add_argument("--auth-key-file", default=None,
                   help="the deployment key, made by `duoserve keygen FILE` (default: $DUOSERVE_AUTH_KEY_FILE, "
                        "or the key itself in $DUOSERVE_AUTH_KEY)")
    g.add_argument("--insecure-no-auth", action="store_true",
                   help="listen beyond loopback without a key: anyone who reaches the port may connect")
    return g


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of ``serve`` but the engine's: the server's, the disaggregated layout's, the
    deployment key's and the cluster's, each declared on its config's fields (``duoserve.flags``)."""
    add_flags(parser, ServerConfig)
    add_disagg_args(parser)
    add_auth_args(parser)
    add_cluster_args(parser)


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, DisaggConfig)


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ClusterConfig)
