"""Configuration: sizes, addresses, the settings table and its three sources
(TOML file, ``KVSTORED_*`` environment, flags), ``NodeConfig`` validation,
``kvstored --help``, and the page layout / key checks."""

from __future__ import annotations

import math
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

from kvstore.cli.kvstored import main, make_parser
from kvstore.config import (
    GROUPS, SETTINGS, NamespaceSpec, NodeConfig, add_override, build_config, markdown, parse_bool,
    parse_device, parse_hostport, parse_peers, setting_flags,
)
from kvstore.placement.planner_types import PlannerConfig
from kvstore.predict.types import PredictorConfig
from kvstore.errors import InvalidArgument
from kvstore.pool.layout import DTYPES, MAX_KEY_BYTES, PageLayout, check_keys
from kvstore.units import format_size, parse_size
from tests.conftest import REPO_ROOT

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40


def config_from(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> NodeConfig:
    return build_config(make_parser().parse_args(argv or []), environ=environ or {})


def write_toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvstored.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------
# parse_size / format_size
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0), ("4096", 4096), (4096, 4096), (0, 0), ("1B", 1), ("1b", 1),
    ("1k", 1000), ("1KB", 1000), ("2m", 2 * 10**6), ("2MB", 2 * 10**6), ("3G", 3 * 10**9), ("3gb", 3 * 10**9),
    ("1t", 10**12), ("1TB", 10**12),
    ("1Ki", KiB), ("1KiB", KiB), ("1kib", KiB), ("512MiB", 512 * MiB), ("512mi", 512 * MiB), ("4GiB", 4 * GiB),
    ("4gi", 4 * GiB), ("2TiB", 2 * TiB), ("2ti", 2 * TiB),
    ("1.5GiB", 3 * GiB // 2), ("0.5KiB", 512), ("1.", 1), ("1e9", 10**9), ("2E3", 2000), ("1.5e3KiB", 1500 * KiB),
    ("  2 MiB  ", 2 * MiB), ("64MiB", 64 * MiB),
])
def test_parse_size_forms(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", [
    "", " ", "abc", "GiB", "-1", "+1", "1XB", "1 2", "1..2", ".5G", "1e-3", "1e", "1 GiB B", "1,000", "0x10", "1 kibibyte",
])
def test_parse_size_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="bad size .*use a number with an optional unit .*GiB"):
        parse_size(text)


def test_parse_size_rejects_negative_int() -> None:
    with pytest.raises(ValueError, match="size must be >= 0, got -1"):
        parse_size(-1)


def test_parse_size_overflow_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_size("1e400")


def test_parse_size_large_integers_are_exact() -> None:
    assert parse_size("9007199254740993") == 9007199254740993


@pytest.mark.parametrize(("n", "text"), [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (64 * MiB, "64.0 MiB"), (4 * GiB, "4.0 GiB"),
    (3 * TiB, "3.0 TiB"), (2048 * TiB, "2.0 PiB"),
])
def test_format_size(n: int, text: str) -> None:
    assert format_size(n) == text


# ---------------------------------------------------------------------------
# addresses, peers, devices, booleans
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1:7400", ("127.0.0.1", 7400)),
    ("localhost:0", ("localhost", 0)),
    ("node-1.example.com:65535", ("node-1.example.com", 65535)),
    ("[::1]:80", ("::1", 80)),
    ("[::]:0", ("::", 0)),
    ("[fe80::1%eth0]:7400", ("fe80::1%eth0", 7400)),
])
def test_parse_hostport_accepts(text: str, expected: tuple[str, int]) -> None:
    assert parse_hostport(text) == expected


@pytest.mark.parametrize("text", [
    "", "host", "host:", ":80", "host:http", "host:-1", "host:+1", "host: 80", "host:1.5", "host:65536", "host:99999",
    "[::1]", "[::1]:", "[::1]:x",
])
def test_parse_hostport_rejects(text: str) -> None:
    with pytest.raises(ValueError, match="bad (address|port)"):
        parse_hostport(text)


def test_parse_hostport_port_zero() -> None:
    assert parse_hostport("h:0") == ("h", 0)
    with pytest.raises(ValueError, match="bad port"):
        parse_hostport("h:0", allow_zero_port=False)
    assert parse_hostport("h:1", allow_zero_port=False) == ("h", 1)


