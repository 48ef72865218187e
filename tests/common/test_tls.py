"""Certificate files checked before a server starts: one clear line per bad file, from the
helpers and from every command that takes them (``router``, ``worker``, ``bench``)."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest
import trustme

from splitserve.cli import main
from splitserve.common.tls import ServerFiles, client_context, server_files, uvicorn_tls


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    issued = ca.issue_cert("127.0.0.1")
    out = {name: str(root / f"{name}.pem") for name in ("ca", "cert", "key", "other_key", "junk")}
    ca.cert_pem.write_to_path(out["ca"])
    issued.cert_chain_pems[0].write_to_path(out["cert"])
    issued.private_key_pem.write_to_path(out["key"])
    trustme.CA().issue_cert("x").private_key_pem.write_to_path(out["other_key"])
    Path(out["junk"]).write_text("not PEM\n")
    out["missing"] = str(root / "missing.pem")
    out["dir"] = str(root)
    return out


def test_a_good_pair_is_served_and_none_is_plain_http(files):
    pair = server_files(files["cert"], files["key"])
    assert pair == ServerFiles(files["cert"], files["key"])
    assert uvicorn_tls(pair) == {"ssl_certfile": files["cert"], "ssl_keyfile": files["key"]}
    assert server_files(None, None) is None and uvicorn_tls(None) == {}


@pytest.mark.parametrize(
    "cert, key, message",
    [
        ("cert", None, "--ssl-certfile and --ssl-keyfile go together"),
        (None, "key", "--ssl-certfile and --ssl-keyfile go together"),
        ("missing", "key", "cannot read the certificate file .*missing.pem: No such file"),
        ("cert", "dir", "cannot read the key file .*: Is a directory"),
        ("cert", "other_key", "cannot serve TLS with .*: key values mismatch"),
        ("junk", "key", "cannot serve TLS with"),
    ],
)
def test_bad_server_files_are_one_clear_error(files, cert, key, message):
    with pytest.raises(ValueError, match=message):
        server_files(files.get(cert), files.get(key))


def test_a_client_context_verifies_host_names_against_the_ca_alone(files):
    context = client_context(files["ca"])
    assert context.check_hostname and context.verify_mode == ssl.CERT_REQUIRED
    assert len(context.get_ca_certs()) == 1
    with pytest.raises(ValueError, match="holds no usable CA certificate"):
        client_context(files["junk"])
    with pytest.raises(ValueError, match="cannot read the CA file .*No such file"):
        client_context(files["missing"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["router", "--workers", "https://h:1", "--ssl-certfile", "{missing}", "--ssl-keyfile",
          "{key}"], "cannot read the certificate file"),
        (["router", "--workers", "https://h:1", "--ssl-certfile", "{cert}"], "go together"),
        (["router", "--workers", "https://h:1", "--worker-ca", "{junk}"], "no usable CA"),
        (["worker", "--ssl-certfile", "{cert}", "--ssl-keyfile", "{other_key}"],
         "key values mismatch"),
        (["worker", "--worker-ca", "{missing}"], "cannot read the CA file"),
        (["bench", "--url", "https://h:1", "--concurrency", "1", "--ca", "{dir}"],
         "cannot read the CA file"),
    ],
)  # fmt: skip
def test_commands_refuse_bad_files_in_one_line_before_starting(files, capsys, argv, message):
    code = main([a.format(**files) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith(f"splitserve {argv[0]}: error: "), err
    assert message in err[0]
