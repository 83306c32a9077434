"""The COBalD ``logging:`` example of docs/operations.md, applied the way COBalD applies it"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cobald.daemon.config.mapping import configure_logging

from broker.manager.lifecycle import log as lifecycle_log
from broker.manager.registry import log as registry_log
from broker.tardis.removal import log as tardis_log

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def _example() -> dict[str, object]:
    text = DOC.read_text()
    block = text.split("<!-- logging-example -->", 1)[1].split("<!-- /logging-example -->")[0]
    loaded = yaml.safe_load(block.strip().removeprefix("```yaml").removesuffix("```"))
    assert isinstance(loaded, dict)
    return loaded


@pytest.fixture
def restored() -> Iterator[None]:
    names = ["cobald.runtime.cobald_remote", "cobald.runtime.cobald_remote.registry"]
    names.append("cobald.runtime.tardis")
    saved = {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers)) for n in names}
    yield
    for name, (level, handlers) in saved.items():
        logger = logging.getLogger(name)
        for handler in logger.handlers:
            if handler not in handlers:
                handler.close()
        logger.setLevel(level)
        logger.handlers[:] = handlers


def test_the_documented_logging_section_routes_the_lives_of_drones(
    tmp_path: Path, restored: None
) -> None:
    config = _example()["logging"]
    assert isinstance(config, dict)
    drones_log = tmp_path / "drones.log"
    config["handlers"]["drones"]["filename"] = str(drones_log)  # type: ignore[index]
    configure_logging(config)
    # every logger of the central side is in COBalD's tree, under the documented names
    assert registry_log.name == lifecycle_log.name == "cobald.runtime.cobald_remote.registry"
    assert tardis_log.name == "cobald.runtime.cobald_remote.tardis"
    lifecycle_log.info("drone site1/site1-0000000001 ended: drained")
    tardis_log.info("stop_resource of site1/site1-0000000001 deferred")
    logging.getLogger("cobald.runtime.tardis.resources.drone").info("TARDIS chatter")
    for handler in logging.getLogger("cobald.runtime.cobald_remote.registry").handlers:
        handler.flush()
    lines = drones_log.read_text().splitlines()
    assert len(lines) == 1
    assert lines[0].endswith(
        "INFO cobald.runtime.cobald_remote.registry: drone site1/site1-0000000001 ended: drained"
    )
    assert logging.getLogger("cobald.runtime.tardis").getEffectiveLevel() == logging.WARNING
    assert tardis_log.isEnabledFor(logging.INFO)
