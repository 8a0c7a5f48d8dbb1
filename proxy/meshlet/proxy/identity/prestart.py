"""The pre-start step: the proxy's ECDSA P-256 key and CSR, written to a private directory.

It runs before the proxy (or in a child process of it) so that the long-running proxy never
imports `cryptography` (DESIGN §5, memory budget). The key never leaves the directory, which
should be memory-backed (an emptyDir with medium Memory, or /dev/shm).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

KEY_FILE: Final = "key.pem"
CSR_FILE: Final = "csr.der"


@dataclass(frozen=True, slots=True)
class IdentityFiles:
    key: Path
    csr: Path


def files_in(directory: Path) -> IdentityFiles:
    return IdentityFiles(directory / KEY_FILE, directory / CSR_FILE)


def make_key_and_csr(name: str) -> tuple[bytes, bytes]:
    """(PKCS#8 PEM key, DER CSR whose only SAN is the DNS name `name`)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    return key_pem, csr.public_bytes(serialization.Encoding.DER)


def _write_private(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def prepare(directory: Path, name: str) -> IdentityFiles:
    """Writes a new key (mode 0600) and CSR into `directory` (created mode 0700)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key_pem, csr_der = make_key_and_csr(name)
    files = files_in(directory)
    _write_private(files.key, key_pem)
    _write_private(files.csr, csr_der)
    return files


def prepare_in_child(directory: Path, name: str, timeout: float = 30.0) -> IdentityFiles:
    """`prepare` in a short-lived child process, keeping `cryptography` out of this one."""
    subprocess.run(
        [sys.executable, "-m", __name__, "--dir", str(directory), "--name", name],
        check=True,
        timeout=timeout,
    )
    return files_in(directory)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True, help="private, memory-backed folder")
    parser.add_argument("--name", required=True, help="the proxy's identity name")
    args = parser.parse_args(argv)
    prepare(args.dir, args.name)


if __name__ == "__main__":
    main()
