"""Mutual TLS on every gRPC hop: conductor → agent, agent → agent (KV transfer).

One private certificate authority signs two kinds of certificate, told apart by the
name they carry (subject common name and a DNS subject-alternative name):

* ``kvc-conductor``: conductors. Only they may run transactions, prefills and
  generations, read snapshots and events, and drain (``node_agent.auth``).
* ``kvc-agent``: node agents, as servers and as clients of each other's ``FetchKv`` /
  ``ReadBlocks``.

A client checks the server's certificate against the CA and the name ``kvc-agent``
(``grpc.ssl_target_name_override``), not against the address it dialled: agents come
and go under pod IPs, and what matters is that the peer holds an agent certificate of
this cluster's CA. The server requires a client certificate of the same CA and reads the
role from it. ``kvc certs`` writes a CA and one certificate of each role; any PKI that
issues these names (cert-manager, Vault) works the same.

An agent certificate may also name the one node it belongs to, as a URI
subject-alternative name ``urn:kvc:node:<node id>`` (``kvc certs --node ID``). Then a KV
pull grant (``node_agent.auth.Caller``) that a conductor bound to a destination node can
be used by that node's certificate only, and an agent refuses to start with a
certificate that names another node than its own.

Without TLS files gRPC is plaintext, which is allowed only where no network can reach
it: ``grpc_plaintext`` ``"loopback"`` (the default) refuses to serve or dial plaintext
beyond the loopback interface; ``"any"`` allows it everywhere, for a service mesh that
does mTLS in its sidecars; ``"never"`` refuses plaintext even on loopback.

Rotation: a server re-reads its three files whenever one changes (on the next
handshake); clients build their credentials when they open a channel, so a channel
opened after the change uses the new files.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
import ssl
import string
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, cast

import grpc
from pydantic import BaseModel, Field, model_validator
from pydantic.config import JsonDict

if TYPE_CHECKING:  # imported where certificates are made: ~12 MiB a conductor need not hold
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

__all__ = [
    "AGENT_NAME",
    "CONDUCTOR_NAME",
    "AuthContextSource",
    "GrpcTlsSettings",
    "PlaintextPolicy",
    "Role",
    "TlsFiles",
    "auth_of_certificate",
    "certificate_node",
    "check_node_id",
    "check_plaintext",
    "client_channel",
    "is_loopback",
    "peer_node",
    "peer_role",
    "write_bundle",
]

log = logging.getLogger("kvc.tls")

CONDUCTOR_NAME: Final = "kvc-conductor"
AGENT_NAME: Final = "kvc-agent"
Role = Literal["conductor", "agent"]
PlaintextPolicy = Literal["loopback", "any", "never"]
_ROLE_OF_NAME: Final[Mapping[str, Role]] = {CONDUCTOR_NAME: "conductor", AGENT_NAME: "agent"}
NODE_URI_PREFIX: Final = "urn:kvc:node:"
_NODE_ID_CHARS: Final = frozenset(string.ascii_letters + string.digits + "._-")


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """A process's certificate and key (PEM) and the CA it trusts."""

    cert: Path
    key: Path
    ca: Path

    @classmethod
    def from_settings(cls, cert: str, key: str, ca: str) -> TlsFiles | None:
        """The three files, or None when none is given; some but not all is an error."""
        given = [bool(cert), bool(key), bool(ca)]
        if not any(given):
            return None
        if not all(given):
            raise ValueError("TLS needs all three of tls_cert_file, tls_key_file, tls_ca_file")
        files = cls(Path(cert), Path(key), Path(ca))
        files.read()  # fail at start, not on the first handshake
        return files

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA certificates), each PEM."""
        out = []
        for path in (self.cert, self.key, self.ca):
            try:
                data = path.read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot read TLS file {path}: {exc}") from exc
            if b"-----BEGIN" not in data:
                raise ValueError(f"TLS file {path} is not PEM")
            out.append(data)
        return out[0], out[1], out[2]

    def _stamp(self) -> tuple[float, ...]:
        try:
            return tuple(p.stat().st_mtime for p in (self.cert, self.key, self.ca))
        except OSError:
            return ()

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials that require a client certificate of the CA and pick up
        new files on the next handshake after any of them changes."""
        cert, key, ca = self.read()
        initial = grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)
        seen = self._stamp()

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            nonlocal seen
            stamp = self._stamp()
            if not stamp or stamp == seen:
                return None
            try:
                cert, key, ca = self.read()
            except ValueError as exc:  # mid-write: keep serving with the old files
                log.warning("TLS files changed but cannot be read yet: %s", exc)
                return None
            seen = stamp
            log.info("TLS certificate files reloaded")
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        # gRPC reads None from the fetcher as "unchanged"; its type stubs leave None out.
        fetcher = cast("Callable[[], grpc.ServerCertificateConfiguration]", fetch)
        return grpc.dynamic_ssl_server_credentials(
            initial, fetcher, require_client_authentication=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        cert, key, ca = self.read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def _server_context(self) -> ssl.SSLContext:
        self.read()  # the same checks and messages as gRPC's credentials
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.load_verify_locations(cafile=self.ca)
        context.verify_mode = ssl.CERT_REQUIRED
        return context

    def server_ssl_context(self) -> ssl.SSLContext:
        """For a plain-socket listener (the token stream): the same policy as
        ``server_credentials`` — a client certificate of the CA required, new files
        picked up on the next handshake after any of them changes."""
        context = self._server_context()
        loaded = self._stamp()

        def pick(sock: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
            nonlocal context, loaded
            stamp = self._stamp()
            if stamp and stamp != loaded:
                try:
                    context = self._server_context()
                    loaded = stamp
                    log.info("TLS certificate files reloaded (token stream)")
                except (ValueError, OSError, ssl.SSLError) as exc:
                    log.warning("TLS files changed but cannot be read yet: %s", exc)
            sock.context = context

        outer = self._server_context()
        outer.sni_callback = pick
        return outer

    def client_ssl_context(self) -> ssl.SSLContext:
        """For dialling an agent's token stream: verify it against the CA and the name
        ``kvc-agent`` (pass ``server_hostname=AGENT_NAME``), present this certificate."""
        self.read()
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context


def auth_of_certificate(cert: Mapping[str, Any]) -> dict[str, list[bytes]]:
    """A verified peer certificate as ``ssl`` reports it (``getpeercert()``), in the
    shape of gRPC's ``auth_context()``, so ``peer_role``/``peer_node`` read both."""
    subject: Sequence[Sequence[tuple[str, str]]] = cert.get("subject", ())
    names: Sequence[tuple[str, str]] = cert.get("subjectAltName", ())
    return {
        "x509_common_name": [v.encode() for rdn in subject for k, v in rdn if k == "commonName"],
        "x509_subject_alternative_name": [v.encode() for _, v in names],
        "peer_uri": [v.encode() for k, v in names if k == "URI"],
    }


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, without port) is this machine's loopback."""
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _host_of(address: str) -> str:
    if address.startswith("["):  # [::1]:50051
        return address[1 : address.index("]")]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


def check_plaintext(address: str, policy: PlaintextPolicy, what: str) -> None:
    """Refuse plaintext gRPC on ``address`` (host:port) unless ``policy`` allows it."""
    if policy == "any":
        return
    host = _host_of(address)
    if policy == "loopback" and is_loopback(host):
        return
    where = "at all" if policy == "never" else f"beyond loopback ({host})"
    raise ValueError(
        f"refusing plaintext gRPC {what} {where}: give tls_cert_file, tls_key_file and "
        "tls_ca_file (`kvc certs` makes them), or set grpc_plaintext=any behind a mesh "
        "that encrypts (docs/security.md)"
    )


def client_channel(
    address: str,
    files: TlsFiles | None,
    policy: PlaintextPolicy,
    *,
    options: Sequence[tuple[str, Any]] = (),
    interceptors: Sequence[grpc.aio.ClientInterceptor] | None = None,
) -> grpc.aio.Channel:
    """A channel to an agent: mTLS when ``files`` are given, else plaintext where the
    policy allows it (``ValueError`` otherwise)."""
    if files is None:
        check_plaintext(address, policy, "to " + address)
        return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address,
        files.channel_credentials(),
        options=[*options, ("grpc.ssl_target_name_override", AGENT_NAME)],
        interceptors=interceptors,
    )


