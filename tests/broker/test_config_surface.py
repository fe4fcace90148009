"""The operator's configuration surface, checked without starting anything: a flag or a
deploy-file key that cannot work is refused at the start, one line naming it (the
configuration hunt).  The processes' own e2e checks are in tests/e2e/test_worker_config.py."""
from __future__ import annotations

import pytest

from broker import __main__ as broker_main
from broker.server import BrokerConfig


def _endpoints(tmp_path, monkeypatch) -> list[str]:
    """Endpoints of its own for a broker that a regression would start (not the shared default)."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return ["--frontend", f"ipc://{tmp_path}/fe.ipc", "--backend", f"ipc://{tmp_path}/be.ipc"]


@pytest.mark.parametrize("value", ["0", "0.0000001"])
def test_a_zero_client_byte_cap_is_refused_on_the_command_line(value, capsys, tmp_path, monkeypatch):
    # 0 is not "no limit": every request with an inline tensor (a shared-memory client sends
    # its small ones inline) was refused, QUEUE_FULL, "wait for results before sending more".
    with pytest.raises(SystemExit) as e:
        broker_main.main([*_endpoints(tmp_path, monkeypatch), "--max-client-mb", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--max-client-mb must be more than 0" in err and "not 'no limit'" in err, err


@pytest.mark.parametrize("value", ["", " "])
@pytest.mark.parametrize("flag", ["--frontend", "--backend"])
def test_an_empty_endpoint_is_refused_not_taken_for_the_default(flag, value, capsys, tmp_path, monkeypatch):
    # `--frontend "$FE"` with FE unset bound the default endpoint (another broker's, maybe).
    args = _endpoints(tmp_path, monkeypatch)
    args[args.index(flag) + 1] = value
    with pytest.raises(SystemExit) as e:
        broker_main.main(args)
    assert e.value.code == 2
    assert f"{flag} is empty" in capsys.readouterr().err


@pytest.mark.parametrize("value", ['""', '" "'])
@pytest.mark.parametrize("key", ["frontend", "backend"])
def test_an_empty_endpoint_in_the_deploy_file_is_refused_not_taken_for_the_default(key, value, tmp_path):
    # A templated file (`frontend = "$FE"`, FE unset) bound the default endpoint, as the flag did.
    path = tmp_path / "deploy.toml"
    path.write_text(f"{key} = {value}\n")
    with pytest.raises(ValueError, match=rf"deploy.toml: {key} is empty"):
        BrokerConfig.from_toml(str(path))


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_lifo_after_must_be_a_number(value, capsys, tmp_path, monkeypatch):
    with pytest.raises(SystemExit) as e:
        broker_main.main([*_endpoints(tmp_path, monkeypatch), "--lifo-after-ms", value])
    assert e.value.code == 2
    assert "--lifo-after-ms must be a number" in capsys.readouterr().err


def test_a_zero_client_byte_cap_is_refused_in_the_deploy_file(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text("[scheduler]\nmax_client_bytes = 0\n")
    with pytest.raises(ValueError, match=r"deploy.toml: \[scheduler\] max_client_bytes must be from 1 .*not 'no limit'"):
        BrokerConfig.from_toml(str(path))


@pytest.mark.parametrize("flag, want", [("--keep-warm-ms", "a number >= 0"),
                                        ("--keep-warm-util", "a fraction between 0 and 1"),
                                        ("--out-capacity-mb", "a whole number of MiB >= 1"),
                                        ("--lifo-after-ms", "a number")])
def test_a_worker_flag_that_is_not_a_number_says_what_it_takes(flag, want, capsys):
    # argparse named the type function: "invalid _non_negative value: 'abc'"
    from gpu_worker.__main__ import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args([flag, "abc"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: expected {want}, not 'abc'" in err, err


@pytest.mark.parametrize("value, words", [("abc", "expected HOST:PORT or PORT"), ("99999", "port 99999 out of range")])
def test_a_bad_http_address_in_the_deploy_file_names_the_file(tmp_path, value, words):
    # It said "--http 'abc': ...", naming a flag nobody had passed, and not the file.
    path = tmp_path / "deploy.toml"
    path.write_text(f'http = "{value}"\n')
    with pytest.raises(ValueError) as e:
        BrokerConfig.from_toml(str(path))
    assert str(e.value) == f"{path}: http '{value}': {words}"


def test_a_key_file_that_is_not_there_is_said_so(tmp_path):
    # pyzmq's "Invalid certificate file" read as a corrupt key, where the file was missing (a
    # secret not mounted, a path misspelt); the broker's named only --curve-secret, also
    # when the path came from the deploy file's [security] curve_secret.
    from broker.protocol.curve import CurveKeyError
    from broker.security import SecurityError, load_server_secret
    from gpu_worker.upstream import link_keys

    gone = str(tmp_path / "gone.key_secret")
    with pytest.raises(SecurityError) as e:
        load_server_secret(gone)
    assert str(e.value) == (f"cannot read the server (--curve-secret, [security] curve_secret) certificate "
                            f"{gone!r}: there is no such file")
    with pytest.raises(CurveKeyError, match=f"worker key certificate {gone!r}: there is no such file"):
        link_keys("tcp://127.0.0.1:1", "0" * 40, gone)
