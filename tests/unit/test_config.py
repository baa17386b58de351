import pytest

from sidecar import config
from sidecar.config import ConfigError, parse_duration, redact_dsn


@pytest.mark.parametrize(("text", "seconds"), [
    ("250ms", 0.25), ("15s", 15.0), ("2m", 120.0), ("3", 3.0), ("1.5", 1.5), ("1h", 3600.0),
])
def test_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "15x", "-1s", "s", "1.2.3s"])
def test_bad_durations(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_defaults_match_design():
    s = config.load({}, env={})
    assert s.backend == "sqlite"
    assert s.names == ("default",)
    assert s.lease_duration == 15.0
    assert s.renew_interval == 2.0
    assert s.claim_horizon == 0.25
    assert s.http_addr == ("127.0.0.1", 8099)
    assert s.state_dir == "/run/lease"
    assert s.role == "all"
    assert s.dsn == config.DEFAULT_SQLITE_PATH
    assert ":" in s.identity  # host:pid without POD_NAME


def test_flags_win_over_environment():
    env = {"LEASE_DURATION": "30s", "LEASE_NAME": "a,b", "POD_NAME": "pod-1"}
    s = config.load({"lease_duration": "20s"}, env=env)
    assert s.lease_duration == 20.0
    assert s.names == ("a", "b")
    assert s.name == "a"
    assert s.identity == "pod-1"


@pytest.mark.parametrize(("env", "named"), [
    ({"LEASE_BACKEND": "mysql"}, "LEASE_BACKEND / --backend"),
    ({"LEASE_DURATION": "fast"}, "LEASE_DURATION / --lease-duration"),
    ({"LEASE_HTTP_ADDR": "nohost"}, "LEASE_HTTP_ADDR / --http-addr"),
    ({"LEASE_ROLE": "boss"}, "LEASE_ROLE / --role"),
    ({"LEASE_NAME": "a,a"}, "LEASE_NAME / --name"),
    ({"LEASE_NAME": "bad name"}, "LEASE_NAME / --name"),
    ({"LEASE_TABLE": "x; drop table y"}, "LEASE_TABLE / --table"),
    ({"LEASE_BACKEND": "postgres"}, "LEASE_DSN / --dsn"),
    ({"LEASE_BACKEND": "postgres", "LEASE_DSN": "host=x"}, "LEASE_DSN / --dsn"),
    ({"LEASE_RENEW_INTERVAL": "20s"}, "LEASE_RENEW_INTERVAL / --renew-interval"),
    ({"LEASE_RENEW_DEADLINE": "1s"}, "LEASE_RENEW_DEADLINE / --renew-deadline"),
    ({"LEASE_CLAIM_HORIZON": "1ms"}, "LEASE_CLAIM_HORIZON / --claim-horizon"),
    ({"LEASE_SAFETY_MARGIN": "20s"}, "LEASE_SAFETY_MARGIN / --safety-margin"),
    ({"LEASE_REPLICA_DSN": "postgresql://r/x"}, "LEASE_REPLICA_DSN / --replica-dsn"),
    ({"LEASE_BACKEND": "kubernetes", "LEASE_NAME": "Nightly_Sweep"}, "LEASE_NAME / --name"),
])
def test_each_rule_names_its_setting(env, named):
    with pytest.raises(ConfigError) as err:
        config.load({}, env=env)
    message = str(err.value)
    assert message.startswith(named)
    assert "\n" not in message


@pytest.mark.parametrize(("dsn", "secret"), [
    ("postgresql://lease:s3cret@db:5432/x", "s3cret"),
    ("Driver={ODBC Driver 18};Server=db;UID=sa;PWD=s3cret;", "s3cret"),
    ("Server=db;Password={s3c;ret};UID=sa", "s3c;ret"),
    ("postgresql://db/x?user=a&password=s3cret", "s3cret"),
])
def test_passwords_are_redacted(dsn, secret):
    shown = redact_dsn(dsn)
    assert secret not in shown
    assert "***" in shown


def test_public_settings_hide_the_password():
    s = config.load({}, env={"LEASE_BACKEND": "postgres",
                             "LEASE_DSN": "postgresql://u:hunter2@h/db"})
    assert "hunter2" not in repr(s.public())


def test_row_names_carry_the_prefix():
    s = config.load({}, env={"LEASE_KEY_PREFIX": "billing"})
    assert s.row_name("sweep") == "billing.sweep"
