"""kvc.tls: which addresses count as loopback, the plaintext policy, reading the TLS
files, and the certificates `kvc certs` writes."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvc.tls import (
    AGENT_NAME,
    CONDUCTOR_NAME,
    TlsFiles,
    certificate_node,
    check_plaintext,
    is_loopback,
)
from kvc_cli.cli import main


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True), ("127.8.9.1", True), ("localhost", True), ("::1", True),
        ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.0.0.7", False),
        ("agent-0.pool.svc", False), ("localhost.example.com", False),
    ],
)  # fmt: skip
def test_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


@pytest.mark.parametrize(
    ("address", "policy", "allowed"),
    [
        ("127.0.0.1:50051", "loopback", True),
        ("[::1]:50051", "loopback", True),
        ("localhost:1", "loopback", True),
        ("0.0.0.0:50051", "loopback", False),
        ("agent-0.pool.svc:50051", "loopback", False),
        ("agent-0.pool.svc:50051", "any", True),
        ("127.0.0.1:50051", "never", False),
    ],
)
def test_plaintext_policy(address: str, policy: str, allowed: bool) -> None:
    if allowed:
        check_plaintext(address, policy, "to x")  # type: ignore[arg-type]
    else:
        with pytest.raises(ValueError, match="refusing plaintext gRPC"):
            check_plaintext(address, policy, "to x")  # type: ignore[arg-type]


def test_kvc_certs_writes_a_ca_and_one_certificate_per_role(tmp_path: Path) -> None:
    assert main(["certs", "--out", str(tmp_path), "--days", "30", "--dns", "extra.example"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    for role, name in (("conductor", CONDUCTOR_NAME), ("agent", AGENT_NAME)):
        cert = x509.load_pem_x509_certificate((tmp_path / f"{role}.pem").read_bytes())
        assert cert.issuer == ca.subject
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == name
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.DNSName) == [name, "extra.example"]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert set(usage) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert 29 < lifetime.days <= 30
        mode = stat.S_IMODE((tmp_path / f"{role}-key.pem").stat().st_mode)
        assert mode == 0o600
    assert main(["certs", "--out", str(tmp_path), "--days", "0"]) == 2


def test_kvc_certs_names_nodes_in_their_own_agent_certificates(tmp_path: Path) -> None:
    assert main(["certs", "--out", str(tmp_path), "--node", "gpu-0", "--node", "gpu-1.a_b"]) == 0
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.pem").read_bytes())
    assert certificate_node((tmp_path / "agent.pem").read_bytes()) is None
    for node in ("gpu-0", "gpu-1.a_b"):
        pem = (tmp_path / f"agent-{node}.pem").read_bytes()
        cert = x509.load_pem_x509_certificate(pem)
        cert.verify_directly_issued_by(ca)
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == AGENT_NAME
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [f"urn:kvc:node:{node}"]
        assert certificate_node(pem) == node
        assert stat.S_IMODE((tmp_path / f"agent-{node}-key.pem").stat().st_mode) == 0o600
    for bad in ("a/b", "", "x" * 129, "node 1"):
        assert main(["certs", "--out", str(tmp_path / "bad"), "--node", bad]) == 2


def test_tls_files_all_or_none_and_pem(tmp_path: Path) -> None:
    assert TlsFiles.from_settings("", "", "") is None
    with pytest.raises(ValueError, match="all three"):
        TlsFiles.from_settings("a.pem", "", "")
    with pytest.raises(ValueError, match="cannot read"):
        TlsFiles.from_settings("nope.pem", "nope-key.pem", "ca.pem")
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("not a certificate")
    with pytest.raises(ValueError, match="not PEM"):
        TlsFiles.from_settings(*(str(tmp_path / n) for n in ("c.pem", "k.pem", "ca.pem")))
