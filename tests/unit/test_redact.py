"""One redaction function, over every form a password takes in libpq, ODBC and URLs."""

import io
import json
import logging

import pytest

from sidecar import config
from sidecar.base import jsonlog
from sidecar.base.redact import forget_secrets, redact, redact_tree, remember_secrets, secrets_in


@pytest.fixture(autouse=True)
def _clean_secrets():
    forget_secrets()
    yield
    forget_secrets()


# (text, the secret that must vanish, text that must stay visible)
CASES = [
    # URL userinfo
    ("postgresql://lease:s3cret@db:5432/x", "s3cret", "postgresql://lease:***@db:5432/x"),
    ("postgres://lease:s3cret@db/x", "s3cret", "@db/x"),
    ("postgresql://:s3cret@db/x", "s3cret", "@db/x"),
    # a raw '@' inside the password: nothing of it may show (its tail showed before)
    ("postgresql://lease:p@ss@w0rd@db/x", "ss@w0rd", "postgresql://lease:***@db/x"),
    ("postgresql://lease:p@ss@w0rd@db/x", "p@ss", "@db/x"),
    # raw '/', '?' and '#' inside the password
    ("postgresql://lease:pa/ss@db/x", "pa/ss", "@db/x"),
    ("postgresql://lease:pa?ss@db/x", "pa?ss", "@db/x"),
    ("postgresql://lease:pa#ss@db/x", "pa#ss", "@db/x"),
    ("postgresql://lease:p%40ss@db/x", "p%40ss", "@db/x"),
    # URL query
    ("postgresql://db/x?user=a&password=s3cret", "s3cret", "user=a&password=***"),
    ("postgresql://db/x?password=s3cret&sslmode=require", "s3cret", "&sslmode=require"),
    ("postgresql://db/x?sslmode=require&sslpassword=k3y-pass", "k3y-pass", "sslmode=require"),
    ("postgresql://db/x?sslpassword=k3y&password=ab;cd", "ab;cd", "sslpassword=***"),
    ("postgresql://db/x?PASSWORD=s3cret", "s3cret", "postgresql://db/x?"),
    # libpq key-value
    ("host=db password=s3cret user=u", "s3cret", "host=db"),
    ("host=db password=x9 sslpassword='y z' user=u", "y z", "user=u"),
    ("host=db password=x9 sslpassword='y z' user=u", "x9", "user=u"),
    ("host=db password = s3cret user=u", "s3cret", "user=u"),
    ("host=db password='it\\'s secret' user=u", "secret", "user=u"),
    ("host=db password='unterminated secret", "secret", "host=db"),
    ("host=db sslpassword=k3y", "k3y", "host=db"),
    # ODBC
    ("Driver={ODBC Driver 18};Server=db;UID=sa;PWD=s3cret;", "s3cret", "Server=db;UID=sa;"),
    ("Server=db;PWD =s3cret;UID=sa", "s3cret", "UID=sa"),
    ("Server=db;pwd= s3cret ;UID=sa", "s3cret", "UID=sa"),
    ("Server=db;Password = s3cret;UID=sa", "s3cret", "UID=sa"),
    ("Server=db;PASSWORD=two words;UID=sa", "two words", "UID=sa"),
    ("Server=db;Password={s3c;ret};UID=sa", "ret", "UID=sa"),
    ("Server=db;PWD={a}};b};UID=sa", "b}", "UID=sa"),
    ("Server=db;PWD={a}};b};UID=sa", "a}", "UID=sa"),
    ("Server=db;PWD={unterminated;UID=sa", "unterminated", "Server=db"),
    ("Server=db;KeyStoreSecret=s3cret;UID=sa", "s3cret", "UID=sa"),
    ("Server=db;Authentication=ActiveDirectoryServicePrincipal;ClientSecret=s3cret",
     "s3cret", "Authentication=ActiveDirectoryServicePrincipal"),
    ("Server=db;PWD=***xyz;UID=sa", "xyz", "UID=sa"),
    # inside a driver's error message
    ("sqlserver db: connection failed (DRIVER={FreeTDS};SERVER=db;PWD=s3cret)", "s3cret",
     "connection failed"),
    ("could not connect: postgresql://lease:s3cret@db/x: connection refused", "s3cret",
     ": connection refused"),
]


@pytest.mark.parametrize(("text", "secret", "kept"), CASES)
def test_every_password_form_is_hidden(text, secret, kept):
    shown = redact(text)
    assert secret not in shown
    assert "***" in shown
    assert kept in shown


