"""Settings: durations, bounds, derived defaults, the timing rules, DSN checks, JSON safety."""

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from sidecar import config
from sidecar.base.dsn import DsnError, check_odbc, check_postgres_url, check_sqlite, parse_odbc
from sidecar.base.redact import forget_secrets
from sidecar.config import ConfigError, format_duration, parse_duration
from sidecar.lease import backend_entry


@pytest.fixture(autouse=True)
def _clean_secrets():
    forget_secrets()
    yield
    forget_secrets()


def load(**env: str) -> config.Settings:
    return config.load({}, env=env)


def error(**env: str) -> str:
    with pytest.raises(ConfigError) as caught:
        config.load({}, env=env)
    message = str(caught.value)
    assert "\n" not in message
    return message


# -- durations ---------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("250ms", 0.25), ("15s", 15.0), ("2m", 120.0), ("1h", 3600.0), ("3", 3.0), ("1.5", 1.5),
    ("1.5s", 1.5), ("1m30s", 90.0), ("1h2m", 3720.0), ("2h45m30.5s", 9930.5), ("500ms", 0.5),
    ("1.5h", 5400.0), ("300us", 0.0003), ("300\u00b5s", 0.0003), ("300\u03bcs", 0.0003),
    ("1500ns", 1.5e-6), ("0", 0.0), (".5s", 0.5), ("5.s", 5.0), ("+2s", 2.0), (" 2s ", 2.0),
    ("1s500ms", 1.5),
])
def test_go_durations(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", [
    "", "15x", "s", "1.2.3s", "inf", "nan", "Infinity", "-inf", "1e3", "1e3s", "1 s", "1m 30s",
    "15S", "1d", ".s", "\u0663s", "0x10", "1,5s",
])
def test_not_durations(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


def test_negative_durations_are_refused():
    with pytest.raises(ValueError, match="negative"):
        parse_duration("-1s")


@pytest.mark.parametrize("text", ["9" * 400, "9" * 400 + "h", "1" + "0" * 30 + "ms",
                                  "999999999999s"])
def test_huge_durations_are_refused_not_infinite(text):
    with pytest.raises(ValueError, match="too large") as caught:
        parse_duration(text)
    assert len(str(caught.value)) < 120  # 400 nines are cut short in the message


@pytest.mark.parametrize(("seconds", "text"), [
    (0, "0s"), (0.25, "250ms"), (1.5, "1.5s"), (90, "1m30s"), (3720, "1h2m"), (3600, "1h"),
    (1e-6, "1\u00b5s"), (0.01, "10ms"), (2.2, "2.2s"), (0.4, "400ms"), (15, "15s"),
])
def test_durations_print_as_go_writes_them(seconds, text):
    assert format_duration(seconds) == text
    assert parse_duration(text) == pytest.approx(seconds)


# -- bounds: finite, non-negative, each setting within what can work -----------------------

@pytest.mark.parametrize(("env", "value", "expected"), [
    ("LEASE_DURATION", "0", "LEASE_DURATION / --lease-duration: 0s is less than the minimum 1s"),
    ("LEASE_DURATION", "500ms", "LEASE_DURATION / --lease-duration: 500ms is less than the "
                                "minimum 1s"),
    ("LEASE_DURATION", "2h", "LEASE_DURATION / --lease-duration: 2h is more than the maximum 1h"),
    ("LEASE_RENEW_INTERVAL", "1us", "LEASE_RENEW_INTERVAL / --renew-interval: 1\u00b5s is less "
                                    "than the minimum 10ms (a faster renew loop only burns CPU)"),
    ("LEASE_RENEW_INTERVAL", "0", "LEASE_RENEW_INTERVAL / --renew-interval: 0s is less than the "
                                  "minimum 10ms"),
    ("LEASE_RENEW_INTERVAL", "61m", "LEASE_RENEW_INTERVAL / --renew-interval: 1h1m is more than "
                                    "the maximum 1h"),
    ("LEASE_RENEW_DEADLINE", "5ms", "LEASE_RENEW_DEADLINE / --renew-deadline: 5ms is less than "
                                    "the minimum 10ms"),
    ("LEASE_CLAIM_HORIZON", "1ms", "LEASE_CLAIM_HORIZON / --claim-horizon: 1ms is less than the "
                                   "minimum 10ms"),
    ("LEASE_SAFETY_MARGIN", "3h", "LEASE_SAFETY_MARGIN / --safety-margin: 3h is more than the "
                                  "maximum 1h"),
    ("LEASE_REPLICA_TIMEOUT", "0s", "LEASE_REPLICA_TIMEOUT / --replica-timeout: 0s is less than "
                                    "the minimum 10ms"),
    ("LEASE_EXEC_GRACE", "2h", "LEASE_EXEC_GRACE / --grace: 2h is more than the maximum 1h"),
    ("LEASE_EXEC_GRACE", "-1s", "LEASE_EXEC_GRACE / --grace: '-1s' is not a duration: it is "
                                "negative"),
    ("LEASE_WORK_STALL_AFTER", "50ms", "LEASE_WORK_STALL_AFTER / --work-stall-after: 50ms is "
                                       "less than the minimum 100ms (a shorter period leaves "
                                       "no room for the application's heartbeats)"),
    ("LEASE_WORK_STALL_AFTER", "25h", "LEASE_WORK_STALL_AFTER / --work-stall-after: 25h is more "
                                      "than the maximum 24h"),
    ("LEASE_WORK_STALL_AFTER", "soon", "LEASE_WORK_STALL_AFTER / --work-stall-after: 'soon' is "
                                       "not a duration"),
    ("LEASE_DURATION", "9" * 400, "LEASE_DURATION / --lease-duration: '999999999999'\u2026 (400 "
                                  "characters) is too large"),
    ("LEASE_DURATION", "inf", "LEASE_DURATION / --lease-duration: 'inf' is not a duration"),
    ("LEASE_CLAIM_HORIZON", "nan", "LEASE_CLAIM_HORIZON / --claim-horizon: 'nan' is not a "
                                   "duration"),
])
def test_bounds(env, value, expected):
    assert error(**{env: value}).startswith(expected)


def test_zero_is_allowed_where_it_means_something():
    s = load(LEASE_SAFETY_MARGIN="0s", LEASE_EXEC_GRACE="0")
    assert s.timing.safety_margin == 0.0 and s.exec_grace == 0.0


def test_the_work_watchdog_is_off_unless_set():
    assert load().work_stall_after is None
    assert load().public()["work_stall_after"] is None
    s = load(LEASE_WORK_STALL_AFTER="1m30s")
    assert s.work_stall_after == 90.0 and s.public()["work_stall_after"] == 90.0
    assert config.load({"work_stall_after": "2s"}, env={}).work_stall_after == 2.0


def test_the_largest_accepted_values_are_plain_json():
    s = load(LEASE_DURATION="1h", LEASE_SAFETY_MARGIN="10m", LEASE_RENEW_INTERVAL="30m",
             LEASE_CLAIM_HORIZON="10m", LEASE_REPLICA_TIMEOUT="1h", LEASE_EXEC_GRACE="1h")
    text = json.dumps(s.public(), allow_nan=False)  # raises on Infinity / NaN
    assert all(math.isfinite(v) for v in s.public().values() if isinstance(v, float))
    assert json.loads(text)["lease_duration"] == 3600.0


# -- derived defaults ----------------------------------------------------------------------

def test_defaults_match_client_go():
    s = load()
    assert s.store.backend == "sqlite"
    assert s.names == ("default",)
    t = s.timing
    assert (t.lease_duration, t.renew_deadline, t.renew_interval) == (15.0, 10.0, 2.0)
    assert s.timing.safety_margin == 1.0
    assert s.timing.claim_horizon == 0.25
    assert s.http_addr == ("127.0.0.1", 8099)
    assert s.state_dir == "/run/lease"
    assert s.role == "all"
    assert s.store.dsn == backend_entry("sqlite").default_dsn
    assert ":" in s.identity  # host:pid without POD_NAME


@pytest.mark.parametrize(("duration", "deadline", "interval"), [
    ("3s", 2.0, 0.4), ("1m30s", 60.0, 12.0), ("1.5s", 1.0, 0.2), ("1h", 2400.0, 480.0),
])
def test_lease_duration_alone_derives_deadline_and_interval(duration, deadline, interval):
    for backend, dsn in (("sqlite", None), ("postgres", "postgresql://db/x"),
                         ("postgres-row", "postgresql://db/x")):
        env = {"LEASE_DURATION": duration, "LEASE_BACKEND": backend}
        if dsn:
            env["LEASE_DSN"] = dsn
        s = config.load({}, env=env)
        assert (s.timing.renew_deadline, s.timing.renew_interval) == (deadline, interval), backend
        assert "renew_deadline" not in s.explicit and "renew_interval" not in s.explicit


@pytest.mark.parametrize(("duration", "interval"), [
    ("15s", 4.667), ("3s", 0.667), ("1.5s", 0.167), ("1m30s", 29.667), ("1h", 1199.667),
])
def test_kubernetes_renews_every_third_of_the_validity(duration, interval):
    """Each renew is an apiserver request (the idle group's main one), so the kubernetes
    backend derives a third of the validity (lease less margin), not 2/15 of the lease:
    always two renew attempts before the claim ends, and about 12 PUTs a minute instead
    of 30 for the default 15 s lease."""
    s = config.load({}, env={"LEASE_DURATION": duration, "LEASE_BACKEND": "kubernetes"})
    assert s.timing.renew_interval == interval
    assert "renew_interval" not in s.explicit
    t = s.timing
    assert 2 * t.renew_interval * 1.1 < t.validity  # two attempts before the claim ends
    given = config.load({}, env={"LEASE_BACKEND": "kubernetes", "LEASE_RENEW_INTERVAL": "2s"})
    assert given.timing.renew_interval == 2.0


def test_a_broken_rule_names_the_kubernetes_share():
    message = error(LEASE_BACKEND="kubernetes", LEASE_DURATION="1.2s")
    assert message.startswith("LEASE_DURATION / --lease-duration:")
    assert ("LEASE_RENEW_INTERVAL 67ms (derived: 1/3 of LEASE_DURATION minus "
            "LEASE_SAFETY_MARGIN)") in message


def test_given_values_win_over_derived_ones():
    s = load(LEASE_DURATION="3s", LEASE_RENEW_INTERVAL="1s", LEASE_RENEW_DEADLINE="2500ms")
    assert (s.timing.renew_interval, s.timing.renew_deadline) == (1.0, 2.5)


def test_the_renew_deadline_is_checked_only_for_the_postgres_backend():
    # The advisory lock is the only backend that reads it.
    assert load(LEASE_RENEW_DEADLINE="1s").timing.renew_deadline == 1.0
    message = error(LEASE_BACKEND="postgres", LEASE_DSN="postgresql://db/x",
                    LEASE_RENEW_DEADLINE="1s")
    assert message.startswith("LEASE_RENEW_DEADLINE / --renew-deadline:")
    assert "LEASE_RENEW_INTERVAL 2s (derived: 2/15 of LEASE_DURATION)" in message


def test_help_names_the_derived_defaults():
    result = subprocess.run([sys.executable, "-m", "sidecar", "run", "--help"],
                            capture_output=True, text=True, timeout=30, check=True)
    text = " ".join(result.stdout.split())
    assert "LEASE_RENEW_DEADLINE; default 2/3 of the lease duration" in text
    assert "LEASE_RENEW_INTERVAL; default 2/15 of the lease duration" in text
    assert "kubernetes: 1/3 of the lease duration minus the safety margin" in text


# -- the timing rules: each names the values it compared and which were defaults ----------

PG = {"LEASE_BACKEND": "postgres", "LEASE_DSN": "postgresql://db/x"}
KUBE = {"LEASE_BACKEND": "kubernetes"}

RULES = [
    ({"LEASE_DURATION": "1.5s", "LEASE_RENEW_INTERVAL": "2s"},
     "LEASE_RENEW_INTERVAL / --renew-interval: 2s plus its 10% jitter (2.2s) must be less than "
     "LEASE_DURATION 1.5s minus LEASE_SAFETY_MARGIN 1s (default) = 500ms, or the lease lapses "
     "between renewals"),
    ({"LEASE_RENEW_INTERVAL": "20s"},
     "LEASE_RENEW_INTERVAL / --renew-interval: 20s plus its 10% jitter (22s) must be less than "
     "LEASE_DURATION 15s (default) minus LEASE_SAFETY_MARGIN 1s (default) = 14s, or the lease "
     "lapses between renewals"),
    ({"LEASE_SAFETY_MARGIN": "14s"},
     "LEASE_SAFETY_MARGIN / --safety-margin: LEASE_RENEW_INTERVAL 2s (derived: 2/15 of "
     "LEASE_DURATION) plus its 10% jitter (2.2s) must be less than LEASE_DURATION 15s (default) "
     "minus LEASE_SAFETY_MARGIN 14s = 1s, or the lease lapses between renewals"),
    ({"LEASE_SAFETY_MARGIN": "20s"},
     "LEASE_SAFETY_MARGIN / --safety-margin: 20s must be less than LEASE_DURATION 15s (default)"),
    ({"LEASE_DURATION": "1s"},
     "LEASE_DURATION / --lease-duration: LEASE_SAFETY_MARGIN 1s (default) must be less than "
     "LEASE_DURATION 1s"),
    ({"LEASE_DURATION": "3s", "LEASE_CLAIM_HORIZON": "2s"},
     "LEASE_CLAIM_HORIZON / --claim-horizon: 2s plus LEASE_RENEW_INTERVAL 400ms (derived: 2/15 "
     "of LEASE_DURATION) with its 10% jitter = 2.44s must be less than LEASE_DURATION 3s minus "
     "LEASE_SAFETY_MARGIN 1s (default) = 2s: a new holder's first claim comes one claim horizon "
     "after its acquire and its first renew one renew interval (up to +10%) after that, so "
     "every term would end before its first renew"),
    # Only the lease duration was given: it is the one named up front.
    ({"LEASE_DURATION": "1.2s"},
     "LEASE_DURATION / --lease-duration: LEASE_CLAIM_HORIZON 250ms (default) plus "
     "LEASE_RENEW_INTERVAL 160ms (derived: 2/15 of LEASE_DURATION) with its 10% jitter = 426ms "
     "must be less than LEASE_DURATION 1.2s minus LEASE_SAFETY_MARGIN 1s (default) = 200ms"),
    # The renew interval was given, the horizon was not: blame the one the user chose.
    ({"LEASE_DURATION": "3s", "LEASE_RENEW_INTERVAL": "1.7s"},
     "LEASE_RENEW_INTERVAL / --renew-interval: LEASE_CLAIM_HORIZON 250ms (default) plus "
     "LEASE_RENEW_INTERVAL 1.7s with its 10% jitter = 2.12s must be less than LEASE_DURATION 3s "
     "minus LEASE_SAFETY_MARGIN 1s (default) = 2s"),
    ({**PG, "LEASE_RENEW_DEADLINE": "20s"},
     "LEASE_RENEW_DEADLINE / --renew-deadline: 20s must be at most LEASE_DURATION 15s (default)"),
    ({**PG, "LEASE_RENEW_DEADLINE": "2s"},
     "LEASE_RENEW_DEADLINE / --renew-deadline: LEASE_RENEW_INTERVAL 2s (derived: 2/15 of "
     "LEASE_DURATION) plus its 10% jitter (2.2s) must be less than LEASE_RENEW_DEADLINE 2s"),
    ({**PG, "LEASE_RENEW_DEADLINE": "2.3s"},
     "LEASE_RENEW_DEADLINE / --renew-deadline: LEASE_CLAIM_HORIZON 250ms (default) plus "
     "LEASE_RENEW_INTERVAL 2s (derived: 2/15 of LEASE_DURATION) with its 10% jitter = 2.45s "
     "must be less than LEASE_RENEW_DEADLINE 2.3s"),
    ({**KUBE, "LEASE_SAFETY_MARGIN": "500ms"},
     "LEASE_SAFETY_MARGIN / --safety-margin: 500ms is less than 1s, the minimum for the "
     "kubernetes backend: client-go electors on the same Lease observe its changes at "
     "one-second granularity and may take over up to 1s before its nominal expiry"),
]


@pytest.mark.parametrize(("env", "expected"), RULES)
def test_each_rule_names_the_values_and_their_origin(env, expected):
    assert error(**env).startswith(expected)


@pytest.mark.parametrize(("horizon", "ok"), [("899ms", True), ("900ms", False), ("1s", False)])
def test_the_first_renew_must_fit_in_the_validity(horizon, ok):
    # Validity 3s - 1s = 2s; first renew at most horizon + 1s * 1.1 after the acquire.
    env = {"LEASE_DURATION": "3s", "LEASE_RENEW_INTERVAL": "1s", "LEASE_CLAIM_HORIZON": horizon}
    if ok:
        assert load(**env).timing.claim_horizon == parse_duration(horizon)
    else:
        assert error(**env).startswith("LEASE_CLAIM_HORIZON / --claim-horizon:")


def test_the_margin_rule_is_only_for_ttl_backends():
    # The advisory lock's validity is the renew deadline; the margin plays no part.
    s = load(**PG, LEASE_DURATION="3s", LEASE_SAFETY_MARGIN="3s")
    assert s.timing.safety_margin == 3.0
    assert load(**KUBE, LEASE_SAFETY_MARGIN="1s").timing.safety_margin == 1.0
    # sqlite: no client-go peer
    assert load(LEASE_SAFETY_MARGIN="500ms").timing.safety_margin == 0.5


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
    ({"LEASE_REPLICA_DSN": "postgresql://r/x"}, "LEASE_REPLICA_DSN / --replica-dsn"),
    ({"LEASE_BACKEND": "postgres-row", "LEASE_DSN": "postgresql://db/x",
      "LEASE_REPLICA_DSN": "postgresql://r:99999/x"}, "LEASE_REPLICA_DSN / --replica-dsn"),
    ({"LEASE_BACKEND": "postgres-row", "LEASE_DSN": "postgresql://db/x",
      "LEASE_NAME": "n" * 190}, "LEASE_NAME / --name"),
    ({"LEASE_BACKEND": "kubernetes", "LEASE_NAME": "Nightly_Sweep"}, "LEASE_NAME / --name"),
    ({"LEASE_ENSURE_SCHEMA": "maybe"}, "LEASE_ENSURE_SCHEMA / --ensure-schema"),
])
def test_each_setting_error_names_its_setting(env, named):
    assert error(**env).startswith(named)


