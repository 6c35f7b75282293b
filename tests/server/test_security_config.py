"""The security options of `ServerConfig` and `arborlm serve`: API keys (option, file,
environment), allowed hosts and the cache report; no server is started here."""

from __future__ import annotations

import subprocess
import sys

import pytest

from arborlm.cli import build_parser, server_args_from
from arborlm.envs import Envs
from arborlm.runtime.config import ServerArgs


def parse(*argv: str, environ: dict[str, str] | None = None) -> ServerArgs:
    return server_args_from(build_parser().parse_args(["serve", *argv]), Envs.from_environ(environ or {}))


@pytest.mark.parametrize("field", ["api_key", "admin_api_key"])
@pytest.mark.parametrize("key", ["ключ", "caf\u00e9", "", " padded", "tab\tinside", "line\nbreak"])
def test_a_key_a_header_cannot_carry_is_refused_naming_the_field(field, key):
    with pytest.raises(ValueError, match=f"^{field}=") as excinfo:
        ServerArgs.from_kwargs(**{field: key})
    assert key not in str(excinfo.value) or not key  # the message does not repeat the secret


def test_the_admin_key_must_differ_from_the_api_key():
    with pytest.raises(ValueError, match="admin_api_key"):
        ServerArgs.from_kwargs(api_key="same", admin_api_key="same")


def test_keys_are_kept_out_of_repr_and_public_dict():
    args = ServerArgs.from_kwargs(api_key="user-secret", admin_api_key="admin-secret")
    assert "secret" not in repr(args)
    public = args.public_dict()
    assert public["api_key"] == public["admin_api_key"] == "<redacted>"
    assert ServerArgs().public_dict()["api_key"] is None  # unset stays None (auth off is visible)


def test_api_key_from_the_environment():
    assert parse(environ={"ARBORLM_API_KEY": "from-env"}).server.api_key == "from-env"
    assert parse(environ={"ARBORLM_ADMIN_API_KEY": "adm"}).server.admin_api_key == "adm"
    assert parse(environ={"ARBORLM_API_KEY": ""}).server.api_key is None  # empty is unset
    assert parse("--api-key", "opt", environ={"ARBORLM_API_KEY": "from-env"}).server.api_key == "opt"


def test_api_key_file_drops_the_trailing_newline(tmp_path):
    path = tmp_path / "key"
    path.write_text("from-file\n")
    assert parse("--api-key-file", str(path), environ={"ARBORLM_API_KEY": "env"}).server.api_key == "from-file"
    path.write_text("from-file\r\n")
    assert parse("--admin-api-key-file", str(path)).server.admin_api_key == "from-file"


@pytest.mark.parametrize("content", ["", "\n", "two\nlines\n", " spaced\n"])
def test_api_key_file_with_no_usable_key_is_refused(tmp_path, content):
    path = tmp_path / "key"
    path.write_text(content)
    with pytest.raises(ValueError, match="^api_key="):
        parse("--api-key-file", str(path))


def test_api_key_file_errors(tmp_path):
    with pytest.raises(ValueError, match="api_key_file="):
        parse("--api-key-file", str(tmp_path / "missing"))
    path = tmp_path / "key"
    path.write_text("k")
    with pytest.raises(ValueError, match="not both"):
        parse("--api-key", "k", "--api-key-file", str(path))


def test_bad_key_exits_with_a_usage_error_naming_the_field():
    out = subprocess.run([sys.executable, "-m", "arborlm", "serve", "--api-key", "clé"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "api_key=" in out.stderr and "clé" not in out.stderr


@pytest.mark.parametrize("given, stored", [
    (["box.lan"], ("box.lan",)),
    (["Box.LAN", "*.example.com", "*"], ("box.lan", "*.example.com", "*")),
    (["::1", "[fd00::1]", "10.0.0.5"], ("[::1]", "[fd00::1]", "10.0.0.5")),
])
def test_allowed_hosts(given, stored):
    assert parse("--allowed-hosts", *given).server.allowed_hosts == stored
    assert ServerArgs.from_kwargs(allowed_hosts=given).server.allowed_hosts == stored  # a list, as Engine(**kw)


@pytest.mark.parametrize("bad", ["box.lan:8080", "", "a b", "http://box.lan", "*box"])
def test_bad_allowed_hosts_are_refused(bad):
    with pytest.raises(ValueError, match="^allowed_hosts="):
        ServerArgs.from_kwargs(allowed_hosts=(bad,))


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.1.2.3", True), ("::1", True), ("localhost", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("box.lan", False),
])
def test_binds_loopback(host, loopback):
    assert ServerArgs.from_kwargs(host=host).server.binds_loopback is loopback


def test_cache_report_is_off_by_default():
    assert ServerArgs().server.enable_cache_report is False
    assert parse("--enable-cache-report").server.enable_cache_report is True
