"""Settings come from `PAGEWISE_*` variables and fail with messages that name the variable."""

from __future__ import annotations

import pytest

from pagewise.platform.paths import default_database_url
from pagewise.platform.settings import Settings, SettingsError


def test_defaults_are_embedded_mode() -> None:
    settings = Settings.from_env({})
    assert settings.database_url == default_database_url() and settings.is_embedded
    # the server shares the engine fairly and serves tenants' adapters unless told otherwise
    assert settings.engine.engine_kwargs() == {
        "model": "smollm2-135m-instruct", "scheduling_policy": "fair", "enable_lora": True
    }


def test_environment_and_overrides() -> None:
    env = {
        "PAGEWISE_REDIS_URL": "redis://localhost:6379/0",
        "PAGEWISE_MAX_MODEL_LEN": "1_024",
        "PAGEWISE_ENABLE_PREFIX_CACHING": "false",
        "PAGEWISE_MODEL": "tiny",
    }
    settings = Settings.from_env(env, engine={"max_model_len": 512, "seed": None})
    assert not settings.is_embedded
    assert settings.engine.engine_kwargs() == {
        "model": "tiny",
        "max_model_len": 512,
        "enable_prefix_caching": False,
        "scheduling_policy": "fair",
        "enable_lora": True,
    }


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PAGEWISE_DATABASE_URL": "mysql://db"}, "PAGEWISE_DATABASE_URL uses driver 'mysql'"),
        ({"PAGEWISE_REDIS_URL": "localhost:6379"}, "PAGEWISE_REDIS_URL must start with redis://"),
        ({"PAGEWISE_MAX_MODEL_LEN": "lots"}, "PAGEWISE_MAX_MODEL_LEN must be an integer; got 'lots'"),
        ({"PAGEWISE_MAX_NUM_SEQS": "0"}, "PAGEWISE_MAX_NUM_SEQS must be positive; got 0"),
        ({"PAGEWISE_AUTO_MIGRATE": "maybe"}, "PAGEWISE_AUTO_MIGRATE must be true or false; got 'maybe'"),
    ],
)
def test_invalid_values_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError, match=message.replace("(", r"\(")):
        Settings.from_env(env)