def test_ensure_schema_only_where_there_is_a_table_to_create():
    row = {"LEASE_BACKEND": "postgres-row", "LEASE_DSN": "postgresql://db/x"}
    assert load(**row, LEASE_ENSURE_SCHEMA="true").store.ensure_schema is True
    assert load(**row, LEASE_ENSURE_SCHEMA="off").store.ensure_schema is False
    assert load(**row).store.ensure_schema is False
    # The advisory lock's one table is the token era's (sidecar.lease.pg_timeline).
    assert load(**PG, LEASE_ENSURE_SCHEMA="yes").store.ensure_schema is True
    assert error(LEASE_BACKEND="kubernetes", LEASE_ENSURE_SCHEMA="yes") == (
        "LEASE_ENSURE_SCHEMA / --ensure-schema: the kubernetes backend has no table to "
        "create")


def test_flags_win_over_environment():
    env = {"LEASE_DURATION": "30s", "LEASE_NAME": "a,b", "POD_NAME": "pod-1"}
    s = config.load({"lease_duration": "20s"}, env=env)
    assert s.timing.lease_duration == 20.0
    # derived from the winning value
    assert s.timing.renew_interval == pytest.approx(20 * 2 / 15, abs=0.001)
    assert s.names == ("a", "b")
    assert s.name == "a"
    assert s.identity == "pod-1"


