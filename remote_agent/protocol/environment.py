"""
The drone job's environment: what TARDIS and the manager put there, what the agent reads

TARDIS's site adapters export the drone's metadata as ``TardisDrone<Key>``
(``tardis/adapters/sites/htcondor.py:289``); the manager adds its bus settings
the same way. A drone's uuid names its site: ``<site name in lower case>-<10 hex
digits>`` (``tardis/resources/drone.py:50``, ``tardis/interfaces/siteadapter.py:135``).
"""

from __future__ import annotations

import re
from typing import Final

#: the prefix TARDIS's site adapters put before each key of the drone's environment
TARDIS_ENV_PREFIX: Final = "TardisDrone"
#: the drone's uuid
TARDIS_UUID_ENV: Final = "TardisDroneUuid"
#: the drone's cores as TARDIS's HTCondor site adapter exports them
TARDIS_CORES_ENV: Final = "TardisDroneCores"
#: what cobald-remote's TARDIS integration adds to every drone job's environment, read
#: when the ``COBALD_REMOTE_*`` variable of the same setting is not set
TARDIS_SETTINGS_ENV: Final = {
    "servers": "TardisDroneCobaldRemoteUrl",
    "site": "TardisDroneCobaldRemoteSite",
    "prefix": "TardisDroneCobaldRemotePrefix",
    "domain": "TardisDroneCobaldRemoteDomain",
}

_DRONE_UUID_RE = re.compile(r"^(?P<site>.+)-[0-9a-f]{10}\Z")


def site_of(drone: str) -> str | None:
    """The site part of a TARDIS drone uuid, or ``None`` if ``drone`` is none"""
    match = _DRONE_UUID_RE.match(drone)
    return match["site"] if match else None


def split_urls(text: str) -> list[str]:
    """``nats://a:4222,nats://b:4222`` as a list of URLs (nats-py does not split commas)"""
    return [url.strip() for url in text.split(",") if url.strip()]
