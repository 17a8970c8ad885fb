"""`pagedserve serve --config FILE` and secrets from the environment: what a
Kubernetes ConfigMap and Secret hand the server."""

from __future__ import annotations

import pytest

from service.cli import build_parser, expand_config, service_config_from_args


def config_for(argv, tmp_path=None, yaml_text=None, monkeypatch=None, **env):
    parser = build_parser()
    if yaml_text is not None:
        path = tmp_path / "config.yaml"
        path.write_text(yaml_text)
        argv = ["--config", str(path), *argv]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return service_config_from_args(parser.parse_args(expand_config(parser, argv)))


def test_config_file_sets_flags_and_the_command_line_wins(tmp_path):
    text = ("max-model-len: 1024\nmax_num_seqs: 8\nport: 9000\napi-key: [a, b]\n"
            "enable-prefix-caching: false\nlog-prompts: true\nredis-url: redis://r:6379/0\n"
            "warm-max-prefixes: 4\nserved-model-name: null\n")
    config = config_for(["--port", "9100"], tmp_path, text)
    assert config.engine.max_model_len == 1024 and config.engine.max_num_seqs == 8
    assert config.port == 9100  # the command line overrides the file
    assert config.api_keys == ("a", "b")
    assert config.engine.enable_prefix_caching is False and config.log_prompts is True
    assert config.fleet.redis_url == "redis://r:6379/0" and config.fleet.warm_max_prefixes == 4
    assert config.served_model_name is None


@pytest.mark.parametrize("text, message", [
    ("no-such-flag: 1\n", "'no-such-flag' is not a flag"),
    ("- a\n- b\n", "must hold a mapping"),
])
def test_config_file_mistakes_are_named(tmp_path, text, message):
    with pytest.raises(ValueError, match=message):
        config_for([], tmp_path, text)


def test_config_file_values_are_validated_like_flags(tmp_path):
    with pytest.raises(SystemExit):  # argparse: invalid int value
        config_for([], tmp_path, "max-model-len: many\n")


def test_secrets_from_the_environment(monkeypatch):
    config = config_for(["--api-key", "flag-key"], monkeypatch=monkeypatch,
                        PAGEDSERVE_API_KEYS="k1, k2,,", PAGEDSERVE_ADMIN_KEYS="admin",
                        PAGEDSERVE_REDIS_URL="rediss://:pw@redis:6380/0")
    assert config.api_keys == ("flag-key", "k1", "k2")
    assert config.admin_keys == ("admin",)
    assert config.fleet.redis_url == "rediss://:pw@redis:6380/0"
    flag = config_for(["--redis-url", "redis://other:6379/0"], monkeypatch=monkeypatch)
    assert flag.fleet.redis_url == "redis://other:6379/0"  # a flag wins over the variable


def test_main_reports_a_missing_config_file(tmp_path, capsys):
    from service.cli import main

    assert main(["--config", str(tmp_path / "absent.yaml")]) == 2
    assert "--config" in capsys.readouterr().err


def test_reasoning_parser_flag(tmp_path):
    from service.config import ServiceConfig

    assert config_for([]).reasoning_parser is None  # as vLLM: only when asked for
    assert config_for(["--reasoning-parser", "qwen3"]).reasoning_parser == "qwen3"
    assert config_for([], tmp_path, "reasoning-parser: deepseek_r1\n").reasoning_parser == \
        "deepseek_r1"
    with pytest.raises(SystemExit):  # argparse: invalid choice
        config_for(["--reasoning-parser", "granite"])
    with pytest.raises(ValueError, match="reasoning_parser='granite'"):
        ServiceConfig(reasoning_parser="granite")


def test_runner_pooling_flag():
    """--runner pooling: the engine's step budget (no stream waits on a step), and
    generation-only settings refused rather than ignored."""
    from engine.config import EngineConfig

    pooling = config_for(["--runner", "pooling", "--device", "cpu"])
    assert pooling.engine.runner == "pooling"
    assert pooling.engine.max_num_batched_tokens == EngineConfig().max_num_batched_tokens
    assert config_for(["--device", "cpu"]).engine.max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="--reasoning-parser shapes generation"):
        config_for(["--runner", "pooling", "--reasoning-parser", "qwen3"])


def test_priority_floor_and_open_event_sources_flags(tmp_path):
    """Defaults: a floor of 0 for keys that are not admin keys (it binds once keys
    are set), /kv_event_sources keyed; both set from flags or a config file, and a
    floor outside the 32-bit range the requests take is refused at start-up."""
    defaults = config_for([])
    assert (defaults.min_priority_non_admin, defaults.open_kv_event_sources) == (0, False)
    config = config_for([], tmp_path, "min-priority-non-admin: -10\nopen-kv-event-sources: true\n")
    assert (config.min_priority_non_admin, config.open_kv_event_sources) == (-10, True)
    assert config_for(["--min-priority-non-admin", "-2147483648"]).min_priority_non_admin == \
        -(2**31)
    with pytest.raises(ValueError, match="min_priority_non_admin"):
        config_for(["--min-priority-non-admin", str(2**31)])