@pytest.mark.parametrize("text", ["[]:80", "::1"])
def test_parse_hostport_rejects_empty_or_unbracketed_v6_host(text: str) -> None:
    with pytest.raises(ValueError):
        parse_hostport(text)


@pytest.mark.parametrize(("value", "expected"), [
    ("", ()),
    ("a:1", ("a:1",)),
    ("a:1,b:2", ("a:1", "b:2")),
    (" a:1 , b:2 ,", ("a:1", "b:2")),
    ("[::1]:7400,10.0.0.2:7400", ("[::1]:7400", "10.0.0.2:7400")),
    (["a:1", " b:2 "], ("a:1", "b:2")),
    ([], ()),
])
def test_parse_peers_accepts(value: str | list[str], expected: tuple[str, ...]) -> None:
    assert parse_peers(value) == expected


@pytest.mark.parametrize(("value", "message"), [
    ("a:1,nohost", "bad address 'nohost'"),
    ("a:1,b:", "bad address 'b:'"),
    ("a:0", "bad port in 'a:0'"),
    ("a:1,b:0", "bad port"),
    ("a:70000", "bad port"),
    ("a:1,a:1", "duplicate peer"),
    (" a:1, a:1 ", "duplicate peer"),
    (["a:1", "a:1"], "duplicate peer"),
    (["a:1", "x"], "bad address 'x'"),
])
def test_parse_peers_rejects(value: str | list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_peers(value)


@pytest.mark.parametrize("value", ["auto", "cpu", "cuda:0", "cuda:7", "cuda:12"])
def test_parse_device_accepts(value: str) -> None:
    assert parse_device(value) == value


@pytest.mark.parametrize("value", ["", "gpu", "cuda", "cuda:", "cuda:x", "cuda:-1", "CPU", "cuda:0 ", "rocm:0"])
def test_parse_device_rejects(value: str) -> None:
    with pytest.raises(ValueError, match="bad device"):
        parse_device(value)


@pytest.mark.parametrize(("value", "expected"), [
    (True, True), (False, False), ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("False", False), ("no", False), ("off", False),
])
def test_parse_bool(value: str | bool, expected: bool) -> None:
    assert parse_bool(value) is expected


@pytest.mark.parametrize("value", ["", "maybe", "2", "y"])
def test_parse_bool_rejects(value: str) -> None:
    with pytest.raises(ValueError, match="is not a boolean"):
        parse_bool(value)


# ---------------------------------------------------------------------------
# NamespaceSpec
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("ns:4096", NamespaceSpec("ns", 4096, 0)),
    ("ns:4KiB:1MiB", NamespaceSpec("ns", 4 * KiB, MiB)),
    ("llama3-8b:1MiB:4GiB", NamespaceSpec("llama3-8b", MiB, 4 * GiB)),
    ({"name": "ns", "page_bytes": 4096}, NamespaceSpec("ns", 4096, 0)),
    ({"name": "ns", "page_bytes": "2MiB", "capacity": "1GiB"}, NamespaceSpec("ns", 2 * MiB, GiB)),
])
def test_namespace_spec_parse(value: str | dict[str, Any], expected: NamespaceSpec) -> None:
    assert NamespaceSpec.parse(value) == expected


@pytest.mark.parametrize("value", ["ns", "a:b:c:d", "ns:abc", "ns:4096:lots", "ns:-1"])
def test_namespace_spec_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        NamespaceSpec.parse(value)


def test_namespace_spec_dict_without_page_bytes() -> None:
    with pytest.raises(KeyError):
        NamespaceSpec.parse({"name": "ns"})


# ---------------------------------------------------------------------------
# the settings table and build_config
# ---------------------------------------------------------------------------

def test_every_setting_is_described_once() -> None:
    """Each setting has its help, metavar and group on its field; flags and env names follow from the name."""
    assert [s.name for s in SETTINGS] == list(NodeConfig.model_fields)
    for s in SETTINGS:
        assert s.help and s.metavar and s.group in GROUPS, s.name
        assert s.flag == "--" + s.name.replace("_", "-") and s.env == "KVSTORED_" + s.name.upper()
        assert NodeConfig().__getattribute__(s.name) == s.default
    # the groups appear in order in the field list, each once
    seen = [g for i, g in enumerate(s.group for s in SETTINGS) if i == 0 or SETTINGS[i - 1].group != g]
    assert seen == list(GROUPS)


