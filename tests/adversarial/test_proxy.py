"""The reverse-proxy example of docs/operations.md, checked for real: `nginx -t` accepts it, and a
real nginx with a self-signed certificate in front of a real coordinator carries a worker's
registration, signed requests and health checks over HTTPS, with the client's address (not the
proxy's) reaching the coordinator's per-address limits.
"""

from __future__ import annotations

import datetime
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from adversarial.processes import register
from decentrl.protocol import API_PREFIX

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("nginx") is None, reason="needs nginx (make test installs nginx-light)"),
]

DOCS = Path(__file__).parents[2] / "docs" / "operations.md"


def documented_config() -> str:
    text = DOCS.read_text()
    match = re.search(r"<!-- nginx-config -->\n```nginx\n(.*?)```", text, re.DOTALL)
    assert match, "docs/operations.md lost its nginx example"
    return match[1]


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "fullchain.pem", directory / "privkey.pem"
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert_path, key_path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def nginx_conf(prefix: Path, coordinator_url: str, port: int) -> Path:
    """The documented file, pointed at this coordinator, port and certificate, inside a main config
    of its own (pid, logs and temp paths under `prefix`, so no root paths are touched)."""
    cert, key = self_signed(prefix)
    site = documented_config()
    site = site.replace("server 127.0.0.1:8760;", f"server {coordinator_url.removeprefix('http://')};")
    site = site.replace("listen 443 ssl;", f"listen 127.0.0.1:{port} ssl;")
    site = site.replace("/etc/ssl/decentrl/fullchain.pem", str(cert))
    site = site.replace("/etc/ssl/decentrl/privkey.pem", str(key))
    (prefix / "decentrl.conf").write_text(site)
    for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (prefix / name).mkdir(exist_ok=True)
    temps = "".join(
        f"    {name}_temp_path {prefix / name};\n"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    main = (
        f"pid {prefix / 'nginx.pid'};\nerror_log {prefix / 'error.log'};\nevents {{}}\n"
        f"http {{\n    access_log off;\n{temps}    include {prefix / 'decentrl.conf'};\n}}\n"
    )
    (prefix / "nginx.conf").write_text(main)
    return prefix / "nginx.conf"


def test_the_documented_nginx_config_serves_workers_over_tls(
    start_coordinator,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,  # noqa: ANN001
) -> None:
    coordinator = start_coordinator(
        ['service.trusted_proxies=["127.0.0.1"]', "trust.request_burst=5", "trust.requests_per_second=0.01"]
    )
    port = free_port()
    conf = nginx_conf(tmp_path, coordinator.url, port)
    check = subprocess.run(
        ["nginx", "-t", "-p", str(tmp_path), "-c", str(conf)], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stderr
    monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "fullchain.pem"))  # trust the test's certificate
    proxy = subprocess.Popen(["nginx", "-p", str(tmp_path), "-c", str(conf), "-g", "daemon off;"])
    try:
        url = f"https://localhost:{port}"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{url}{API_PREFIX}/health")
                break
            except httpx.TransportError:
                time.sleep(0.1)
        assert health.status_code == 200, health.text
        coordinator.url = url  # the worker talks to the proxy only
        client, _ = register(coordinator)
        assert client.info().group_size > 0  # a signed request, through the proxy
        # Junk tokens from 127.0.0.1 exhaust *its* address bucket (burst 5); another client address
        # behind the same proxy keeps its own, as X-Forwarded-For tells the coordinator.
        junk = {"Authorization": "Bearer junk"}
        statuses = [httpx.get(f"{url}{API_PREFIX}/info", headers=junk).status_code for _ in range(7)]
        assert statuses[0] == 401 and statuses[-2:] == [429, 429], statuses
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
            assert other.get(f"{url}{API_PREFIX}/info", headers=junk).status_code == 401
        client.close()
    finally:
        proxy.terminate()
        proxy.wait(timeout=10)
