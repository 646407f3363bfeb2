"""Flags declared once, on their config's fields (duoserve/flags.py): every flagged field of the
server's, the disaggregated layout's and the cluster's configs is a `duoserve serve` flag whose
value lands in that field, and a field added to a config is its flag with nothing else written."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

import pytest

from duoserve.cli.args import build_parser
from duoserve.cli.configs import cluster_config_from_args, disagg_config_from_args, server_config_from_args
from duoserve.config import ClusterConfig, DisaggConfig
from duoserve.entrypoints.server_config import ServerConfig
from duoserve.errors import ConfigError
from duoserve.flags import add_flags, flag, flagged_fields, option, values_from_args


def serve_args(*flags: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *flags])


def test_every_flagged_field_of_the_deployment_configs_is_a_serve_flag_with_its_default():
    parser = build_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]
    options = {o: a for a in serve._actions for o in a.option_strings}
    for cls in (ServerConfig, DisaggConfig, ClusterConfig):
        for f in flagged_fields(cls):
            assert option(f) in options, (cls.__name__, f.name)
            assert "(default: " in options[option(f)].help
    args = serve_args()
    assert server_config_from_args(args) == ServerConfig(served_model_name="smollm2-135m")
    assert cluster_config_from_args(args) == ClusterConfig()
    assert disagg_config_from_args(serve_args("--mode", "disaggregated")) == DisaggConfig()


def test_flag_values_land_in_their_fields_converted_and_checked():
    args = serve_args("--mode", "disaggregated", "--port", "8123", "--no-access-log", "--prefill-cpus", "0-1",
                      "--decode-addrs", "tcp://10.0.0.2:7100", "--prefill-turn", "0.7", "--routing", "least-loaded",
                      "--auth-key-file", "/k", "--cluster", "ray", "--ray-namespace", "team-a", "--model", "m.gguf")
    server, disagg, cluster = server_config_from_args(args), disagg_config_from_args(args), cluster_config_from_args(args)
    assert (server.port, server.access_log, server.served_model_name) == (8123, False, "m.gguf")
    assert (disagg.prefill_cpus, disagg.decode_addrs, disagg.prefill_turn) == ((0, 1), ("tcp://10.0.0.2:7100",), 0.7)
    assert (disagg.auth_key_file, disagg.num_decode_engines) == ("/k", 1)
    assert (cluster.kind, cluster.routing, cluster.ray_namespace, cluster.auth_key_file) == (
        "ray", "least-loaded", "team-a", "/k")
    with pytest.raises(ConfigError) as err:
        disagg_config_from_args(serve_args("--mode", "disaggregated", "--decode-cpus", "1-x"))
    assert err.value.field == "decode_cpus"
    with pytest.raises(ConfigError) as err:
        disagg_config_from_args(serve_args("--num-prefill-engines", "2"))
    assert err.value.field == "num_prefill_engines"


def test_the_api_key_flag_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv("DUOSERVE_API_KEY", "from-env")
    assert server_config_from_args(serve_args()).api_key == "from-env"
    assert server_config_from_args(serve_args("--api-key", "given")).api_key == "given"


def test_a_new_field_is_its_flag():
    """What a new deployment flag costs: the field, declared with flag(); the parser, the help and
    the mapping back come from it."""
    @dataclass(frozen=True)
    class Layout:
        FLAG_GROUP = ("layout", "How engines are laid out.")
        drain_seconds: float = flag(5.0, "seconds to drain", parse=float)
        pinned: bool = flag(False, "pin engines", parse=bool)
        zones: tuple[str, ...] = flag((), "zones, comma-separated", convert=lambda text, name: tuple(text.split(",")),
                                      cli_default=None, default_help="none")
        internal: int = 3

    parser = argparse.ArgumentParser()
    groups = add_flags(parser, Layout)
    assert list(groups) == ["layout"]
    help_text = " ".join(parser.format_help().split())
    assert "--drain-seconds DRAIN_SECONDS seconds to drain (default: 5)" in help_text
    assert "--pinned, --no-pinned pin engines (default: off)" in help_text
    assert "--internal" not in help_text
    given = Layout(**values_from_args(Layout, parser.parse_args(["--drain-seconds", "1.5", "--pinned",
                                                                "--zones", "a,b"])))
    assert given == Layout(drain_seconds=1.5, pinned=True, zones=("a", "b"))
    assert Layout(**values_from_args(Layout, parser.parse_args([]))) == Layout()
    assert [f.name for f in flagged_fields(Layout)] == ["drain_seconds", "pinned", "zones"]
    assert dataclasses.fields(Layout)[-1].name == "internal"


def test_tenant_flags_land_in_their_fields_and_a_wrong_value_is_named():
    from duoserve.cli.configs import engine_config_from_args

    args = serve_args("--scheduling-policy", "fair", "--tenant-weights", "alice=2,bob=0.5",
                      "--max-waiting-per-tenant", "8", "--max-waiting", "100")
    scheduler = engine_config_from_args(args).scheduler
    assert (scheduler.policy, scheduler.tenant_weights) == ("fair", (("alice", 2.0), ("bob", 0.5)))
    assert scheduler.token_budget(2048) == 256   # a latency policy's shorter steps
    server = server_config_from_args(args)
    assert (server.max_waiting_per_tenant, server.max_waiting) == (8, 100)
    for flags, field in ((("--scheduling-policy", "fair", "--tenant-weights", "alice=two"), "tenant_weights"),
                         (("--tenant-weights", "alice=2"), "tenant_weights"),   # weights need fair
                         (("--scheduling-policy", "fair", "--tenant-weights", "alice=-1"), "tenant_weights")):
        with pytest.raises(ConfigError) as err:
            engine_config_from_args(serve_args(*flags))
        assert err.value.field == field
    with pytest.raises(ConfigError) as err:
        server_config_from_args(serve_args("--max-waiting-per-tenant", "0"))
    assert err.value.field == "max_waiting_per_tenant"