def test_row_names_carry_the_prefix():
    s = config.load({}, env={"LEASE_KEY_PREFIX": "billing"})
    assert s.store.key("sweep") == "billing.sweep"


# -- DSNs -----------------------------------------------------------------------------------

GOOD_POSTGRES = [
    "postgresql://lease:s3cret@db.example.com:5432/leases",
    "postgres://db/x",
    "POSTGRESQL://db/x",
    "postgresql://lease:p%40ss%2Fw0rd@db/x",
    "postgresql://[::1]:5432/x",
    "postgresql://[fe80::1%25eth0]/x",
    "postgresql://127.0.0.1/x?sslmode=verify-full&sslrootcert=system",
    "postgresql:///x?host=/var/run/postgresql",
    "postgresql://%2Fvar%2Frun%2Fpostgresql/x",
    "postgresql://a:5432,b:5433/x?target_session_attrs=primary",
    "postgresql://db:/x",
    "postgresql://db/x?application_name=jobs&search_path=lease",
    "postgresql://db/x?sslmode=require&ssl_min_protocol_version=TLSv1.2&sslpassword=k",
    "postgresql:///x?host=db&port=5433&user=u&password=p&dbname=y",
    "postgresql://db_1.internal/x",
    "postgresql:///x?host=db:5433",
    "postgresql://d\u00e9j\u00e0.example/x",
]

