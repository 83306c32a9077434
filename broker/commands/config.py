"""``cobald-remote check-config FILE``: what cobald-remote will do with a COBalD configuration"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from broker.commands.failures import EXIT_FAILURE
from broker.commands.options import add_json
from broker.commands.table import format_table, write_json

if TYPE_CHECKING:
    from broker.tardis.check import Factory, Report

_TIMING = (
    "lost_after_s",
    "drain_deadline_s",
    "lost_removal_after_s",
    "request_timeout_s",
    "retain_ended_s",
    "retain_lost_s",
    "clock_skew_warn_s",
    "scale_down_window_s",
    "utilisation_hold_s",
    "drone_start_s",
    "black_hole_lifetime_s",
    "black_hole_backoff_s",
    "black_hole_backoff_max_s",
    "bootstrap_token_valid_s",
    "bootstrap_jwt_valid_s",
)


def _sites(factory: Factory) -> str:
    return "; ".join(
        f"{site.name} ({site.adapter}, quota {site.quota}, machine types "
        f"{', '.join(site.machine_types) or 'none'}; drones {site.bus_site or '?'}-<10 hex digits>)"
        for site in factory.sites
    )


def _creds(factory: Factory, path: str | None) -> str:
    if path is None:
        return "none"
    return f"{path} ({'not readable here: see below' if factory.creds else 'readable'})"


def _rows(factory: Factory) -> list[tuple[str, str]]:
    rows = [
        ("TARDIS configuration", factory.tardis_source),
        ("sites", _sites(factory) or "none"),
        ("batch system", factory.batch_system or "none"),
        ("interval", f"{factory.interval} s between the pools' adjustments"),
    ]
    bus = factory.bus
    if not factory.has_bus:
        return [*rows, ("bus", "none: stock TARDIS, nothing is wrapped")]
    if bus is None:
        return [*rows, ("bus", "not valid (below)")]
    from remote_agent.protocol.names import Namespace

    names = Namespace(bus.prefix)
    address = bus.metrics_address
    rows += [
        ("servers", ", ".join(bus.servers)),
        ("drone servers", ", ".join(bus.drone_servers)),
        ("credentials", _creds(factory, bus.creds)),
        ("domain", bus.domain or "none"),
        ("prefix", f"{bus.prefix} (stream {names.event_stream}, bucket {names.record_bucket})"),
        ("durable consumer", bus.durable),
        ("metrics", f"http://{address[0]}:{address[1]}/metrics" if address else "none"),
        (
            "drone environment",
            "passed to each drone job" if bus.drone_environment else "not passed",
        ),
        ("note buffer", f"{bus.note_buffer} TARDIS state notes"),
        (
            "black holes",
            f"a site is flagged after {bus.black_hole_drones} black-hole drones in a row"
            if bus.black_hole_drones
            else "not detected",
        ),
        (
            "bootstrap_key",
            f"{bus.bootstrap_key} (the manager issues each drone its own identity)"
            if bus.bootstrap_key
            else "none: no identities issued, drones bring their own credentials",
        ),
        (
            "bootstrap_creds",
            f"{bus.bootstrap_creds} on the drones" if bus.bootstrap_creds else "none",
        ),
    ]
    return rows + [
        (key, f"{value:g} s" if (value := getattr(bus, key)) else "never") for key in _TIMING
    ]


def _bus_facts(factory: Factory) -> dict[str, object] | None:
    """The ``bus`` section as JSON: ``None`` for stock TARDIS, ``valid`` false if not valid"""
    bus = factory.bus
    if not factory.has_bus:
        return None
    if bus is None:
        return {"valid": False}
    from remote_agent.protocol.names import Namespace

    names = Namespace(bus.prefix)
    address = bus.metrics_address
    creds = None if bus.creds is None else {"path": bus.creds, "readable": not factory.creds}
    return {
        "valid": True,
        "servers": list(bus.servers),
        "drone_servers": list(bus.drone_servers),
        "creds": creds,
        "domain": bus.domain,
        "prefix": bus.prefix,
        "stream": names.event_stream,
        "bucket": names.record_bucket,
        "durable": bus.durable,
        "metrics": f"http://{address[0]}:{address[1]}/metrics" if address else None,
        "drone_environment": bus.drone_environment,
        "note_buffer": bus.note_buffer,
        "black_hole_drones": bus.black_hole_drones,
        "bootstrap_key": bus.bootstrap_key,
        "bootstrap_creds": bus.bootstrap_creds,
        **{key: getattr(bus, key) for key in _TIMING},
    }


def report_facts(report: Report) -> dict[str, object]:
    """What :func:`format_report` and the warnings and problems say, as one JSON document"""
    factories = [
        {
            "where": factory.where,
            "form": factory.form,
            "tardis_configuration": factory.tardis_source,
            "sites": [
                {
                    "name": site.name,
                    "adapter": site.adapter,
                    "quota": site.quota,
                    "machine_types": list(site.machine_types),
                    "drone_site": site.bus_site,
                }
                for site in factory.sites
            ],
            "batch_system": factory.batch_system,
            "interval": factory.interval
            if isinstance(factory.interval, int | float)
            else str(factory.interval),
            "bus": _bus_facts(factory),
        }
        for factory in report.factories
    ]
    return {
        "file": str(report.path),
        "valid": not report.problems,
        "factories": factories,
        "warnings": list(report.warnings),
        "problems": list(report.problems),
    }


def format_report(report: Report) -> str:
    """Each factory as a two-column table, then the verdict"""
    parts = []
    for factory in report.factories:
        table = format_table(("SETTING", "VALUE"), _rows(factory))
        parts.append(f"{report.path}: {factory.where}: {factory.form}\n{table}")
    verdict = "not valid" if report.problems else "valid"
    parts.append(f"{report.path}: {verdict}")
    return "\n\n".join(parts)


def check_config(args: argparse.Namespace) -> int:
    """``cobald-remote check-config FILE``"""
    from broker.tardis.check import check_file

    report = check_file(Path(args.file))
    if args.json:  # the warnings and problems are in the document
        write_json(report_facts(report))
        return EXIT_FAILURE if report.problems else 0
    print(format_report(report))
    for line in report.warnings:
        print(f"cobald-remote: warning: {line}", file=sys.stderr)
    for line in report.problems:
        print(f"cobald-remote: {line}", file=sys.stderr)
    return EXIT_FAILURE if report.problems else 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``check-config``'s arguments"""
    parser.description = (
        "Read a COBalD configuration the way the COBalD daemon does (the same loader and "
        "YAML tags) without building or starting anything, and print what cobald-remote "
        "will do: sites, servers, credentials, metrics address, timings. Exit status 1, "
        "with one line per problem, if it is not valid. With --json, one JSON document "
        "holds all of it, warnings and problems as lists."
    )
    parser.add_argument("file", metavar="FILE", help="the COBalD YAML configuration")
    add_json(parser)
    parser.set_defaults(run=check_config)
