"""`python -m tools.make_certs --out certs`: a development CA and one certificate per service.

Writes ca.pem (and ca-key.pem, keep it private), then for each service
(allocator, executor, gateway) <name>.pem and <name>-key.pem: a certificate the CA signed,
good both as a server's and as a client's (mutual TLS), for the names localhost, 127.0.0.1,
the service name (compose) and any --hosts given (for example Kubernetes service names).
Start every service with its own files:

    --tls-cert certs/allocator.pem --tls-key certs/allocator-key.pem --tls-ca certs/ca.pem

For production, issue certificates from your own CA (cert-manager on Kubernetes); these are
for development and tests.
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

SERVICES = ("allocator", "executor", "gateway")
VALID_DAYS = 365


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pagedkv development"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """Readable by its owner only from the first byte (no window under a loose umask)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption()))


def _alt_names(hosts: list[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def make_certs(out: Path, hosts: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("pagedkv development CA")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_key(out / "ca-key.pem", ca_key)
    for service in SERVICES:
        key = ec.generate_private_key(ec.SECP256R1())
        names = _alt_names(["localhost", "127.0.0.1", service, *hosts])
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(service)).issuer_name(ca_name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        (out / f"{service}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(out / f"{service}-key.pem", key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.make_certs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="certs", help="directory to write (created)")
    parser.add_argument("--hosts", default="",
                        help="more comma-separated names or IPs every certificate is valid for")
    args = parser.parse_args(argv)
    hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
    make_certs(Path(args.out), hosts)
    print(f"wrote a development CA and {', '.join(SERVICES)} certificates to {args.out}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
