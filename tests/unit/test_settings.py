"""Config: the article's files verbatim, each clear-error case, and the source order."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from pydantic import ValidationError

from taogate.client_profile import ClientSettings
from taogate.config_files import load_settings, redacted_dump
from taogate.control.discovery import discovered_specs
from taogate.settings import ConfigError, Settings, expand_env

ROOT = Path(__file__).resolve().parents[2]

# ../shared/seed/README.md, copied verbatim.
ARTICLE_TOML = """\
[gateway]
base_url = "https://taotoken.net/api"   # API base: no UTM/query parameters
api_key_env = "TAOTOKEN_API_KEY"        # the unified key is read from this env var, never hard-coded
request_timeout = 120                   # seconds; enlarge for long prefill inputs
max_connections = 64                    # connection pool size; bounds concurrent dispatch

[dispatch]
strategy = "least_busy"                 # round_robin / least_busy
health_check_interval = 10              # seconds
max_queue_per_instance = 32             # past this, forward to another instance

[prefill]
tag = "prefill"                         # marks prefill traffic in logs
long_input_threshold = 4096             # tokens; longer inputs take a separate channel
"""

ARTICLE_JSON = """\
{
  "taotoken": {
    "base_url": "https://taotoken.net/api",
    "api_key": "${TAOTOKEN_API_KEY}",
    "default_model": "your-model-name",
    "timeout": {"connect": 10, "read": 120, "write": 30},
    "retry": {"max_attempts": 3, "backoff_base": 0.5, "backoff_max": 8},
    "headers": {"X-Request-Tag": "prefill-bench"}
  },
  "vllm": {
    "instances": ["http://127.0.0.1:8000", "http://127.0.0.1:8001",
                  "http://127.0.0.1:8002", "http://127.0.0.1:8003"],
    "tensor_parallel_size": 4
  }
}
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("TAOGATE_"):
            monkeypatch.delenv(name)


def write(tmp_path: Path, toml: str, js: str | None = None) -> Path:
    cfg = tmp_path / "config.toml"
    cfg.write_text(toml, encoding="utf-8")
    if js is not None:
        (tmp_path / "settings.json").write_text(js, encoding="utf-8")
    return cfg


def test_article_files_verbatim_work(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, ARTICLE_TOML, ARTICLE_JSON))
    assert s.gateway.prefix == "/api"
    assert s.gateway.request_timeout == 120
    assert s.dispatch.strategy == "least_busy"
    assert s.dispatch.max_queue_per_instance == 32
    assert s.prefill.long_input_threshold == 4096
    assert [i.url for i in s.instances] == [f"http://127.0.0.1:{p}" for p in range(8000, 8004)]
    assert [i.label for i in s.instances] == [f"127.0.0.1:{p}" for p in range(8000, 8004)]
    # Its one weak spot, said plainly: 4 instances x 32 can hold more requests than 64 connections.
    assert s.warnings() == [
        "[gateway] max_connections = 64 is below the sum of the instances' caps (128): requests past "
        "it wait for a free upstream connection, and get 503 after request_timeout."
    ]


def test_the_upstream_pool_follows_the_instances_caps_unless_set() -> None:
    urls = [{"url": f"http://127.0.0.1:{8000 + i}"} for i in range(4)]
    fleet = Settings(instances=urls, overflow={"url": "http://127.0.0.1:9000", "max_queue": 8})
    assert fleet.gateway.max_connections is None and fleet.warnings() == []
    assert (fleet.instance_caps(), fleet.upstream_connections()) == (4 * 32 + 8, 136)
    assert Settings(instances=urls[:1]).upstream_connections() == 64  # room for discovered ones
    assert Settings(gateway={"max_connections": 500}, instances=urls).upstream_connections() == 500


def test_settings_json_given_explicitly(tmp_path: Path) -> None:
    cfg = write(tmp_path, ARTICLE_TOML)
    other = tmp_path / "elsewhere.json"
    other.write_text(ARTICLE_JSON, encoding="utf-8")
    assert len(load_settings(cfg).instances) == 0
    assert len(load_settings(cfg, other).instances) == 4