BAD_POSTGRES = [
    ("host=db dbname=x password=s3cret", "must be a postgresql:// URL"),
    ("mysql://u:s3cret@db/x", "scheme 'mysql' is not postgresql:// or postgres://"),
    ("postgresql://u:s3cret@db:99999/x", "the port of host 'db' is not a number from 1 to 65535"),
    ("postgresql://u:s3cret@db:0/x", "the port of host 'db' is not a number from 1 to 65535"),
    ("postgresql://u:s3cret@db:54x2/x", "the port of host 'db' is not a number"),
    ("postgresql:///x?host=db&port=70000", "the port of the port parameter is not a number"),
    ("postgresql://db/x?port=5433", "asyncpg ignores the port parameter when the URL names a "
                                    "host"),
    ("postgresql://u:s3cret@[::1/x", "bad IPv6 host '[::1'"),
    ("postgresql://u:s3cret@::1:5432/x", "an IPv6 address must be in brackets"),
    ("postgresql://u:s3cret@[::zz]:5432/x", "'::zz' in brackets is not an IPv6 address"),
    ("postgresql://u:s3cret@[::1]x/x", "bad IPv6 host"),
    ("postgresql://u:s3cret@db/x?sslmode=requre", "sslmode 'requre' is not one of disable, "
                                                   "allow, prefer, require, verify-ca, "
                                                   "verify-full"),
    ("postgresql://db/x?sslmode=", "sslmode '' is not one of"),
    ("postgresql://db/x?sslmod=require", "unknown parameter 'sslmod' (did you mean sslmode?)"),
    ("postgresql://db/x?connect_timeout=5", "parameter 'connect_timeout' is a libpq option the "
                                            "asyncpg driver does not support"),
    ("postgresql://db/x?target_session_attrs=leader", "target_session_attrs 'leader' is not one"),
    ("postgresql://db/x?sslrootcert=/nonexistent/root.crt&sslmode=verify-full",
     "sslrootcert names '/nonexistent/root.crt', which is not a readable file"),
    ("postgresql://db/x?a=1&&b", "the query string is malformed"),
    ("postgresql://u:p@ss@db/x", "more than one '@' before the host: percent-encode '@'"),
    ("postgresql://u:pa/ss@db/x", "a '@' after the host part: percent-encode '/', '?', '#'"),
    ("postgresql://u:pa ss@db/x", "whitespace or a control character"),
    ("postgresql://bad_host!/x", "'bad_host!' is not a valid host name"),
    ("postgresql://-db/x", "'-db' is not a valid host name"),
    ("postgresql://999.1.1.1/x", "'999.1.1.1' is not a valid IPv4 address"),
    ("postgresql://a,,b/x", "an empty host in the host list"),
    ("postgresql://:5432/x", "a port without a host before it"),
    ("postgresql:///x?host=db:5x", "the port of host 'db' is not a number"),
]


