"""The ``duoserve`` command's flags: one function per flag group, and the parser of every
subcommand; an engine's flags are ``duoserve.engine_args.EngineArgs``' fields. Nothing here
imports torch or the engine, so ``--help`` is instant; the flags become a config tree in
``duoserve.cli.configs`` and run in ``duoserve.cli.commands``.
"""

from __future__ import annotations

import argparse

from duoserve import envs
from duoserve import __version__
from duoserve.bench.serve import add_args as add_bench_serve_args
from duoserve.bench.serve import add_sweep_args
from duoserve.config import (AUTO_DECODE_STEP_TOKENS, CLUSTERS, CORE_SHARINGS, KV_TRANSPORTS, PREFILL_DEVICES,
                             ROUTINGS, ClusterConfig, DisaggConfig, EngineConfig)
from duoserve.engine_args import EngineArgs
from duoserve.entrypoints.reasoning import REASONING_PARSERS
from duoserve.entrypoints.tool_formats import TOOL_CALL_PARSERS
from duoserve.sampling_params import POOLINGS


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


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser("serve", help="start the OpenAI-compatible server and its engine")
    add_server_args(serve)
    add_engine_args(serve)
    serve.add_argument("--dry-run", action="store_true",
                       help="print what the engine would allocate (weights, KV pool, swap, prefill scratch) and the "
                            "largest batch it allows, then exit; refuse a config that cannot fit")