class AuthContextSource(Protocol):
    """What carries a verified peer's names: a gRPC servicer context, or the token
    stream's context (``auth_of_certificate``)."""

    def auth_context(self) -> Mapping[str, Iterable[bytes]]: ...


def peer_role(context: AuthContextSource) -> Role | None:
    """The role the calling peer's verified client certificate names (None: no
    certificate, or neither name)."""
    auth = context.auth_context()
    names: list[bytes] = [
        *auth.get("x509_common_name", ()),
        *auth.get("x509_subject_alternative_name", ()),
    ]
    roles = {
        _ROLE_OF_NAME[n] for raw in names if (n := raw.decode(errors="replace")) in _ROLE_OF_NAME
    }
    if len(roles) != 1:
        return None  # none, or a certificate claiming both roles: trust neither
    return roles.pop()


def _node_of(uris: Sequence[str]) -> str | None:
    nodes = {u[len(NODE_URI_PREFIX) :] for u in uris if u.startswith(NODE_URI_PREFIX)}
    return nodes.pop() if len(nodes) == 1 else None  # none, or several: no node identity


def peer_node(context: AuthContextSource) -> str | None:
    """The node id the calling peer's verified certificate names (``urn:kvc:node:<id>``),
    or None (no certificate, no such name, or more than one)."""
    uris = context.auth_context().get("peer_uri", ())
    return _node_of([raw.decode(errors="replace") for raw in uris])