@pytest.mark.parametrize("dsn", GOOD_POSTGRES)
def test_postgres_urls_accepted(dsn):
    check_postgres_url(dsn)
    s = load(LEASE_BACKEND="postgres-row", LEASE_DSN=dsn)
    assert s.store.dsn == dsn


@pytest.mark.parametrize(("dsn", "expected"), BAD_POSTGRES)
def test_postgres_urls_refused_without_showing_the_password(dsn, expected):
    for backend in ("postgres", "postgres-row"):
        message = error(LEASE_BACKEND=backend, LEASE_DSN=dsn)
        assert message.startswith(f"LEASE_DSN / --dsn: {expected}"), message
        for secret in ("s3cret", "p@ss", "pa/ss", "pa ss", "ss@db"):
            assert secret not in message
    replica = error(LEASE_BACKEND="postgres-row", LEASE_DSN="postgresql://db/x",
                    LEASE_REPLICA_DSN=dsn)
    assert replica.startswith(f"LEASE_REPLICA_DSN / --replica-dsn: {expected}")


GOOD_ODBC = [
    "DRIVER={ODBC Driver 18 for SQL Server};SERVER=db,1433;DATABASE=app;UID=sa;PWD=x;",
    "Server=db;Port=1433;UID=sa;Password={a;b}",
    "SERVER=tcp:db.example.com,1433;PWD={a}};b};TrustServerCertificate=yes",
    "DSN=prod;UID=u;PWD=x",
    " SERVER = db ; PWD = x ",
    "SERVER=db\\INSTANCE;Trusted_Connection=yes",
]