def _add_engine_commands(commands: argparse._SubParsersAction) -> None:
    """``duoserve prefill`` and ``duoserve decode``: one engine of a disaggregated deployment."""
    for role in ("prefill", "decode"):
        engine = commands.add_parser(
            role, help=f"run a {role} engine on its own, for `serve --mode disaggregated --{role}-addrs`")
        engine.add_argument("--listen", required=True,
                            help="address to listen on: tcp://HOST:PORT (e.g. tcp://0.0.0.0:7100), or ipc://PATH")
        engine.add_argument("--cpus", default=None, help="pin the engine to these CPUs (0, 0-1, 0,2)")
        if role == "prefill":
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


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every flag of an engine (``duoserve.engine_args.EngineArgs``: model, memory and scheduling,
    speculative decoding, the KV store)."""
    EngineArgs.add_cli_args(parser)


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
    """Every flag of ``serve`` but the engine's. The server group's limits come after the other
    groups so that the usage line keeps its order."""
    server = parser.add_argument_group("server")
    _add_listen_args(server)
    add_disagg_args(parser)
    add_auth_args(parser)
    add_cluster_args(parser)
    _add_server_limit_args(server)


def _add_listen_args(g: argparse._ArgumentGroup) -> None:
    """Where the server listens, who may call it, and how many engines serve it."""
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients use (default: the --model value, or smollm2-135m)")
    g.add_argument("--api-key", default=envs.DUOSERVE_API_KEY,
                   help="require 'Authorization: Bearer KEY' on every route but /health "
                        "(default: $DUOSERVE_API_KEY, or none)")
    g.add_argument("--mode", default="colocated", choices=["colocated", "disaggregated"],
                   help="one engine doing prefill and decode, or separate engines (default: colocated)")


def add_disagg_args(parser: argparse.ArgumentParser) -> None:
    d = parser.add_argument_group(
        "disaggregated serving (--mode disaggregated)",
        "Engines launched on this host share its cores: unless one of --prefill-threads, --decode-threads, "
        "--prefill-cpus or --decode-cpus is given, every engine uses every core and the roles take turns "
        "(--core-sharing turns: a decode step waits at most --prefill-turn for a prompt), or decode engines "
        "are pinned to the first half of the cores and prefill engines to the rest (--core-sharing split; "
        "2 cores: prefill on CPU 1, decode on CPU 0). With --prefill-device cuda the CPU engines are not pinned.")
    d.add_argument("--prefill-device", default=DisaggConfig.prefill_device, choices=PREFILL_DEVICES,
                   help="where prompts are prefilled: on a prefill engine on that device (cpu, cuda/gpu), or "
                        "auto: each where its predicted time to first token is lowest, on a CPU prefill "
                        "engine or on its decode engine (whose steps then hold at most "
                        f"{AUTO_DECODE_STEP_TOKENS} prompt tokens unless --max-num-batched-tokens is given); "
                        "before any rate is measured, --max-prefill-len decides (default: cpu)")
    d.add_argument("--max-prefill-len", type=int, default=DisaggConfig.max_prefill_len,
                   help=f"auto placement before rates are measured: prompts of at most this many tokens on "
                        f"a prefill engine (default: {DisaggConfig.max_prefill_len})")
    d.add_argument("--prefill-threads", type=int, default=None,
                   help="torch threads of each prefill engine (default: its share of the cores, see above)")
    d.add_argument("--decode-threads", type=int, default=None,
                   help="torch threads of each decode engine (default: its share of the cores)")
    d.add_argument("--prefill-cpus", default=None,
                   help="pin the prefill engines to these CPUs: 0, 0-1, 0,2 (default: see above)")
    d.add_argument("--decode-cpus", default=None, help="pin the decode engines to these CPUs (default: see above)")
    d.add_argument("--core-sharing", default=DisaggConfig.core_sharing, choices=CORE_SHARINGS,
                   help="how launched engines of both roles share this host's cores: every core, in turns, "
                        "or split between the roles (default: turns)")
    d.add_argument("--prefill-turn", type=float, default=DisaggConfig.prefill_turn,
                   help="turns: seconds a prompt step keeps the cores while a decode step waits "
                        f"(default: {DisaggConfig.prefill_turn:g})")
    d.add_argument("--kv-transport", default=DisaggConfig.kv_transport, choices=KV_TRANSPORTS,
                   help="how KV moves between the engines: shared memory or TCP (default: shm)")
    d.add_argument("--kv-lease-timeout", type=float, default=DisaggConfig.kv_lease_timeout,
                   help="seconds a prefill engine keeps KV for an unacknowledged handoff "
                        f"(default: {DisaggConfig.kv_lease_timeout:g})")
    d.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                   help="token budget of one prefill-engine step (default: --max-num-batched-tokens); smaller "
                        "chunks let a short prompt overtake a long one sooner")
    d.add_argument("--num-prefill-engines", type=int, default=None,
                   help="prefill engines to launch on this host (default: 1)")
    d.add_argument("--num-decode-engines", type=int, default=None,
                   help="decode engines to launch on this host (default: 1)")
    d.add_argument("--prefill-addrs", default=None,
                   help="use running prefill engines instead (`duoserve prefill --listen ADDR`): tcp://h1:p1,...")
    d.add_argument("--decode-addrs", default=None,
                   help="use running decode engines instead (`duoserve decode --listen ADDR`): tcp://h2:p2,...")
    d.add_argument("--engine-host", default=DisaggConfig.engine_host,
                   help="where launched engines listen when they use TCP; must be reachable from remote "
                        "engines (default: 127.0.0.1)")


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    r = parser.add_argument_group(
        "cluster (--cluster ray)",
        "Engines as Ray actors, placed on the nodes that advertise duoserve_prefill / duoserve_decode resources "
        "(`duoserve ray-node`), found again by name by every frontend, restarted by Ray when a node dies. "
        "They outlive the frontends: `duoserve ray-stop` removes them.")
    r.add_argument("--num-engines", type=int, default=ClusterConfig.num_engines,
                   help="colocated engines to launch on this host, each on its share of the cores; a request "
                        "whose engine goes down goes on on another (default: 1; with --disagg use "
                        "--num-decode-engines)")
    r.add_argument("--routing", default=ClusterConfig.routing, choices=ROUTINGS,
                   help="which of several engines of a role takes a request: prefix, the one with the fewest "
                        "prompt tokens to compute before its first token (its queue, plus the part of this prompt "
                        "its prefix cache probably lacks), none 4 requests busier than the least loaded; "
                        "least-loaded, the one with the fewest queued (default: prefix)")
    r.add_argument("--cluster", default=ClusterConfig.kind, choices=CLUSTERS,
                   help="launch the engines on this host, or place them on a Ray cluster (default: local)")
    r.add_argument("--ray-address", default=None,
                   help="the cluster to join: HOST:PORT, or auto for the one `ray start` runs here (default: start "
                        "a Ray instance on this host with the resources of the engines asked for)")
    r.add_argument("--ray-namespace", default=ClusterConfig.ray_namespace,
                   help="one deployment's engines are the named actors of this namespace (default: duoserve)")


def _add_server_limit_args(g: argparse._ArgumentGroup) -> None:
    """Admission, request size, shutdown and the HTTP server's logs."""
    g.add_argument("--max-queue-len", type=int, default=None,
                   help="requests in flight beyond which new ones get 429 (default: no limit)")
    g.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="largest request body accepted, larger gets 413 (default: 1048576)")
    g.add_argument("--tool-call-parser", default=None, choices=TOOL_CALL_PARSERS,
                   help="how the model writes tool calls, for tool_choice 'auto' (vLLM's names; hermes: "
                        "<tool_call> JSON, fenced or bare). Default: the one the model's chat template speaks "
                        "(a template without tools gets llama.cpp's generic JSON format: README, Tool calls)")
    g.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split a reasoning model's <think>...</think> from its answer into reasoning_content "
                        "(vLLM's names)")
    g.add_argument("--pooling", default=None, choices=POOLINGS,
                   help="how /v1/embeddings pools a prompt's final hidden states: the last token's, or the "
                        "mean of all (default: what the model file says (GGUF pooling_type, sentence-transformers' "
                        "Pooling config), else last, as for a causal model)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGTERM/SIGINT (default: 30)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of the HTTP server's own messages (default: info)")
    g.add_argument("--access-log", action=argparse.BooleanOptionalAction, default=True,
                   help="log every HTTP request (default: on)")
