"""``splitserve serve --tls``: a private CA per run, HTTPS on every leg, files gone at exit."""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import threading

import httpx
import openai
import psutil
import pytest
from procs import die_with_parent, free_port, stop_group

from splitserve.cluster.tls import private_tls
from splitserve.common.tls import client_context, server_files


def test_private_tls_files_are_private_and_verify_for_each_name():
    files = private_tls(["localhost"])
    try:
        assert stat.S_IMODE(os.stat(files.dir).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(files.key).st_mode) == 0o600
        server_files(files.cert, files.key)  # a pair that belongs together
        for name in ("127.0.0.1", "localhost"):
            assert _handshake(files.cert, files.key, files.ca, name) == "TLSv1.3"
    finally:
        files.remove()
    assert not os.path.exists(files.dir)


def _handshake(cert: str, key: str, ca: str, name: str) -> str:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = client_context(ca)
    client.verify_flags |= ssl.VERIFY_X509_STRICT  # Python 3.13's default: RFC 5280 shape
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def serve() -> None:
            conn, _ = listener.accept()
            with server.wrap_socket(conn, server_side=True):
                pass

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with client.wrap_socket(
            socket.create_connection(listener.getsockname()), server_hostname=name
        ) as s:
            version = s.version()
        thread.join(10)
    return version


def _read_lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line)


def test_serve_tls_router_and_worker_over_https_then_removes_its_files():
    port = free_port()
    argv = [sys.executable, "-m", "splitserve.cli", "serve", "--tls", "--port", str(port)]
    argv += ["--decode", "1", "--threads-per-worker", "1", "--max-model-len", "256"]
    argv += ["--kv-cache-gb", "0.1", "--ready-timeout", "180"]
    launcher = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=die_with_parent
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_read_lines, args=(launcher.stdout, lines), daemon=True).start()
    try:
        url = f"https://127.0.0.1:{port}"
        assert f"{url}/v1" in lines.get(timeout=180)
        ca = re.search(r"SSL_CERT_FILE=(\S+)", lines.get(timeout=10)).group(1)
        key = os.path.join(os.path.dirname(ca), "server.key")
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
        with httpx.Client(verify=client_context(ca), timeout=60) as http:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", http_client=http)
            model = client.models.list().data[0].id
            raw = client.completions.with_raw_response.create(
                model=model, prompt="Hello", max_tokens=2
            )
        assert raw.parse().usage.completion_tokens <= 2
        assert raw.headers["x-splitserve-decode-worker"].startswith("https://127.0.0.1:")
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{url}/health", timeout=10)  # the system's roots do not vouch for it
        family = [psutil.Process(launcher.pid), *psutil.Process(launcher.pid).children(True)]
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(timeout=60) == 0
        _, alive = psutil.wait_procs(family, timeout=15)
        assert not alive, f"orphans left behind: {alive}"
        assert not os.path.exists(os.path.dirname(ca))  # the key and the CA went with it
    finally:
        stop_group(launcher)


def test_a_deployment_ca_signs_a_certificate_per_node_that_verifies_by_its_ca():
    from cryptography import x509

    from splitserve.cluster.tls import DeploymentCA, write_private

    ca = DeploymentCA()
    for ip in ("127.0.0.2", "127.0.0.3"):
        out = write_private(ca.issue([ip]))
        try:
            assert stat.S_IMODE(os.stat(out).st_mode) == 0o700
            key = os.path.join(out, "server.key")
            assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
            cert, cafile = os.path.join(out, "server.pem"), os.path.join(out, "ca.pem")
            assert _handshake(cert, key, cafile, ip) == "TLSv1.3"
            with open(cert, "rb") as f:  # named for its node alone (and loopback)
                san = x509.load_pem_x509_certificate(f.read()).extensions.get_extension_for_class(
                    x509.SubjectAlternativeName
                )
            ips = {str(a) for a in san.value.get_values_for_type(x509.IPAddress)}
            assert ips == {ip, "127.0.0.1"}
            with open(cafile, "rb") as f:
                assert f.read() == ca.ca_pem  # what the controller verifies by
        finally:
            shutil.rmtree(out)