def test_configuration_doc_is_generated_from_the_settings() -> None:
    """docs/configuration.md is `python -m kvstore.config` output: regenerate it when a setting changes."""
    doc = REPO_ROOT / "docs" / "configuration.md"
    assert doc.read_text() == markdown(), "docs/configuration.md is stale: python -m kvstore.config > " \
                                          "docs/configuration.md"
    for s in SETTINGS:
        assert f"`{s.flag} {s.metavar}`" in doc.read_text() and f"`{s.env}`" in doc.read_text()


def test_settings_feed_the_planner_and_predictor_by_knob_name() -> None:
    cfg = config_from(["--spec-threshold", "0.7", "--copy-fanout", "3", "--planner-tick", "0.25",
                       "--predictor-depths", "1,2,4,8,16", "--predictor-horizon", "120"])
    plan, pred = PlannerConfig(**cfg.feeding("planner")), PredictorConfig(**cfg.feeding("predictor"))
    assert (plan.threshold, plan.fanout, plan.tick_s, plan.ttl_s) == (0.7, 3, 0.25, 120.0)
    assert (pred.depths, pred.horizon_s, pred.momentum_window_s) == ((1, 2, 4, 8, 16), 120.0, 60.0)
    assert plan.max_targets == PlannerConfig().max_targets  # a knob no setting names keeps its default


def test_defaults_without_any_source() -> None:
    assert config_from() == NodeConfig()


def test_help_mentions_every_setting() -> None:
    text = make_parser().format_help()
    assert "--config" in text and "--version" in text and "precedence" in text
    for s in SETTINGS:
        assert "--" + s.name.replace("_", "-") in text, s.name
        assert "KVSTORED_" + s.name.upper() in text, s.name


def test_precedence_defaults_file_env_flags(tmp_path: Path) -> None:
    path = write_toml(tmp_path, """
capacity = "2GiB"
data-port = 1111
metrics_port = 2222
grace = 1.5
log-level = "debug"
max_pin_ttl = 60
""")
    env = {"KVSTORED_METRICS_PORT": "3333", "KVSTORED_GRACE": "2.5", "KVSTORED_CAPACITY": "3GiB"}
    cfg = config_from(["--config", str(path), "--grace", "4", "--capacity", "4GiB"], env)
    assert cfg.capacity == 4 * GiB        # flag beats env and file
    assert cfg.grace == 4.0               # flag beats env and file
    assert cfg.metrics_port == 3333       # env beats file
    assert cfg.data_port == 1111          # file beats default ('-' spelling)
    assert cfg.log_level == "debug"       # file, '-' spelling
    assert cfg.max_pin_ttl == 60.0        # file, '_' spelling; TOML int to float
    assert cfg.loop == "auto" and cfg.listen == NodeConfig().listen  # defaults
    # one setting through all four levels
    assert config_from([]).capacity == GiB
    assert config_from(["--config", str(path)]).capacity == 2 * GiB
    assert config_from(["--config", str(path)], {"KVSTORED_CAPACITY": "3GiB"}).capacity == 3 * GiB
    assert config_from(["--config", str(path), "--capacity", "4GiB"], {"KVSTORED_CAPACITY": "3GiB"}).capacity == 4 * GiB


def test_environment_is_read_from_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORED_MAX_BATCH_PAGES", "77")
    assert build_config(make_parser().parse_args([])).max_batch_pages == 77
    # an explicit environ replaces os.environ entirely
    assert build_config(make_parser().parse_args([]), environ={}).max_batch_pages == 65536


def test_every_setting_from_flags() -> None:
    cfg = config_from([
        "--listen", "[::1]:7500", "--node-id", "n1", "--capacity", "2GiB", "--device", "cuda:1",
        "--peers", "a:1,b:2", "--namespace", "a:4KiB", "--namespace", "b:1MiB:64MiB", "--prefault", "false",
        "--data-port", "-1", "--metrics-port", "9100", "--log-level", "warning", "--loop", "asyncio",
        "--max-message-bytes", "8MiB", "--max-batch-pages", "10", "--max-batch-bytes", "1MiB",
        "--max-pin-ttl", "30", "--grace", "0",
    ])
    assert cfg == NodeConfig(
        listen="[::1]:7500", node_id="n1", capacity=2 * GiB, device="cuda:1", peers=("a:1", "b:2"),
        namespace=(NamespaceSpec("a", 4 * KiB), NamespaceSpec("b", MiB, 64 * MiB)), prefault=False,
        data_port=-1, metrics_port=9100, log_level="warning", loop="asyncio", max_message_bytes=8 * MiB,
        max_batch_pages=10, max_batch_bytes=MiB, max_pin_ttl=30.0, grace=0.0,
    )
    assert cfg.host == "::1"


