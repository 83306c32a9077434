"""
The drone job's environment: what TARDIS and the manager put there, what the agent reads

TARDIS's site adapters export the drone's metadata as ``TardisDrone<Key>``
(``tardis/adapters/sites/htcondor.py:289``); the manager adds its bus settings
the same way. A drone's uuid names its site: ``<site name in lower case>-<10 hex
digits>`` (``tardis/resources/drone.py:50``, ``tardis/interfaces/siteadapter.py:135``).
"""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Sequence
from typing import Final

#: the prefix TARDIS's site adapters put before each key of the drone's environment
TARDIS_ENV_PREFIX: Final = "TardisDrone"
#: the drone's uuid
TARDIS_UUID_ENV: Final = "TardisDroneUuid"
#: the drone's cores as TARDIS's HTCondor site adapter exports them
TARDIS_CORES_ENV: Final = "TardisDroneCores"
#: the time limit TARDIS's Slurm site adapter asked for (``sbatch --time``, plain minutes for
#: a number), passed beside the ``TardisDrone*`` variables (``tardis/adapters/sites/slurm.py:221``)
TARDIS_WALLTIME_ENV: Final = "SLURM_Walltime"
#: the project's own variable of each bus setting: the agent reads it before TARDIS's (below),
#: the operator commands default to it
BUS_SETTINGS_ENV: Final = {
    "servers": "COBALD_REMOTE_URL",
    "creds": "COBALD_REMOTE_CREDS",
    "prefix": "COBALD_REMOTE_PREFIX",
    "domain": "COBALD_REMOTE_DOMAIN",
}
#: the ``nats`` command line's variables of the same settings, read last
NATS_TOOL_ENV: Final = {"servers": "NATS_URL", "creds": "NATS_CREDS"}
#: what cobald-remote's TARDIS integration adds to every drone job's environment, read
#: when the ``COBALD_REMOTE_*`` variable of the same setting is not set
TARDIS_SETTINGS_ENV: Final = {
    "servers": "TardisDroneCobaldRemoteUrl",
    "site": "TardisDroneCobaldRemoteSite",
    "prefix": "TardisDroneCobaldRemotePrefix",
    "domain": "TardisDroneCobaldRemoteDomain",
    "bootstrap_creds": "TardisDroneCobaldRemoteBootstrapCreds",
    "token": "TardisDroneCobaldRemoteToken",
}

#: URL schemes nats-py connects with (``nats/aio/client.py:1488-1491``)
URL_SCHEMES: Final = ("nats", "tls", "ws", "wss")
_WEBSOCKET_SCHEMES: Final = ("ws", "wss")

_DRONE_UUID_RE = re.compile(r"^(?P<site>.+)-[0-9a-f]{10}\Z")


def site_of(drone: str) -> str | None:
    """The site part of a TARDIS drone uuid, or ``None`` if ``drone`` is none"""
    match = _DRONE_UUID_RE.match(drone)
    return match["site"] if match else None


def split_urls(text: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` as a list of URLs (nats-py does not split commas)"""
    return [url.strip() for url in text.split(",") if url.strip()]


def server_url_problem(urls: Sequence[str]) -> str | None:
    """
    Why ``urls`` are not NATS server URLs that drones and the manager connect with, or ``None``

    Each must be ``nats|tls|ws|wss://HOST[:PORT]``; websocket and plain URLs may not be
    mixed (nats-py refuses that, ``nats/aio/client.py:1519-1523``).
    """
    for url in urls:
        try:
            parts = urllib.parse.urlsplit(url)
            parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
        except ValueError:
            return f"{url!r} is not a URL"
        if parts.scheme not in URL_SCHEMES:
            return f"{url!r} is not one of {', '.join(URL_SCHEMES)}://HOST:PORT"
        if not parts.hostname:
            return f"{url!r} names no host"
    if len({urllib.parse.urlsplit(url).scheme in _WEBSOCKET_SCHEMES for url in urls}) > 1:
        return "ws:// or wss:// URLs mixed with nats:// or tls:// ones"
    return None