@pytest.mark.parametrize("text", [
    "postgresql://lease@db:5432/x",
    "postgresql://db/x?sslmode=require&passfile=/etc/pgpass",
    "Server=db;UID=sa;Database=app",
    "acquired lease default (fencing token 42)",
    "connect failed: postgresql://u@h:5432/db role a@b",
    "",
])
def test_text_without_secrets_is_left_alone(text):
    assert redact(text) == text


def test_the_error_after_a_masked_query_password_stays_readable():
    text = ("postgres postgresql://u:pw@h:1/x?sslpassword=K3y-pw acquire: cannot connect: "
            "[Errno 111] Connect call failed")
    assert redact(text) == ("postgres postgresql://u:***@h:1/x?sslpassword=*** acquire: cannot "
                            "connect: [Errno 111] Connect call failed")


def test_none_passes_through():
    assert redact(None) is None


def test_secrets_in_takes_quotes_and_braces_off():
    assert secrets_in("Server=db;PWD={a}};b};UID=u") == ["a};b"]
    assert secrets_in("password='y z'") == ["y z"]
    assert "p@ss w" in secrets_in("postgresql://u:p@ss w@db/x")


def test_remembered_passwords_are_hidden_wherever_they_appear():
    # A driver may echo the bare password, or a DSN too broken to parse (a raw space).
    remember_secrets(["postgresql://u:pa%20ss-word@db/x", "Server=db;PWD={bare-one}",
                      "postgresql://u:has space@db/x", None])
    assert redact("auth failed for 'pa ss-word'") == "auth failed for '***'"
    assert redact("auth failed for 'pa%20ss-word'") == "auth failed for '***'"
    assert redact("bare-one rejected") == "*** rejected"
    assert "space" not in redact("postgresql://u:has space@db/x")


def test_short_passwords_are_not_remembered_as_words():
    remember_secrets(["postgresql://u:abc@db/x"])
    assert redact("abc is a word") == "abc is a word"
    assert redact("postgresql://u:abc@db/x") == "postgresql://u:***@db/x"


def test_redact_tree_walks_nested_data():
    data = {"reason": "postgresql://u:s3cret@db/x", "n": 1,
            "transitions": [{"reason": "PWD=s3cret;"}], "t": ("password=s3cret",)}
    assert "s3cret" not in json.dumps(redact_tree(data))
    assert redact_tree(data)["n"] == 1


def test_log_lines_are_redacted_in_message_extras_and_exceptions():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(jsonlog.JsonFormatter())
    logger = logging.getLogger("test.redact")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        logger.warning("cannot reach postgresql://u:s3cret@db/x", extra={
            "error": "PWD={a}};s3cret}", "settings": {"dsn": "password=s3cret host=db"}})
        try:
            raise RuntimeError("sslpassword=s3cret")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(handler)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    assert "s3cret" not in stream.getvalue()
    assert lines[0]["msg"] == "cannot reach postgresql://u:***@db/x"
    assert "sslpassword=***" in lines[1]["exception"]


def test_library_loggers_log_an_error_in_one_line_without_traceback():
    """asyncpg's pool logs every failed background reconnect with a traceback; a library's
    logged failure becomes one line, our own loggers keep theirs (a bug's traceback)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(jsonlog.JsonFormatter())
    loggers = [logging.getLogger("asyncpg.pool"), logging.getLogger("sidecar.test")]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        for logger in loggers:
            try:
                raise ConnectionRefusedError(111, "Connect call failed\nsecond line")
            except ConnectionRefusedError:
                logger.warning("Failed to restore the pool connection floor; retrying",
                               exc_info=True)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
            logger.propagate = True
    library, ours = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert library["exception"] == "ConnectionRefusedError: [Errno 111] Connect call failed"
    assert "Traceback" in ours["exception"]


def test_cli_error_line_is_redacted(capsys):
    from sidecar import cli

    assert cli._fail("backend postgresql://u:s3cret@db/x: boom") == 2
    assert "s3cret" not in capsys.readouterr().err


def test_status_hides_backend_errors_that_echo_a_dsn(tmp_path):
    from sidecar.runtime import Sidecar

    dsn = "postgresql://lease:s3cret-pw@127.0.0.1:1/x?sslpassword=k3y-pw"
    settings = config.load({"backend": "postgres-row", "dsn": dsn,
                            "state_dir": str(tmp_path)}, env={})
    sidecar = Sidecar(settings)
    sidecar.states[0].update("unreachable", reason=f"backend unreachable: postgres-row {dsn}: "
                                                   "password s3cret-pw rejected")
    shown = json.dumps(sidecar.status(), allow_nan=False)
    assert "s3cret-pw" not in shown and "k3y-pw" not in shown
    assert "backend unreachable: postgres-row postgresql://lease:***@127.0.0.1:1/x" in shown
