"""Throwaway PKI for the local cluster: a CA, a loopback serving certificate, the SA signing key.

Everything is ECDSA P-256: key generation takes milliseconds (RSA-2048 takes ~100 ms each), and
kube-apiserver accepts EC keys for serving, for client CAs and for signing service-account tokens
(ES256).
The keys protect a cluster that listens on 127.0.0.1 only and lives as long as one `up`; they are
regenerated on every `up` and never leave the cluster folder.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The first address of --service-cluster-ip-range is the `kubernetes` Service; in-cluster clients
# (a real pod's kubeconfig) dial it, so the serving certificate names it.
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
_DNS_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
_VALIDITY = dt.timedelta(days=30)


@dataclass(frozen=True, slots=True)
class Pki:
    """Paths of the files `generate` writes."""

    ca_cert: Path
    serving_cert: Path
    serving_key: Path
    sa_private_key: Path
    sa_public_key: Path
    kubelet_client_cert: Path
    kubelet_client_key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "mig-agent devcluster"),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def generate(directory: Path) -> Pki:
    """Write a fresh CA, a serving cert for 127.0.0.1/localhost/kubernetes.*, and an SA key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        ca_cert=directory / "ca.crt",
        serving_cert=directory / "serving.crt",
        serving_key=directory / "serving.key",
        sa_private_key=directory / "sa.key",
        sa_public_key=directory / "sa.pub",
        kubelet_client_cert=directory / "kubelet-client.crt",
        kubelet_client_key=directory / "kubelet-client.key",
    )
    # Backdate a little: the certificates are used within milliseconds, and a clock that steps
    # backwards (VMs) must not make them "not yet valid".
    now = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)

    ca_key = _key()
    ca_name = _name("mig-agent-devcluster-ca")
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pki.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))

    # One serving certificate for every component: they all listen on 127.0.0.1 only, and sharing it
    # lets health checks verify kube-controller-manager and kube-scheduler against the same CA
    # instead of skipping verification of their self-signed certificates.
    serving_key = _key()
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in _DNS_NAMES]
    sans += [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address(KUBERNETES_SERVICE_IP)),
    ]
    serving_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kube-apiserver"))
        .issuer_name(ca_name)
        .public_key(serving_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki.serving_cert.write_bytes(serving_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.serving_key, serving_key)

    # The API server's client certificate for kubelets (logs, exec on a real node): the kubelet
    # authenticates it against this CA and asks the API server whether system:masters may.
    client_key = _key()
    client_cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-kubelet-client"),
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                ]
            )
        )
        .issuer_name(ca_name)
        .public_key(client_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pki.kubelet_client_cert.write_bytes(client_cert.public_bytes(serialization.Encoding.PEM))
    _write_key(pki.kubelet_client_key, client_key)

    # The service-account signer is a bare key pair: kube-apiserver needs the private key to issue
    # tokens (TokenRequest) and the public key to verify them; KCM signs legacy token secrets too.
    sa_key = _key()
    _write_key(pki.sa_private_key, sa_key)
    pki.sa_public_key.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM,
            serialization.PublicFormat.SubjectPublicKeyInfo,
        )
    )
    return pki