def test_every_setting_from_environment() -> None:
    env = {
        "KVSTORED_LISTEN": "0.0.0.0:1", "KVSTORED_NODE_ID": "n2", "KVSTORED_CAPACITY": "1e9",
        "KVSTORED_DEVICE": "cpu", "KVSTORED_PEERS": "x:1", "KVSTORED_NAMESPACE": "m:4096:1MiB",
        "KVSTORED_PREFAULT": "off", "KVSTORED_DATA_PORT": "5000", "KVSTORED_METRICS_PORT": "0",
        "KVSTORED_LOG_LEVEL": "error", "KVSTORED_LOOP": "uvloop", "KVSTORED_MAX_MESSAGE_BYTES": "2MiB",
        "KVSTORED_MAX_BATCH_PAGES": "5", "KVSTORED_MAX_BATCH_BYTES": "4MiB", "KVSTORED_MAX_PIN_TTL": "1.5",
        "KVSTORED_GRACE": "9",
        "KVSTORED_UNRELATED": "ignored",
    }
    cfg = config_from([], env)
    assert cfg == NodeConfig(
        listen="0.0.0.0:1", node_id="n2", capacity=10**9, device="cpu", peers=("x:1",),
        namespace=(NamespaceSpec("m", 4096, MiB),), prefault=False, data_port=5000, metrics_port=0,
        log_level="error", loop="uvloop", max_message_bytes=2 * MiB, max_batch_pages=5, max_batch_bytes=4 * MiB,
        max_pin_ttl=1.5, grace=9.0,
    )


def test_toml_native_types_and_namespace_tables(tmp_path: Path) -> None:
    path = write_toml(tmp_path, """
capacity = 1073741824
prefault = false
peers = ["a:1", "b:2"]
max_batch_bytes = "16MiB"

[[namespace]]
name = "a"
page_bytes = "4KiB"

[[namespace]]
name = "b"
page_bytes = 8192
capacity = "1MiB"
""")
    cfg = config_from(["--config", str(path)])
    assert cfg.capacity == GiB and cfg.prefault is False and cfg.peers == ("a:1", "b:2")
    assert cfg.max_batch_bytes == 16 * MiB
    assert cfg.namespace == (NamespaceSpec("a", 4 * KiB), NamespaceSpec("b", 8192, MiB))


def test_toml_namespace_as_strings(tmp_path: Path) -> None:
    path = write_toml(tmp_path, 'namespace = ["a:4096", "b:1KiB:1MiB"]\n')
    assert config_from(["--config", str(path)]).namespace == (NamespaceSpec("a", 4096), NamespaceSpec("b", KiB, MiB))
    path = write_toml(tmp_path, 'namespace = "c:4096"\n')
    assert config_from(["--config", str(path)]).namespace == (NamespaceSpec("c", 4096),)
    # flags replace (not extend) the file's namespaces
    assert config_from(["--config", str(path), "--namespace", "d:1"]).namespace == (NamespaceSpec("d", 1),)


@pytest.mark.parametrize("key", ["bogus_key", "no-such-setting", "config", "Capacity"])
def test_unknown_toml_key_is_rejected_by_name(tmp_path: Path, key: str) -> None:
    path = write_toml(tmp_path, f'capacity = "1GiB"\n"{key}" = 1\n')
    with pytest.raises(ValueError, match=f"unknown setting '{key}'") as info:
        config_from(["--config", str(path)])
    assert str(path) in str(info.value)


def test_bad_toml_file_and_missing_file(tmp_path: Path) -> None:
    path = write_toml(tmp_path, "capacity = = 1\n")
    with pytest.raises(tomllib.TOMLDecodeError):
        config_from(["--config", str(path)])
    with pytest.raises(FileNotFoundError):
        config_from(["--config", str(tmp_path / "missing.toml")])