BAD_ODBC = [
    ("postgresql://u:s3cret@db/x", "a URL is not an ODBC connection string"),
    ("", None),  # "needs a DSN" (checked before the syntax)
    ("UID=sa;PWD=s3cret", "names no SERVER= (or DSN=)"),
    ("SERVER=db;PWD={s3cret", "the value of PWD opens '{' but never closes it"),
    ("SERVER=db;PWD={s3c}ret};UID=u", "text after the closing '}' of PWD"),
    ("SERVER=db;PWD=s3c;ret;UID=u", "attribute 3 has no '='"),
    ("SERVER=db;SERVER=other", "SERVER is given twice"),
    ("SERVER=db;PORT=99999;PWD=s3cret", "the port of PORT= is not a number from 1 to 65535"),
    ("SERVER=db,14x3;PWD=s3cret", "the port of SERVER= is not a number"),
    ("=x;SERVER=db", "attribute 1 has no name before '='"),
]


@pytest.mark.parametrize("dsn", GOOD_ODBC)
def test_odbc_strings_accepted(dsn):
    check_odbc(dsn)
    assert load(LEASE_BACKEND="sqlserver", LEASE_DSN=dsn).store.dsn == dsn


@pytest.mark.parametrize(("dsn", "expected"), BAD_ODBC)
def test_odbc_strings_refused_without_showing_the_password(dsn, expected):
    message = error(LEASE_BACKEND="sqlserver", LEASE_DSN=dsn)
    if expected is None:
        assert message == "LEASE_DSN / --dsn: the sqlserver backend needs a DSN"
        return
    assert message.startswith(f"LEASE_DSN / --dsn: {expected}"), message
    assert "s3c" not in message and "ret" not in message.split(":", 1)[1].replace("SERVER", "")


