"""
The demonstration in operator mode: every drone bootstraps an identity of its own

The embedded broker runs with a fresh authority; the manager has its own credentials, the
demo site its bootstrap identity, and the issuer gives each drone TARDIS submits its JWT
(``docs/deployment.md#bootstrap``). Everything lives under the run's directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.server.auth.authority import (
    create_authority,
    issuer_key_of,
    save_authority,
    save_issuer_key,
)
from broker.server.auth.credentials import bootstrap_credentials, manager_credentials
from remote_agent.protocol.names import Namespace


@dataclass(frozen=True, slots=True)
class DemoAuth:
    """What the broker, the manager and the drones of a secured demonstration use"""

    server_config: Path
    manager_creds: Path
    #: the ``bus:`` keys that turn the issuer on
    bus_keys: dict[str, Any]


def secure(root: Path, namespace: Namespace, site: str) -> DemoAuth:
    """An authority, the server's configuration and the credentials, under ``root``"""
    root.mkdir(parents=True, exist_ok=True)
    authority = create_authority("cobald-remote-demo")
    authority_file = root / "authority.json"
    save_authority(authority, authority_file)
    config = root / "server.conf"
    config.write_text(f'jetstream {{ store_dir: "{root / "js"}" }}\n' + authority.server_config())
    issuer_key = root / "issuer-key.json"
    save_issuer_key(issuer_key_of(authority), issuer_key)
    manager = root / "manager.creds"
    manager.write_text(manager_credentials(authority))
    site_creds = root / f"bootstrap-{site}.creds"
    site_creds.write_text(bootstrap_credentials(authority, namespace, site))
    return DemoAuth(
        server_config=config,
        manager_creds=manager,
        bus_keys={
            "creds": str(manager),
            "bootstrap_key": str(issuer_key),
            "bootstrap_creds": str(site_creds),
        },
    )