@pytest.mark.parametrize(("setting", "value"), [
    ("capacity", "lots"), ("device", "gpu"), ("peers", "a:1,a:1"), ("peers", "a:0"), ("namespace", "ns"),
    ("prefault", "maybe"), ("data_port", "http"), ("metrics_port", "1.5"), ("log_level", "loud"),
    ("loop", "trio"), ("max_message_bytes", "-1"), ("max_batch_pages", "1e3"), ("max_batch_bytes", "x"),
    ("max_pin_ttl", "forever"), ("grace", "soon"),
])
def test_bad_values_name_the_setting_and_source(tmp_path: Path, setting: str, value: str) -> None:
    env_name = "KVSTORED_" + setting.upper()
    flag = "--" + setting.replace("_", "-")
    with pytest.raises(ValueError, match=f"^{env_name}: {setting}: "):
        config_from([], {env_name: value})
    with pytest.raises(ValueError, match=f"^{flag}: {setting}: "):
        config_from([flag, value])
    path = write_toml(tmp_path, f'{setting.replace("_", "-")} = "{value}"\n')
    with pytest.raises(ValueError, match=f": {setting}: ") as info:
        config_from(["--config", str(path)])
    assert str(info.value).startswith(str(path))


def test_toml_namespace_table_without_page_bytes_names_the_setting(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[[namespace]]\nname = "a"\n')
    with pytest.raises(ValueError, match="namespace: a namespace table needs 'page_bytes'"):
        config_from(["--config", str(path)])


@pytest.mark.parametrize(("setting", "value", "message"), [
    ("capacity", "0", "capacity: Input should be greater than 0"),
    ("data_port", "70000", "data_port: Input should be less than or equal to 65535"),
    ("data_port", "-2", "data_port: Input should be greater than or equal to -1"),
    ("metrics_port", "65536", "metrics_port: Input should be less than or equal to 65535"),
    ("max_message_bytes", "1KiB", "max_message_bytes: Input should be greater than or equal to 1048576"),
    ("max_pin_ttl", "0", "max_pin_ttl: Input should be greater than 0"),
    ("max_pin_ttl", "1e9", "max_pin_ttl: Input should be less than or equal to 604800"),
    ("grace", "-1", "grace: Input should be greater than or equal to 0"),
])
def test_values_rejected_by_node_config_name_the_setting(setting: str, value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from([], {"KVSTORED_" + setting.upper(): value})


def test_bad_listen_names_the_setting() -> None:
    with pytest.raises(ValueError, match="listen"):
        config_from(["--listen", "nohost"])


@pytest.mark.parametrize("line", ["peers = [1234]", "peers = 5", "device = 5", "namespace = 5"])
def test_toml_value_of_wrong_type_names_the_setting(tmp_path: Path, line: str) -> None:
    path = write_toml(tmp_path, line + "\n")
    with pytest.raises(ValueError, match=line.split()[0]):
        config_from(["--config", str(path)])


def test_kvstored_main_reports_bad_config_as_usage_error(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [n for n in os.environ if n.startswith("KVSTORED_")]:
        monkeypatch.delenv(name)
    with pytest.raises(SystemExit) as info:
        main(["--capacity", "0"])
    assert info.value.code == 2
    assert "--capacity: capacity: Input should be greater than 0" in capsys.readouterr().err


# ---------------------------------------------------------------------------
# NodeConfig validation
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    ({"capacity": 0}, "capacity"),
    ({"capacity": -1}, "capacity"),
    ({"device": "gpu"}, "bad device"),
    ({"device": "cuda:"}, "bad device"),
    ({"listen": "nohost"}, "bad address"),
    ({"listen": "h:65536"}, "bad port"),
    ({"data_port": -2}, "data_port"),
    ({"data_port": 65536}, "data_port"),
    ({"metrics_port": -2}, "metrics_port"),
    ({"metrics_port": 100000}, "metrics_port"),
    ({"max_message_bytes": MiB - 1}, "max_message_bytes"),
    ({"max_batch_pages": 0}, "max_batch_pages"),
    ({"max_batch_bytes": 0}, "max_batch_bytes"),
    ({"max_pin_ttl": 0.0}, "max_pin_ttl"),
    ({"max_pin_ttl": 604800.5}, "max_pin_ttl"),
    ({"max_pin_ttl": math.nan}, "max_pin_ttl"),
    ({"grace": -0.1}, "grace"),
])
def test_node_config_rejects(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NodeConfig(**overrides)


@pytest.mark.parametrize("overrides", [
    {}, {"capacity": 1}, {"device": "cpu"}, {"device": "cuda:3"}, {"listen": "[::1]:0"}, {"data_port": -1},
    {"data_port": 65535}, {"metrics_port": 0}, {"max_message_bytes": MiB}, {"max_pin_ttl": 604800.0},
    {"grace": 0.0},
])
def test_node_config_accepts(overrides: dict[str, Any]) -> None:
    cfg = NodeConfig(**overrides)
    assert cfg.host == parse_hostport(cfg.listen)[0]


def test_node_config_rejects_nan_grace() -> None:
    with pytest.raises(ValueError, match="grace"):
        NodeConfig(grace=math.nan)


def test_node_config_is_frozen_and_rejects_unknown_settings() -> None:
    cfg = NodeConfig()
    with pytest.raises(ValueError, match="frozen"):
        cfg.capacity = 5  # type: ignore[misc]
    with pytest.raises(ValueError, match="bogus"):
        NodeConfig(bogus=1)  # type: ignore[call-arg]
    assert cfg == NodeConfig() and hash(cfg) == hash(NodeConfig())


# ---------------------------------------------------------------------------
# PageLayout
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("page_bytes", [0, -1, -4096])
def test_layout_page_bytes_must_be_positive(page_bytes: int) -> None:
    with pytest.raises(InvalidArgument, match="page_bytes must be > 0"):
        PageLayout(page_bytes)


def test_layout_page_bytes_only() -> None:
    layout = PageLayout(4096)
    assert layout.block_bytes == 0
    assert layout == PageLayout(4096) and layout != PageLayout(8192)


@pytest.mark.parametrize("shape", [
    {"block_tokens": 16},
    {"block_tokens": 16, "num_layers": 2, "kv_heads": 8, "head_dim": 128},  # no dtype
    {"dtype": 1},  # dtype alone
    {"block_tokens": 16, "num_layers": 2, "kv_heads": 8, "dtype": 1},  # no head_dim
    {"num_layers": 2, "kv_heads": 8, "head_dim": 128, "dtype": 1},  # no block_tokens
    {"block_tokens": 16, "num_layers": 2, "kv_heads": 8, "head_dim": 128, "dtype": 6},  # unknown dtype
    {"block_tokens": 16, "num_layers": 2, "kv_heads": 8, "head_dim": 128, "dtype": -1},
])
def test_layout_partial_engine_shape_rejected(shape: dict[str, int]) -> None:
    with pytest.raises(InvalidArgument, match="give all of block_tokens, num_layers, kv_heads, head_dim and dtype"):
        PageLayout(2 * 2 * 16 * 8 * 128 * 2, **shape)


@pytest.mark.parametrize(("dtype", "elem"), [(1, 2), (2, 2), (3, 1), (4, 1), (5, 4)],
                         ids=["fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "fp32"])
def test_layout_valid_engine_shapes(dtype: int, elem: int) -> None:
    assert DTYPES[dtype][1] == elem
    layers, tokens, heads, dim = 32, 16, 8, 128
    page_bytes = layers * 2 * tokens * heads * dim * elem
    layout = PageLayout(page_bytes, block_tokens=tokens, num_layers=layers, kv_heads=heads, head_dim=dim, dtype=dtype)
    assert layout.block_bytes == tokens * heads * dim * elem
    assert layout.num_layers * 2 * layout.block_bytes == page_bytes


@pytest.mark.parametrize("page_bytes", [2 * 2 * 16 * 8 * 128 * 2 + 1, 2 * 2 * 16 * 8 * 128 * 2 - 1,
                                        2 * 16 * 8 * 128 * 2, 2 * 2 * 16 * 8 * 128 * 4])
def test_layout_shape_must_multiply_out_to_page_bytes(page_bytes: int) -> None:
    with pytest.raises(InvalidArgument, match=f"= {2 * 2 * 16 * 8 * 128 * 2}, but page_bytes = {page_bytes}"):
        PageLayout(page_bytes, block_tokens=16, num_layers=2, kv_heads=8, head_dim=128, dtype=1)


def test_layout_negative_dimensions_rejected() -> None:
    with pytest.raises(InvalidArgument):
        PageLayout(2 * 2 * 16 * 8 * 128 * 2, block_tokens=-16, num_layers=2, kv_heads=-8, head_dim=128, dtype=1)


# ---------------------------------------------------------------------------
# check_keys
# ---------------------------------------------------------------------------

def test_check_keys_accepts_1_to_64_bytes() -> None:
    assert MAX_KEY_BYTES == 64
    check_keys([])
    check_keys([b"a", b"k" * 64, bytes(16)])


@pytest.mark.parametrize(("keys", "index", "length"), [
    ([b""], 0, 0), ([b"ok", b""], 1, 0), ([b"k" * 65], 0, 65), ([b"a", b"b", b"k" * 100], 2, 100),
])
def test_check_keys_rejects_bad_lengths(keys: list[bytes], index: int, length: int) -> None:
    with pytest.raises(InvalidArgument, match=f"key #{index} has {length} bytes; keys must be 1..64 bytes"):
        check_keys(keys)
    with pytest.raises(InvalidArgument, match=f"key #{index}"):
        check_keys(keys, allow_duplicates=True)


def test_check_keys_duplicates() -> None:
    keys = [b"a", b"\x01\x02", b"c", b"\x01\x02", b"a"]
    with pytest.raises(InvalidArgument, match="duplicate key 0102 in one batch"):
        check_keys(keys)  # names the first key seen twice
    check_keys(keys, allow_duplicates=True)


# ---------------------------------------------------------------------------
# every source gives every setting the same value; grouped TOML tables
# ---------------------------------------------------------------------------

# A value users write for each setting, other than its default: flags, env and TOML strings all take it.
SAMPLES: dict[str, str] = {
    "listen": "127.0.0.1:7999", "node_id": "n9", "data_port": "-1", "metrics_port": "9100", "log_level": "debug",
    "loop": "asyncio", "grace": "1.5", "shm": "off", "shm_dir": "/tmp/kv-shm", "capacity": "4GiB",
    "device": "cpu-staged", "namespace": "a:256MiB:1GiB", "prefault": "no", "checksum": "false",
    "tier": "disk:/mnt/nv:me0:4GiB", "tier_write": "through", "tier_staging": "64MiB", "tier_io": "buffered",
    "tier_threads": "2", "tier_admit": "predicted", "tier_write_budget": "3.5e8", "tier_reuse_horizon": "300",
    "tier_read_rate": "5e9", "tier_write_rate": "3e9",
    "peers": "10.0.0.1:7400,10.0.0.2:7400", "membership": "etcd://127.0.0.1:2379", "heartbeat_interval": "0.2",
    "heartbeat_timeout": "3", "transport": "tcp", "transport_port": "7500", "replication": "predictive",
    "keep_fetched": "0", "fetch_timeout": "2", "deadline_share": "0.5", "max_pull_bytes": "128MiB",
    "control_timeout": "2", "link_rate": "1.25e10", "link_latency": "5e-6", "predictor_model": "none",
    "predictor_depths": "1,2,4,8,16", "predictor_horizon": "120", "predictor_momentum_window": "30",
    "planner_tick": "0.2", "spec_threshold": "0.5", "spec_budget": "0.3", "spec_bandwidth": "2.5e9",
    "spec_ttl": "60", "node_rate": "0", "copy_fanout": "4", "copy_chunks": "8", "copy_part_min": "0.05", "join_warm": "10",
    "tls_cert": "/etc/node.pem", "tls_key": "/etc/node.key", "tls_ca": "/etc/ca.pem", "tls_client_auth": "yes",
    "token_file": "/etc/tokens.toml", "cluster_secret_file": "/etc/secret", "insecure": "on",
    "max_message_bytes": "256MiB", "max_batch_pages": "1024", "max_batch_bytes": "2GiB", "max_pin_ttl": "60",
    "max_claim_seconds": "30", "transfer_timeout": "10", "read_timeout": "1", "idle_timeout": "30",
    "max_connections": "64", "shm_hold_timeout": "10",
}


def test_samples_cover_every_setting() -> None:
    assert sorted(SAMPLES) == sorted(s.name for s in SETTINGS)


def test_every_source_parses_every_setting_alike(tmp_path: Path) -> None:
    flags = [x for s in SETTINGS for x in (s.flag, SAMPLES[s.name])]
    env = {s.env: SAMPLES[s.name] for s in SETTINGS}
    toml = write_toml(tmp_path, "".join(f'{s.name} = "{SAMPLES[s.name]}"\n' for s in SETTINGS))
    grouped = write_toml(tmp_path / "..", "".join(
        f"[{g}]\n" + "".join(f'{s.name.replace("_", "-")} = "{SAMPLES[s.name]}"\n' for s in SETTINGS if s.group == g)
        for g in GROUPS))
    by_flags = config_from(flags)
    assert config_from([], env) == by_flags
    assert config_from(["--config", str(toml)]) == by_flags
    assert config_from(["--config", str(grouped)]) == by_flags
    for s in SETTINGS:
        assert getattr(by_flags, s.name) != s.default, s.name
    assert by_flags.capacity == 4 * GiB and by_flags.spec_bandwidth == 25 * 10**8 and by_flags.link_rate == 1.25e10
    assert by_flags.shm is False and by_flags.tls_client_auth is True and by_flags.peers[1] == "10.0.0.2:7400"
    assert by_flags.namespace == (NamespaceSpec("a", 256 * MiB, GiB),)
    # a node started with setting_flags(...) of a config gets the same values back
    assert config_from(setting_flags({s.name: getattr(by_flags, s.name) for s in SETTINGS})) == by_flags


def test_a_setting_in_the_wrong_group_table_is_rejected(tmp_path: Path) -> None:
    path = write_toml(tmp_path, '[pool]\nheartbeat_interval = 0.2\n')
    with pytest.raises(ValueError, match=r"'heartbeat_interval' belongs in \[cluster\], not in \[pool\]"):
        config_from(["--config", str(path)])


def test_help_lists_settings_by_group_with_bounds() -> None:
    text = make_parser().format_help()
    for group in GROUPS:
        assert f"\n{group}:\n" in text, group
    assert "[default: 1073741824; > 0; env KVSTORED_CAPACITY]" in " ".join(text.split())
    assert "[default: -1; -1..65535; env KVSTORED_METRICS_PORT]" in " ".join(text.split())


def test_override_flag_keeps_the_setting_text_and_its_own_default() -> None:
    import argparse

    p = argparse.ArgumentParser()
    add_override(p, "heartbeat_interval", 0.2, flag="--heartbeat", note="real seconds")
    args = p.parse_args([])
    assert args.heartbeat_interval == 0.2
    text = " ".join(p.format_help().split())
    assert "kvstored --heartbeat-interval: seconds between heartbeats to each peer; real seconds" in text
    assert p.parse_args(["--heartbeat", "0.3"]).heartbeat_interval == 0.3  # in the type of the default
    add_override(p, "predictor_depths", "1,2,4,8,16")
    assert p.parse_args(["--predictor-depths", "1,2,4"]).predictor_depths == "1,2,4"  # a string stays as written
    for bad in (["--heartbeat", "-1"], ["--predictor-depths", "4,2"]):  # the setting's own bounds and checks
        with pytest.raises(SystemExit):
            p.parse_args(bad)


def test_a_cross_setting_error_names_no_setting_but_says_what() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval < heartbeat_timeout"):
        config_from(["--heartbeat-interval", "3", "--heartbeat-timeout", "2"])
    with pytest.raises(ValueError, match="tls_cert and tls_key go together"):
        config_from([], {"KVSTORED_TLS_CERT": "/x.pem"})


def test_tier_specs_take_paths_with_colons_and_refuse_what_cannot_work() -> None:
    from kvstore.config import TierSpec

    cfg = NodeConfig(tier=["host:1GiB", "disk:/mnt/a:b/kv:4GiB", {"kind": "disk", "path": "/x,y", "capacity": "1GiB"}])
    assert cfg.tier == (TierSpec("host", 1 << 30), TierSpec("disk", 4 << 30, "/mnt/a:b/kv"),
                        TierSpec("disk", 1 << 30, "/x,y"))
    for bad, why in (("disk:relative:1GiB", "absolute"), ("disk:/a:0", "> 0"), ("nvme:/a:1GiB", "expected"),
                     (["disk:/a:1GiB", "host:1GiB"], "list it first"), (["disk:/a:1GiB", "disk:/a:2GiB"], "one folder"),
                     (["host:1GiB", "host:2GiB"], "at most one")):
        with pytest.raises(ValueError, match=why):
            NodeConfig(tier=bad)