def test_toml_instances_win_over_settings_json(tmp_path: Path) -> None:
    toml = ARTICLE_TOML + '\n[[instances]]\nurl = "http://127.0.0.1:9000/v1"\nname = "gpu0"\nrole = "long"\n'
    s = load_settings(write(tmp_path, toml, ARTICLE_JSON))
    assert [(i.url, i.label, i.role) for i in s.instances] == [("http://127.0.0.1:9000", "gpu0", "long")]


def test_misspelled_strategy_lists_accepted_values(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, ARTICLE_TOML.replace('"least_busy"', '"least-busy"')))
    msg = str(e.value)
    assert "dispatch.strategy" in msg and "least_busy, round_robin" in msg and "'least-busy'" in msg


def test_base_url_with_utm_query_is_rejected_with_the_fix(tmp_path: Path) -> None:
    bad = ARTICLE_TOML.replace(
        '"https://taotoken.net/api"',
        '"https://taotoken.net/?utm_source=taotoken_aicg_blog_end&utm_medium=csdn"',
    )
    with pytest.raises(ConfigError) as e:
        load_settings(write(tmp_path, bad))
    msg = str(e.value)
    assert "gateway.base_url" in msg and "utm" in msg and "404" in msg and "https://taotoken.net/" in msg


def test_unset_key_env_names_the_variable(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, ARTICLE_TOML))
    with pytest.raises(ConfigError, match="TAOTOKEN_API_KEY"):
        s.api_key({})
    assert s.api_key({"TAOTOKEN_API_KEY": "k"}) == "k"


def test_short_read_timeout_warns(tmp_path: Path) -> None:
    s = load_settings(write(tmp_path, ARTICLE_TOML.replace("request_timeout = 120", "request_timeout = 29")))
    assert any("request_timeout" in w and "120" in w for w in s.warnings())


def test_unknown_key_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"dispatch\.stratgy: unknown key"):
        load_settings(write(tmp_path, ARTICLE_TOML.replace("[dispatch]", "[dispatch]\nstratgy = 1")))


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"config\.toml is not valid TOML"):
        load_settings(write(tmp_path, "[gateway\n"))


def test_source_order_flags_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path, ARTICLE_TOML)
    monkeypatch.setenv("TAOGATE_DISPATCH__STRATEGY", "round_robin")
    monkeypatch.setenv("TAOGATE_GATEWAY__PORT", "9001")
    s = load_settings(cfg)
    assert s.dispatch.strategy == "round_robin"
    assert s.dispatch.max_queue_per_instance == 32  # the file's value survives a sibling env override
    assert s.gateway.port == 9001
    s = load_settings(cfg, overrides={"gateway": {"port": 9002}})
    assert s.gateway.port == 9002
    assert type(s) is Settings


def test_duplicate_instance_names_rejected(tmp_path: Path) -> None:
    toml = ARTICLE_TOML + '[[instances]]\nurl = "http://127.0.0.1:1"\nname = "a"\n'
    toml += '[[instances]]\nurl = "http://127.0.0.1:2"\nname = "a"\n'
    with pytest.raises(ConfigError, match="repeated: a"):
        load_settings(write(tmp_path, toml))


def test_expand_env() -> None:
    assert expand_env("${A}-x", {"A": "1"}) == "1-x"
    with pytest.raises(ConfigError, match=r"\$\{B\}"):
        expand_env("${B}", {})


def test_redacted_dump_round_trips_and_masks_url_credentials(tmp_path: Path) -> None:
    import tomli_w

    toml = ARTICLE_TOML + '[[instances]]\nurl = "http://user:secret@127.0.0.1:8000"\n'
    toml += '[[instances]]\nurl = "http://user:secret@[fd00::1]:8000"\n'
    s = load_settings(write(tmp_path, toml))
    text = tomli_w.dumps(redacted_dump(s))
    assert "secret" not in text
    again = tomllib.loads(text)
    assert again["dispatch"]["strategy"] == "least_busy"
    assert [i["url"] for i in again["instances"][:2]] == [
        "http://***@127.0.0.1:8000",
        "http://***@[fd00::1]:8000",
    ]


def test_shipped_config_is_the_init_template_and_loads() -> None:
    template = ROOT / "src" / "taogate" / "templates"
    assert (ROOT / "config.toml").read_text() == (template / "config.toml").read_text()
    assert json.loads((ROOT / "settings.json").read_text()) == json.loads(
        (template / "settings.json").read_text()
    )
    s = load_settings(ROOT / "config.toml")
    assert len(s.instances) == 4 and s.gateway.prefix == "/api"