def certificate_node(pem: bytes) -> str | None:
    """The node id a PEM certificate names (``urn:kvc:node:<id>``), or None."""
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    return _node_of(san.get_values_for_type(x509.UniformResourceIdentifier))


def check_node_id(node_id: str) -> str:
    """``node_id`` if a certificate can name it (letters, digits, ``.``, ``_``, ``-``; at
    most 128), else ``ValueError``."""
    if not node_id or len(node_id) > 128 or not set(node_id) <= _NODE_ID_CHARS:
        raise ValueError(
            f"node id {node_id!r}: a certificate can name only 1-128 letters, digits, '.', '_', '-'"
        )
    return node_id


_GROUP: Final[JsonDict] = {"group": "gRPC security: mTLS (docs/security.md)"}


class GrpcTlsSettings(BaseModel):
    """The TLS settings of a process that speaks gRPC (conductor and agent alike)."""

    tls_cert_file: str = Field(
        "", description="PEM certificate of this process (kvc certs)", json_schema_extra=_GROUP
    )
    tls_key_file: str = Field(
        "", description="PEM private key of tls_cert_file", json_schema_extra=_GROUP
    )
    tls_ca_file: str = Field(
        "", description="PEM CA that signs every peer's certificate", json_schema_extra=_GROUP
    )
    grpc_plaintext: PlaintextPolicy = Field(
        "loopback",
        description="Without TLS files: plaintext gRPC on loopback only, anywhere (behind "
        "a mesh that encrypts), or never",
        json_schema_extra=_GROUP,
    )

    @model_validator(mode="after")
    def _tls_files_readable(self) -> GrpcTlsSettings:
        self.tls_files()
        return self

    def tls_files(self) -> TlsFiles | None:
        return TlsFiles.from_settings(self.tls_cert_file, self.tls_key_file, self.tls_ca_file)


# ------------------------------------------------------------------ kvc certs


def _name(common_name: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def write_bundle(
    out: Path, *, days: int = 365, extra_dns: Sequence[str] = (), nodes: Sequence[str] = ()
) -> list[Path]:
    """Write a new CA (``ca.pem``, ``ca-key.pem``) and a conductor and an agent
    certificate signed by it (``conductor.pem``/``-key.pem``, ``agent.pem``/``-key.pem``)
    into ``out``, and for each of ``nodes`` an agent certificate that also names that
    node (``agent-<node>.pem``/``-key.pem``, ``urn:kvc:node:<node>``). Keys are ECDSA
    P-256, written mode 0600. Returns the paths."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    if days < 1:
        raise ValueError("days must be >= 1")
    for node in nodes:
        check_node_id(node)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)  # clock skew between hosts
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvc-ca"))
        .issuer_name(_name("kvc-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    written = [
        _write(out / "ca.pem", ca_cert.public_bytes(serialization.Encoding.PEM)),
        _write(out / "ca-key.pem", _pem_key(ca_key), secret=True),
    ]
    issued: list[tuple[str, str, str | None]] = [
        ("conductor", CONDUCTOR_NAME, None),
        ("agent", AGENT_NAME, None),
        *((f"agent-{node}", AGENT_NAME, node) for node in nodes),
    ]
    for stem, name, named in issued:
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = [x509.DNSName(n) for n in (name, *extra_dns)]
        if named is not None:
            alt.append(x509.UniformResourceIdentifier(NODE_URI_PREFIX + named))
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        written.append(_write(out / f"{stem}.pem", cert.public_bytes(serialization.Encoding.PEM)))
        written.append(_write(out / f"{stem}-key.pem", _pem_key(key), secret=True))
    return written


def _write(path: Path, data: bytes, *, secret: bool = False) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if secret:
        path.chmod(0o600)
    return path