def test_odbc_parser_reads_braces_and_escapes():
    parsed = parse_odbc("Driver={ODBC Driver 18};Server = db ;PWD={a}};b};Encrypt=yes")
    assert parsed == {"DRIVER": "ODBC Driver 18", "SERVER": "db", "PWD": "a};b",
                      "ENCRYPT": "yes"}


def test_sqlite_paths_accepted(tmp_path: Path):
    existing = tmp_path / "leases.db"
    existing.write_bytes(b"")
    for dsn in (str(existing), str(tmp_path / "new" / "deeper" / "l.db"),
                f"sqlite:///{tmp_path}/l.db", "sqlite:///relative/l.db", "relative.db"):
        check_sqlite(dsn)
        assert load(LEASE_DSN=dsn).store.dsn == dsn


def test_sqlite_dsns_refused(tmp_path: Path):
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    fifo = tmp_path / "fifo"
    import os

    os.mkfifo(fifo)
    cases = [
        (":memory:", "':memory:' is an in-memory database: every sidecar would lead alone"),
        ("sqlite:///:memory:", "'sqlite:///:memory:' is an in-memory database"),
        ("file::memory:", "'file::memory:' is an in-memory database"),
        ("file::memory:?cache=shared", "is an in-memory database"),
        (f"file:{tmp_path}/x.db?mode=memory", "is an in-memory database"),
        (f"file:{tmp_path}/x.db", "file: URIs are not supported"),
        (str(tmp_path), f"'{tmp_path}' is a directory: give the database file inside it"),
        (f"sqlite:///{tmp_path}", "is a directory"),
        (f"{tmp_path}/", "ends with '/'"),
        (str(a_file / "x.db"), f"'{a_file}' (on the way to '{a_file}/x.db') is not a directory"),
        (str(a_file / "a" / "b" / "x.db"), f"'{a_file}' (on the way to"),
        (str(fifo), "exists and is not a regular file"),
        ("sqlite://relative/x.db", "a 'sqlite' URL is not a SQLite file path (sqlite:// needs a "
                                   "third slash"),
        ("postgresql://u:s3cret@db/x", "a 'postgresql' URL is not a SQLite file path; set "
                                       "LEASE_BACKEND"),
        ("sqlite:///x.db?timeout=5", "query parameters are not supported"),
        ("sqlite:///", "names no file"),
    ]
    for dsn, expected in cases:
        with pytest.raises(DsnError):
            check_sqlite(dsn)
        message = error(LEASE_DSN=dsn)
        assert message.startswith("LEASE_DSN / --dsn: ") and expected in message, (dsn, message)
        assert "s3cret" not in message


