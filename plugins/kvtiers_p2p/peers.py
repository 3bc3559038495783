"""The peers a p2p tier's options name: their addresses (``host``/``port``, ``peers``, a
``peers_file``) and the CurveZMQ keys to reach them with. Shared by the tier and by its fault
injection (:mod:`kvtiers_p2p.faults`)."""

from __future__ import annotations

import json

from kvtiers import ConfigError

from . import protocol as P


def peer_urls(host: str | None = None, port: int | None = None, peers: list | None = None) -> list[str]:
    """The peer addresses of the tier's options: ``host``/``port`` first, then ``peers``
    entries (``{"host": H, "port": P}`` or ``"tcp://H:P"``). Raises :class:`ConfigError`."""
    urls: list[str] = []
    if (host is None) != (port is None):
        raise ConfigError("tier 'p2p': give host and port together")
    if host is not None:
        urls.append(P.tcp_url(host, port))
    for i, entry in enumerate(peers or []):
        if isinstance(entry, str):
            url = entry
        elif isinstance(entry, dict) and set(entry) <= {"host", "port"} and isinstance(entry.get("host"), str) \
                and isinstance(entry.get("port"), int):
            url = P.tcp_url(entry["host"], entry["port"])
        else:
            raise ConfigError(f'tier \'p2p\': peers[{i}] must be {{"host": str, "port": int}} or "tcp://HOST:PORT", '
                              f"got {entry!r}")
        try:
            P.parse_endpoint(url)
        except ValueError as e:
            raise ConfigError(f"tier 'p2p': peers[{i}]: {e}") from None
        if url not in urls:
            urls.append(url)
    return urls


def config_peers(config: dict) -> list[str]:
    """The peer addresses a p2p tier with options ``config`` uses (a ``peers_file`` that
    exists replaces ``host``/``port``/``peers``, as in the tier)."""
    urls = peer_urls(config.get("host"), config.get("port"), config.get("peers"))
    if config.get("peers_file"):
        try:
            with open(config["peers_file"], "rb") as f:
                urls = peer_urls(None, None, json.load(f))
        except FileNotFoundError:
            pass
    return urls


def load_curve(server_key: str | None, secret_file: str | None) -> tuple[bytes, bytes, bytes] | None:
    """``(server public key, client public key, client secret key)`` from the CurveZMQ key
    files of the options, or None where neither is given. Raises :class:`ConfigError`."""
    if server_key is None and secret_file is None:
        return None
    if server_key is None or secret_file is None:
        raise ConfigError("tier 'p2p': CurveZMQ needs both curve_server_key and curve_secret_file")
    import zmq.auth

    try:
        server_public, _ = zmq.auth.load_certificate(server_key)
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as e:
        raise ConfigError(f"tier 'p2p': cannot read CurveZMQ keys: {e}") from None
    if not secret:
        raise ConfigError(f"tier 'p2p': curve_secret_file {secret_file} holds no secret key (.key_secret)")
    return server_public, public, secret