def test_readme_config_reference_lists_every_key() -> None:
    from taogate.settings import (
        DiscoverySettings,
        DispatchSettings,
        GatewaySettings,
        InstanceSettings,
        PrefillSettings,
        RetrySettings,
    )

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    rows = {
        (cells[1].strip("` "), cells[2].strip("` "))
        for line in readme.splitlines()
        if line.startswith("| `") and len(cells := line.split("|")) > 3
    }
    sections = {
        "gateway": GatewaySettings,
        "dispatch": DispatchSettings,
        "dispatch.retry": RetrySettings,
        "prefill": PrefillSettings,
        "instances": InstanceSettings,
        "discovery": DiscoverySettings,
    }
    expected = {(sec, name) for sec, cls in sections.items() for name in cls.model_fields if name != "retry"}
    assert expected - rows == set()
    assert {r for r in rows if r[0] in sections} - expected == set()


def test_every_strategy_the_config_accepts_builds_its_policy() -> None:
    from taogate.dispatch.policy import make_policy
    from taogate.settings import STRATEGIES

    assert {make_policy(name).name for name in STRATEGIES} == set(STRATEGIES)


def test_instance_labels_never_carry_url_credentials(tmp_path: Path) -> None:
    toml = ARTICLE_TOML + '[[instances]]\nurl = "http://user:secret@127.0.0.1:8000"\n'
    s = load_settings(write(tmp_path, toml))
    assert s.instances[0].label == "127.0.0.1:8000"


def test_overflow_name_must_not_collide_with_an_instance(tmp_path: Path) -> None:
    toml = (
        ARTICLE_TOML
        + '[[instances]]\nurl = "http://127.0.0.1:8000"\nname = "a"\n'
        + '[overflow]\nurl = "http://127.0.0.1:8001"\nname = "a"\n'
    )
    with pytest.raises(ConfigError, match="must be unique"):
        load_settings(write(tmp_path, toml))


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"),
        ("http://GPU-1:80", "http://gpu-1"),
        ("https://user:pw@gpu-1", "https://gpu-1:443/"),
    ],
)
def test_one_server_listed_twice_is_said_whatever_its_names(first: str, second: str) -> None:
    """Two entries for one server are two caps on one queue; an overflow that is a listed instance
    lets traffic past that instance's cap. Said, not refused: a test may mean it (one server as a
    fleet of two, as `diagnose` runs a homogeneous fleet on one real server)."""
    for doc in (
        {"instances": [{"url": first, "name": "a"}, {"url": second, "name": "b"}]},
        {"instances": [{"url": first, "name": "a"}], "overflow": {"url": second, "name": "b"}},
    ):
        warnings = Settings.model_validate(doc).warnings()
        assert any("one server twice" in w for w in warnings), warnings
    with pytest.raises(ValueError, match="remove the repeat"):  # unnamed, one URL: one name twice
        Settings.model_validate({"instances": [{"url": first}, {"url": first}]})
    alone = Settings.model_validate({"instances": [{"url": first}, {"url": "http://127.0.0.1:8009"}]})
    assert not any("one server twice" in w for w in alone.warnings())


def test_instance_keys_are_trimmed_and_control_characters_refused() -> None:
    from taogate.fleet.fleet import specs_from_settings

    s = Settings.model_validate(
        {"instances": [{"url": "http://127.0.0.1:9000", "name": "a", "api_key_env": "A_KEY"}]}
    )
    assert specs_from_settings(s, {"A_KEY": "sk-1\n"})[0].api_key == "sk-1"
    assert specs_from_settings(s, {"A_KEY": "  "})[0].api_key is None
    with pytest.raises(ConfigError, match="A_KEY holds a control character"):
        specs_from_settings(s, {"A_KEY": "sk-1\r\nx-evil: 1"})
    # The discovered instances' key, the same way (a k8s secret ends in a newline).
    found = Settings(discovery={"dns": "vllm.test", "api_key_env": "POD_KEY"})
    assert discovered_specs(["10.0.0.1"], found.discovery, found, {"POD_KEY": "sk-2\n"})[0].api_key == "sk-2"
    with pytest.raises(ConfigError, match="POD_KEY holds a control character"):
        discovered_specs(["10.0.0.1"], found.discovery, found, {"POD_KEY": "sk\r\nx-evil: 1"})


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://[::]:5557"])
def test_discovery_takes_a_wildcard_kv_events_endpoint_every_pod_binds(endpoint: str) -> None:
    s = Settings(discovery={"dns": "vllm.test", "kv_events": endpoint, "kv_events_replay": "tcp://*:5558"})
    assert s.kv_events and s.discovery.kv_events == endpoint
    assert not Settings(discovery={"dns": "vllm.test"}).kv_events
    # The overflow instance's own events count too: a tokenizer that fails to load is then an error.
    assert Settings(overflow={"url": "http://127.0.0.1:9000", "kv_events": "tcp://127.0.0.1:5557"}).kv_events


