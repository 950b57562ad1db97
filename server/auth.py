"""API keys (--api-keys FILE): who may call the TranslationService, on both fronts, and which models each client may
use. Health, reflection and /metrics stay open. Without a key file the server is open to every client (app.py says
so once at start).

The file is TOML, one table per client; a key is stored only as its SHA-256, never in clear:

    [[client]]
    name = "web-frontend"                 # in logs and metrics, never the key
    sha256 = "9f86d081884c7d65…"          # printf %s "$KEY" | sha256sum  (nmtserve api-key NAME makes both)
    models = ["en-fr"]                    # optional: the models it may use (absent: every one)
    max_concurrent = 8                    # optional: its translation calls in flight at once (server/quotas.py)
    chars_per_minute = 60000              # optional: source characters a minute, a token bucket

A call carries its key as `authorization: Bearer KEY` (gRPC metadata, or the HTTP header; LibreTranslate's api_key
field too). No key or an unknown one is UNAUTHENTICATED, a model the client may not use PERMISSION_DENIED. Digests
are compared in constant time, every client's every time. A call over its client's quota is RESOURCE_EXHAUSTED
with a retry-after (quotas.py). The file is read again when it changes (checked at most
once a second, on a call) or on SIGHUP; a file that no longer parses keeps the keys in force and is logged."""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

from nmtserve.errors import ConfigError, NmtserveError
from nmtserve.server.quotas import ClientQuota, Quotas

log = logging.getLogger("nmtserve.server")
RECHECK_SECONDS = 1.0  # how often a call may look at the file's modification time
QUOTA_FIELDS = ("max_concurrent", "chars_per_minute")
FIELDS = {"name", "sha256", "models", *QUOTA_FIELDS}


class Unauthenticated(NmtserveError):
    """A call without a key, or with one no client has (UNAUTHENTICATED)."""


class PermissionDenied(NmtserveError):
    """A client's call to a model it may not use (PERMISSION_DENIED)."""


@dataclass(frozen=True)
class Client:
    name: str
    digest: bytes  # SHA-256 of its key
    models: frozenset[str] | None  # None: every model
    max_concurrent: int | None = None  # None: no limit of its own
    chars_per_minute: int | None = None


def digest_of(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer(metadata) -> str | None:
    """The key of an `authorization: Bearer KEY` entry among (name, value) pairs, else None."""
    for name, value in metadata or ():
        if name.lower() == "authorization" and value.startswith("Bearer "):
            return value.removeprefix("Bearer ").strip()
    return None


def client_entry(name: str, key: str, models: list[str] | None = None, **limits: int) -> str:
    """The file's [[client]] table for a client of this key: its SHA-256, never the key."""
    lines = [f"name = {json.dumps(name)}", f'sha256 = "{hashlib.sha256(key.encode()).hexdigest()}"']
    lines += [f"models = {json.dumps(models)}"] if models is not None else []
    lines += [f"{field} = {value}" for field, value in limits.items()]
    return "[[client]]\n" + "".join(f"{line}\n" for line in lines) + "\n"


def read_clients(path: Path) -> list[Client]:
    """The file's clients; ConfigError naming the file, the entry and the field."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"--api-keys {path}: {e}") from None
    entries = data.get("client", [])
    if not isinstance(entries, list) or set(data) - {"client"}:
        raise ConfigError(f"--api-keys {path}: expected [[client]] tables only")
    clients, names = [], set()
    for i, entry in enumerate(entries):
        where = f"--api-keys {path}: client {i + 1}"
        name, digest, models = entry.get("name"), entry.get("sha256"), entry.get("models")
        if not isinstance(name, str) or not name or name in names:
            raise ConfigError(f"{where}: name {name!r} must be a string of its own")
        if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
            raise ConfigError(f"{where} ({name}): sha256 must be 64 hexadecimal digits, the SHA-256 of the key")
        if models is not None and not (isinstance(models, list) and all(isinstance(m, str) for m in models)):
            raise ConfigError(f"{where} ({name}): models must be a list of model ids")
        limits = {field: entry.get(field) for field in QUOTA_FIELDS}
        for field, value in limits.items():
            if value is not None and (type(value) is not int or value < 1):
                raise ConfigError(f"{where} ({name}): {field} {value!r} must be a whole number above 0")
        if set(entry) - FIELDS:
            raise ConfigError(f"{where} ({name}): unknown fields {sorted(set(entry) - FIELDS)}")
        names.add(name)
        clients.append(Client(name, bytes.fromhex(digest), None if models is None else frozenset(models), **limits))
    return clients


class ApiKeys:
    """The clients of a key file, read again when it changes."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.clients = read_clients(self.path)
        self._stamp = self._file_stamp()
        self._checked = time.monotonic()
        self._quotas = Quotas()

    def _file_stamp(self) -> tuple[int, int] | None:
        try:
            stat = os.stat(self.path)
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size

    def reload(self) -> None:
        """Read the file again; on an error keep the keys in force and log it (one line naming the problem)."""
        try:
            self.clients = read_clients(self.path)
            log.info("--api-keys %s: %d client(s)", self.path, len(self.clients))
        except ConfigError as e:
            log.error("%s; the keys read before stay in force", e)
        self._stamp = self._file_stamp()

    def _reload_if_changed(self) -> None:
        now = time.monotonic()
        if now - self._checked >= RECHECK_SECONDS:
            self._checked = now
            if self._file_stamp() != self._stamp:
                self.reload()

    def client(self, key: str | None) -> Client:
        """The client whose key this is; Unauthenticated when none is."""
        self._reload_if_changed()
        if not key:
            raise Unauthenticated("authorization: no API key; send the header `authorization: Bearer KEY`")
        digest, found = digest_of(key), None
        for client in self.clients:  # every one, each in constant time
            if hmac.compare_digest(digest, client.digest):
                found = client
        if found is None:
            raise Unauthenticated("authorization: this API key is not known here")
        return found

    def quota(self, client: Client) -> ClientQuota:
        """The client's quota state, under its limits in the file as now read."""
        return self._quotas.of(client.name, client.max_concurrent, client.chars_per_minute)

    @staticmethod
    def allow(client: Client, model: str) -> None:
        """PermissionDenied when the client may not use the model."""
        if client.models is not None and model not in client.models:
            raise PermissionDenied(f"model {model!r}: client {client.name} may use {', '.join(sorted(client.models))}")
