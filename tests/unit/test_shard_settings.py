"""``LEASE_SHARDS``: a count or names, checked before anything connects."""

from __future__ import annotations

import pytest

from sidecar import config
from sidecar.base.errors import ConfigError


def load(**env: str) -> config.Settings:
    return config.load({}, {"LEASE_STATE_DIR": "/tmp/x", **env})


def test_a_count_names_the_shards_after_the_first_lease() -> None:
    settings = load(LEASE_NAME="jobs,other", LEASE_SHARDS="3")
    assert settings.shards == ("jobs-0", "jobs-1", "jobs-2")
    assert settings.names == ("jobs", "other")
    assert settings.public()["shards"] == 3


def test_names_are_taken_as_given() -> None:
    assert load(LEASE_SHARDS="eu, us,apac").shards == ("eu", "us", "apac")


def test_no_shards_unless_asked() -> None:
    assert load().shards == ()


@pytest.mark.parametrize(("value", "message"), [
    ("0", "0 shards: give 1 to 4096"),
    ("5000", "5000 shards: give 1 to 4096"),
    ("a,a", "names a lease twice"),
    ("a b", "is not a valid lease name"),
    ("default,x", "'default' is a lease name (LEASE_NAME) and a shard"),
    ("x,shards", "'shards' cannot be a shard"),
    ("leader", "'leader' cannot be a shard"),
])
def test_bad_shard_sets_are_refused_naming_the_setting(value: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(LEASE_SHARDS=value)
    assert str(caught.value).startswith("LEASE_SHARDS / --shards: ")
    assert message in str(caught.value)


def test_a_backend_without_shard_groups_is_refused() -> None:
    with pytest.raises(ConfigError, match="LEASE_SHARDS / --shards: the sqlserver backend "
                                          "cannot hold shards"):
        config.load({}, {"LEASE_BACKEND": "sqlserver", "LEASE_SHARDS": "4",
                         "LEASE_DSN": "DRIVER=FreeTDS;SERVER=127.0.0.1;DATABASE=x"},
                    dsn_required=False)
