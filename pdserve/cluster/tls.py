"""TLS for pdserve's gRPC: the one place that turns certificates into server and channel
credentials, so every server (tokenizer, prefill, decode) and every channel (gateway to each of
them, prefill to decode for the KV push, health probes) is secured alike.

    --tls-cert, --tls-key   this process's certificate chain and private key (PEM files): a
                            server needs them to serve TLS; a client presents them (mutual TLS)
    --tls-ca                the CA that signed the peers' certificates (PEM): a client checks
                            servers against it (default: the system's roots); a server given it
                            requires every client to present a certificate it signed
    --tls-server-name       the name a client expects in every server's certificate, instead
                            of the address it dials: workers are dialled at addresses known only
                            once they start (pod IPs), so one certificate shared by every service
                            names a fixed DNS name and each client checks that name (gRPC's
                            ssl_target_name_override; also the TLS SNI sent)

No flag set: plaintext, as before (a loopback cluster, or a mesh that encrypts for us). A server
given only --tls-ca refuses to start rather than fall back to plaintext.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TLSConfig:
    cert: str = ""  # PEM path; empty: none
    key: str = ""
    ca: str = ""
    server_name: str = ""  # empty: check each server against the address dialled

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.server_name and not self.enabled:
            raise ValueError("--tls-server-name needs TLS: give --tls-ca or --tls-cert")

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        """This server's identity; client certificates required when a CA is given."""
        if not self.cert:
            raise ValueError("a TLS server needs --tls-cert and --tls-key (only --tls-ca given)")
        root = _read(self.ca) if self.ca else None
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))], root_certificates=root,
            require_client_auth=root is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Checks the server against the CA (or the system's roots); presents our certificate
        when we have one."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None,
        )


PLAINTEXT = TLSConfig()


def tls_from_args(args: argparse.Namespace) -> TLSConfig:
    """The TLS flags (pdserve.cluster.flags.add_tls_flags) as a config."""
    return TLSConfig(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name)


def listen(server: grpc.aio.Server, address: str, tls: TLSConfig) -> int:
    """Bind `server` to `address` (host:port), over TLS when configured; the port bound."""
    if tls.enabled:
        return server.add_secure_port(address, tls.server_credentials())
    return server.add_insecure_port(address)


def channel(
    address: str, tls: TLSConfig, options: list[tuple[str, int | str]]
) -> grpc.aio.Channel:
    """A channel to `address`, over TLS when configured."""
    if tls.enabled:
        if tls.server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
        return grpc.aio.secure_channel(address, tls.channel_credentials(), options=options)
    return grpc.aio.insecure_channel(address, options=options)


def _read(path: str) -> bytes:
    return Path(path).read_bytes()
