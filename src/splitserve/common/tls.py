"""TLS on splitserve's HTTP legs: a server's certificate files, checked before it starts,
and the client contexts that verify a worker (or the router) against a given CA.

Every check here fails with a ``ValueError`` of one line (``splitserve <cmd>: error: ...``
on the command line): a missing file, an unreadable one, a key that does not belong to its
certificate, a CA file with no certificate in it. Left to uvicorn or the ``ssl`` module they
would surface as a traceback from the middle of a server's start-up, or from its first
connection.
"""

from __future__ import annotations

import argparse
import ssl
from typing import NamedTuple


class ServerFiles(NamedTuple):
    """A server's certificate chain (PEM, its own certificate first) and private key."""

    certfile: str
    keyfile: str


def server_files(certfile: str | None, keyfile: str | None) -> ServerFiles | None:
    """The checked pair, or None for plain HTTP (neither given)."""
    if certfile is None and keyfile is None:
        return None
    if certfile is None or keyfile is None:
        raise ValueError("--ssl-certfile and --ssl-keyfile go together: give both or neither")
    _readable(certfile, "the certificate file")
    _readable(keyfile, "the key file")
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(certfile, keyfile)
    except ssl.SSLError as e:
        raise ValueError(
            f"cannot serve TLS with {certfile} and {keyfile}: {_reason(e)} (both PEM, and the "
            "key must be the certificate's)"
        ) from e
    return ServerFiles(certfile, keyfile)


def uvicorn_tls(files: ServerFiles | None) -> dict[str, str]:
    """``uvicorn.run``'s keyword arguments that serve HTTPS with ``files`` (none: plain)."""
    return {} if files is None else {"ssl_certfile": files.certfile, "ssl_keyfile": files.keyfile}


def client_context(cafile: str | None = None, cadata: bytes | None = None) -> ssl.SSLContext:
    """A client context that verifies the server's certificate and host name: against
    ``cafile`` (or the PEM ``cadata``) alone when given (a deployment's private CA), else the
    system's trust store."""
    if cadata is not None:
        return ssl.create_default_context(cadata=cadata.decode("ascii"))
    if cafile is None:
        return ssl.create_default_context()
    _readable(cafile, "the CA file")
    try:
        return ssl.create_default_context(cafile=cafile)
    except ssl.SSLError as e:
        raise ValueError(f"{cafile} holds no usable CA certificate (PEM): {_reason(e)}") from e


def add_server_tls_args(p: argparse.ArgumentParser) -> None:
    """``--ssl-certfile`` and ``--ssl-keyfile``: serve HTTPS."""
    p.add_argument(
        "--ssl-certfile",
        default=None,
        metavar="FILE",
        help="serve HTTPS with this certificate chain (PEM); needs --ssl-keyfile",
    )
    p.add_argument(
        "--ssl-keyfile", default=None, metavar="FILE", help="the certificate's private key (PEM)"
    )


def add_worker_ca_arg(p: argparse.ArgumentParser, who: str) -> None:
    """``--worker-ca``: the CA that https:// worker URLs are verified against."""
    p.add_argument(
        "--worker-ca",
        default=None,
        metavar="FILE",
        help=f"CA certificate (PEM) that {who} https:// worker URLs with, host names checked "
        "(default: the system's trust store)",
    )


def _readable(path: str, what: str) -> None:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror}") from e


def _reason(e: ssl.SSLError) -> str:
    """``KEY_VALUES_MISMATCH`` -> "key values mismatch"; OpenSSL's text when it names none."""
    return e.reason.replace("_", " ").lower() if e.reason else e.strerror or str(e)