def test_validating_sqlite_settings_imports_no_driver():
    probe = ("import sys, json; from sidecar import config; "
             "config.load({'dsn': '/tmp/x/l.db'}, env={}); "
             "print(json.dumps(sorted(m.split('.')[0] for m in sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, check=True)
    loaded = set(json.loads(result.stdout))
    assert "sidecar" in loaded
    assert not loaded & {"asyncpg", "pyodbc", "kopf", "kubernetes"}


@pytest.mark.parametrize(("backend", "blocked", "extra"), [
    ("postgres", "asyncpg", "postgres"), ("postgres-row", "asyncpg", "postgres"),
    ("sqlserver", "pyodbc", "sqlserver"),
])  # kubernetes needs no extra: it talks to the apiserver through sidecar.kubeapi
def test_a_missing_extra_is_a_setting_error(backend, blocked, extra):
    """A real interpreter where importing the driver fails, as without the extra."""
    dsn = {"sqlserver": "SERVER=db", "kubernetes": ""}.get(backend, "postgresql://db/x")
    probe = (f"import sys; sys.modules[{blocked!r}] = None\n"
             "from sidecar import config\n"
             "try:\n"
             f"    config.load({{'backend': {backend!r}, 'dsn': {dsn!r} or None}}, env={{}})\n"
             "except config.ConfigError as exc:\n"
             "    print(exc)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, check=True)
    line = result.stdout.strip()
    assert line.startswith(f"LEASE_BACKEND / --backend: the {backend} backend cannot load")
    assert line.endswith(f"install lease-sidecar[{extra}]")


# -- what is shown ------------------------------------------------------------------------

def test_public_settings_hide_passwords_and_are_plain_json():
    s = load(LEASE_BACKEND="postgres-row",
             LEASE_DSN="postgresql://u:hunter2@h/db?sslpassword=k3y-secret",
             LEASE_REPLICA_DSN="postgresql://u:p%40ss-word@r/db")
    shown = json.dumps(s.public(), allow_nan=False)
    for secret in ("hunter2", "k3y-secret", "p%40ss-word", "p@ss-word"):
        assert secret not in shown
    assert "postgresql://u:***@h/db" in shown


def test_start_errors_name_the_state_dir_or_the_address(tmp_path: Path):
    import errno

    from sidecar.runtime import Sidecar, start_error

    settings = config.load({"state_dir": str(tmp_path / "state"), "dsn": str(tmp_path / "l.db")},
                           env={})
    sidecar = Sidecar(settings)
    leader = OSError(errno.EISDIR, "Is a directory", str(tmp_path / "state" / "leader"))
    assert str(start_error(sidecar, leader)) == (
        f"LEASE_STATE_DIR / --state-dir: {tmp_path}/state/leader: Is a directory")
    token = OSError(errno.EACCES, "Permission denied", "/var/run/secrets/token")
    assert str(start_error(sidecar, token)) == (
        "cannot start: /var/run/secrets/token: Permission denied")
    busy = OSError(errno.EADDRINUSE, "Address already in use")
    assert str(start_error(sidecar, busy)) == (
        "LEASE_HTTP_ADDR / --http-addr: cannot listen on 127.0.0.1:8099: Address already in use")


def test_the_loaded_defaults_are_the_dataclass_defaults():
    """Defaults are written in two places (the option table's text, the dataclasses that
    library users and tests build); this keeps them the same."""
    from sidecar.settings import Settings, StoreSettings, Timing

    loaded = config.load({}, env={})
    assert loaded.timing == Timing()
    assert replace(loaded.store, dsn=None) == StoreSettings()
    defaults = Settings()
    for name in ("names", "role", "http_addr", "state_dir", "pod_label", "exec_grace",
                 "work_stall_after", "log_level"):
        assert getattr(loaded, name) == getattr(defaults, name), name


# -- lead only when the application can work ----------------------------------------------

def test_app_readiness_is_off_unless_a_url_is_given():
    s = load()
    assert s.app_ready_url is None and s.app_unready_after == 10.0
    s = load(LEASE_APP_READY_URL="http://127.0.0.1:8080/ready", LEASE_APP_UNREADY_AFTER="3s")
    assert s.app_ready_url == "http://127.0.0.1:8080/ready" and s.app_unready_after == 3.0


@pytest.mark.parametrize(("env", "named"), [
    ({"LEASE_APP_READY_URL": "127.0.0.1:8080/ready"}, "LEASE_APP_READY_URL / --app-ready-url"),
    ({"LEASE_APP_READY_URL": "https://app/ready"}, "LEASE_APP_READY_URL / --app-ready-url"),
    ({"LEASE_APP_READY_URL": "http://app:99999/ready"}, "LEASE_APP_READY_URL / --app-ready-url"),
    ({"LEASE_APP_UNREADY_AFTER": "soon"}, "LEASE_APP_UNREADY_AFTER / --app-unready-after"),
    ({"LEASE_APP_UNREADY_AFTER": "10ms"}, "LEASE_APP_UNREADY_AFTER / --app-unready-after"),
])
def test_a_bad_readiness_setting_fails_naming_it(env: dict[str, str], named: str):
    assert error(**env).startswith(named)


@pytest.mark.parametrize(("env", "problem"), [
    ({}, "needs POD_NAME and POD_NAMESPACE"),
    ({"POD_NAME": "web-0", "POD_NAMESPACE": "apps", "LEASE_POD_LABEL": "off"},
     "needs the pod label"),
    ({"POD_NAME": "web-0", "POD_NAMESPACE": "apps", "LEASE_IDENTITY": "other"},
     "needs the identity to be the pod name"),
])
def test_shutdown_handover_needs_the_pod_and_its_group(env: dict[str, str], problem: str):
    message = error(LEASE_SHUTDOWN_HANDOVER="youngest-ready", **env)
    assert message.startswith("LEASE_SHUTDOWN_HANDOVER / --shutdown-handover: ")
    assert problem in message


def test_shutdown_handover_in_a_pod():
    s = load(LEASE_SHUTDOWN_HANDOVER="youngest-ready", POD_NAME="web-0", POD_NAMESPACE="apps")
    assert s.shutdown_handover == "youngest-ready" and load().shutdown_handover == "off"
