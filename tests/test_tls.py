"""TLS on the control plane, end to end on loopback: a real coordinator process serving
https with a self-signed certificate made here, and every client (Hub, ``tensorhub
status``) trusting it through ``ca_file`` / ``--ca-file`` / ``TENSORHUB_CA_FILE``."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch

import tensorhub
from tensorhub.testing import CoordinatorProcess, InMemoryTransport

pytestmark = pytest.mark.multiprocess

TOKEN = "tls-test-token"


def self_signed(dirpath) -> tuple[str, str]:
    """A fresh key and a self-signed certificate for 127.0.0.1 / localhost (PEM files)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "tensorhub-test")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = dirpath / "cert.pem", dirpath / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_path, 0o600)
    return str(cert_path), str(key_path)


@pytest.fixture
def tls_coordinator(tmp_path):
    cert, key = self_signed(tmp_path)
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    c = CoordinatorProcess(tmp_path / "state", token_file=token_file,
                           extra=("--ssl-certfile", cert, "--ssl-keyfile", key))
    c.start()
    assert c.url.startswith("https://127.0.0.1:"), c.url
    yield c, cert
    c.stop()


def test_hub_over_https_with_a_self_signed_certificate(tls_coordinator, monkeypatch):
    c, cert = tls_coordinator
    monkeypatch.delenv("TENSORHUB_CA_FILE", raising=False)
    w = {"a": torch.arange(1000, dtype=torch.float32), "b": torch.ones(3, 5)}
    with tensorhub.connect(c.url, worker_id="pub", token=TOKEN, ca_file=cert, transport=InMemoryTransport()) as pub:
        v = pub.publish("m", w)
        monkeypatch.setenv("TENSORHUB_CA_FILE", cert)  # the environment variable works too
        with tensorhub.connect(c.url, worker_id="reader", token=TOKEN, transport=InMemoryTransport()) as rd:
            got = rd.fetch("m", v, serve=False)
            assert got.keys() == w.keys() and all(torch.equal(got[k], w[k]) for k in w)


def test_untrusted_certificate_fails_fast_with_a_clear_error(tls_coordinator, monkeypatch):
    c, _ = tls_coordinator
    monkeypatch.delenv("TENSORHUB_CA_FILE", raising=False)
    t = time.monotonic()
    with pytest.raises(tensorhub.CoordinatorUnavailableError, match="TLS handshake .* TENSORHUB_CA_FILE"):
        tensorhub.connect(c.url, token=TOKEN, transport=InMemoryTransport())
    assert time.monotonic() - t < 10  # not retried for the 60 s a restart gets
    with pytest.raises(tensorhub.ConfigError, match="cannot use CA file"):
        tensorhub.connect(c.url, token=TOKEN, ca_file=str(c.state_dir.parent / "missing.pem"))


def test_tls_still_needs_the_token_and_plain_http_gets_nothing(tls_coordinator):
    c, cert = tls_coordinator
    import ssl

    ctx = ssl.create_default_context(cafile=cert)
    assert httpx.get(f"{c.url}/healthz", verify=ctx).status_code == 200
    assert httpx.get(f"{c.url}/v1/status", verify=ctx).status_code == 401
    assert httpx.get(f"{c.url}/v1/status", verify=ctx,
                     headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200
    plain = c.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        r = httpx.get(f"{plain}/healthz", timeout=5)
        r.raise_for_status()


def test_cli_status_over_https(tls_coordinator, tmp_path):
    c, cert = tls_coordinator
    token_file = tmp_path / "tok"
    token_file.write_text(TOKEN)
    env = {k: v for k, v in os.environ.items() if k != "TENSORHUB_CA_FILE"}
    base = [sys.executable, "-m", "tensorhub", "status", "--coordinator", c.url, "--token-file", str(token_file)]
    r = subprocess.run(base + ["--ca-file", cert], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and "coordinator epoch" in r.stdout, r.stderr
    r = subprocess.run(base, capture_output=True, text=True, timeout=60, env={**env, "TENSORHUB_CA_FILE": cert})
    assert r.returncode == 0, r.stderr
    r = subprocess.run(base, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 2 and "TLS handshake" in r.stderr, r.stderr