@pytest.mark.parametrize(
    "endpoint", ["tcp://10.0.0.2:5557", "ipc:///tmp/kv", "tcp://*", "tcp://*:x", "*:5557"]
)
def test_discovery_refuses_an_endpoint_a_pod_would_not_bind(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="wildcard endpoint"):
        Settings(discovery={"dns": "vllm.test", "kv_events": endpoint})


def test_discovery_kv_events_without_dns_is_warned_about() -> None:
    s = Settings(instances=[{"url": "http://127.0.0.1:8000"}], discovery={"kv_events": "tcp://*:5557"})
    assert any("kv_events is set without dns" in w for w in s.warnings())


def test_a_reload_names_the_settings_read_only_at_start() -> None:
    old = Settings()
    new = Settings(
        gateway={"shutdown_timeout": 5, "client_stall_timeout": 9, "port": 9000},
        limits={"store_timeout": 1.0},
    )
    assert old.restart_only_changes(new) == [
        "[gateway] port",
        "[gateway] shutdown_timeout",
        "[gateway] client_stall_timeout",
        "[limits] store_timeout",
    ]
    assert old.restart_only_changes(Settings(gateway={"request_timeout": 900})) == []


def test_a_gateway_base_url_given_as_an_openai_client_s_base_loses_its_v1() -> None:
    """http://gw:8080/v1 would serve every route under /v1/v1 too, and tell clients to use it."""
    assert Settings(gateway={"base_url": "http://gw:8080/v1"}).gateway.prefix == ""
    assert Settings(gateway={"base_url": "http://gw:8080/api/v1/"}).gateway.prefix == "/api"


def test_a_client_timeout_of_zero_is_refused() -> None:
    """A read timeout of 0 would time every client and bench request out."""
    with pytest.raises(ValueError, match="greater than 0"):
        ClientSettings.model_validate({"taotoken": {"timeout": {"read": 0}}})


def test_a_bad_value_from_the_environment_is_said_to_come_from_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TAOGATE_GATEWAY__PORT", "")
    with pytest.raises(ConfigError, match="environment TAOGATE_GATEWAY__PORT"):
        load_settings(write(tmp_path, ARTICLE_TOML))


def test_a_reference_to_an_empty_variable_is_as_unset() -> None:
    """settings.json's api_key = "${VAR}" with VAR set empty was an empty key: 401s, not an error."""
    assert expand_env("Bearer ${K}", {"K": "s3"}) == "Bearer s3"
    for environ in ({}, {"K": ""}):
        with pytest.raises(ConfigError, match=r"refers to \$\{K\}, which is not set"):
            expand_env("${K}", environ)


def test_kv_event_sockets_are_one_per_purpose_and_per_instance() -> None:
    one = {"url": "http://10.0.0.1:8000", "kv_events": "tcp://*:5557", "kv_events_replay": "tcp://*:5557"}
    with pytest.raises(ValueError, match="two sockets"):
        Settings.model_validate({"instances": [one]})
    gateway_binds = "tcp://10.0.0.9:5557"  # vLLM connects, the gateway binds: one engine per socket
    two = [{"url": f"http://10.0.0.{n}:8000", "kv_events": gateway_binds} for n in (1, 2)]
    with pytest.raises(ValueError, match="Give each its own port"):
        Settings.model_validate({"instances": two})
    each_binds = [{"url": f"http://10.0.0.{n}:8000", "kv_events": "tcp://*:5557"} for n in (1, 2)]
    Settings.model_validate({"instances": each_binds})  # each pod binds its own
