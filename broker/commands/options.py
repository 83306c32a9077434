"""
The options several commands share: where the bus is, its subject prefix, JSON output

Its rule: ``--server``, ``--creds``, ``--prefix`` and ``--domain`` default to the
project's own variables, as the agent reads them (``COBALD_REMOTE_URL``, ...), and
``--server`` and ``--creds`` then to the ``nats`` command line's (``NATS_URL``, ``NATS_CREDS``).
Given before the command's name (:data:`BEFORE`), they are the defaults of the command's own,
which win when given too; a command that does not take one refuses it (:func:`refused_before`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Final

from remote_agent.protocol.environment import BUS_SETTINGS_ENV, NATS_TOOL_ENV
from remote_agent.protocol.names import DEFAULT_PREFIX

if TYPE_CHECKING:
    import asyncio

    from nats.aio.client import Client

#: ``--server`` of the commands that take several URLs
SERVERS_HELP = "NATS URL(s), comma-separated"
#: the variables ``--server`` defaults to, the first set one wins
SERVER_ENV: Final = (BUS_SETTINGS_ENV["servers"], NATS_TOOL_ENV["servers"])
#: the variables ``--creds`` defaults to, the first set one wins
CREDS_ENV: Final = (BUS_SETTINGS_ENV["creds"], NATS_TOOL_ENV["creds"])
#: the variable ``--prefix`` defaults to
PREFIX_ENV: Final = (BUS_SETTINGS_ENV["prefix"],)
#: the variable ``--domain`` defaults to
DOMAIN_ENV: Final = (BUS_SETTINGS_ENV["domain"],)
#: every variable the options default to
ALL_ENV: Final = (*SERVER_ENV, *CREDS_ENV, *PREFIX_ENV, *DOMAIN_ENV)

#: the options a command takes through this module that also go before its name, with their help
BEFORE: Final = {
    "--server": SERVERS_HELP,
    "--creds": "NATS credentials file",
    "--domain": "JetStream domain, for leaf-node deployments",
    "--prefix": "first subject token",
}
#: the namespace attribute that lists which of :data:`BEFORE` the chosen command takes
_TAKES: Final = "takes_before"

#: what to do when the server refuses the commands' subjects
_NEEDS_MANAGER: Final = (
    "these commands need the manager's credentials (--creds; cobald-remote auth manager)"
)


def from_env(names: Sequence[str], env: Mapping[str, str] = os.environ) -> str | None:
    """The value of the first of ``names`` set (and not empty) in ``env``"""
    return next((env[name].strip() for name in names if env.get(name, "").strip()), None)


def _env_help(help_text: str, names: Sequence[str], otherwise: str = "") -> str:
    fallback = f", else {otherwise}" if otherwise else ""
    return f"{help_text} (default: ${', else $'.join(names)}{fallback})"


def _before(flag: str) -> str:
    """The namespace attribute of ``flag`` given before the command's name"""
    return "before_" + flag.removeprefix("--")


def _takes(parser: argparse.ArgumentParser, flag: str) -> None:
    """Note that the command of ``parser`` takes ``flag`` before its name too"""
    parser.set_defaults(**{_TAKES: (*takes_before(parser), flag)})


def takes_before(parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """Which of :data:`BEFORE` the command of ``parser`` takes"""
    return tuple(parser.get_default(_TAKES) or ())


def add_before(parser: argparse.ArgumentParser, shown: Iterable[str] = BEFORE) -> None:
    """
    :data:`BEFORE` on the parser of a group, in the namespace only if given; the help
    shows ``shown``, the ones its commands take (the others are there to be refused)
    """
    wanted = set(shown)
    group: argparse._ActionsContainer = parser
    if wanted:
        group = parser.add_argument_group(
            "bus options",
            "for the commands that take them, as after the command's name; given there too, "
            "the one there wins",
        )
    for flag, help_text in BEFORE.items():
        (group if flag in wanted else parser).add_argument(
            flag,
            dest=_before(flag),
            default=argparse.SUPPRESS,
            metavar=flag.removeprefix("--").upper(),
            help=help_text if flag in wanted else argparse.SUPPRESS,
        )


@contextlib.contextmanager
def before_the_command(
    namespace: argparse.Namespace, parsers: Iterable[argparse.ArgumentParser]
) -> Iterator[None]:
    """
    While the arguments of a command (``parsers``: its own and its subcommands') are parsed,
    the options given before its name in ``namespace`` are its options' defaults

    An option given before the name is no longer required after it.
    """
    seen = vars(namespace)
    given = {flag: seen[_before(flag)] for flag in BEFORE if _before(flag) in seen}
    changed: list[tuple[argparse.Action, object, bool]] = []
    for command in parsers:
        takes = takes_before(command)
        for action in command._actions:
            flags = [flag for flag in action.option_strings if flag in takes and flag in given]
            if flags:
                changed.append((action, action.default, action.required))
                action.default, action.required = given[flags[0]], False
    try:
        yield
    finally:
        for action, default, required in changed:
            action.default, action.required = default, required


def refused_before(args: argparse.Namespace) -> list[str]:
    """The options given before the command's name that the chosen command does not take"""
    takes = getattr(args, _TAKES, ())
    return [flag for flag in BEFORE if hasattr(args, _before(flag)) and flag not in takes]


def add_prefix(parser: argparse.ArgumentParser) -> None:
    """``--prefix``: the first subject token"""
    parser.add_argument(
        "--prefix",
        default=from_env(PREFIX_ENV) or DEFAULT_PREFIX,
        help=_env_help(BEFORE["--prefix"], PREFIX_ENV, DEFAULT_PREFIX),
    )
    _takes(parser, "--prefix")


def add_connection(
    parser: argparse.ArgumentParser,
    *,
    server_help: str = SERVERS_HELP,
    creds_help: str = BEFORE["--creds"],
) -> None:
    """``--server``, ``--creds`` (both defaulting to the environment), ``--domain``, ``--prefix``"""
    server = from_env(SERVER_ENV)
    parser.add_argument(
        "--server", default=server, required=server is None, help=_env_help(server_help, SERVER_ENV)
    )
    parser.add_argument(
        "--creds", default=from_env(CREDS_ENV), help=_env_help(creds_help, CREDS_ENV)
    )
    parser.add_argument(
        "--domain",
        default=from_env(DOMAIN_ENV),
        help=_env_help(BEFORE["--domain"], DOMAIN_ENV, "none"),
    )
    for flag in ("--server", "--creds", "--domain"):
        _takes(parser, flag)
    add_prefix(parser)


def add_json(parser: argparse.ArgumentParser) -> None:
    """``--json``: print JSON instead of text"""
    parser.add_argument("--json", action="store_true", help="print JSON for scripts")


async def connect(
    args: argparse.Namespace, name: str, on_error: Callable[[Exception], None] | None = None
) -> Client:
    """Connect to ``--server`` with ``--creds`` as client ``name``, failing fast"""
    from broker.server.connection import connect_once

    return await connect_once(args.server, args.creds, name=name, on_error=on_error)


def _refusal_line(err: BaseException) -> str:
    return f"{err}: {_NEEDS_MANAGER}"


def refused(nc: Client) -> str:
    """The line for a server that refused one of the connection's subjects; ``""`` if it did not"""
    from remote_agent.protocol.connect import permissions_violation

    last = nc.last_error
    return _refusal_line(last) if last is not None and permissions_violation(last) else ""


class _Refusal:
    """
    Cancels the task inside :func:`connected` once the server refuses a publish

    The server answers a refused publish or subscribe with ``-ERR`` at once and nats-py
    hands it to the error callback only (``nats/aio/client.py:1604-1606``); the request
    itself would wait for its timeout. The cancel is the one :func:`asyncio.timeout` makes.
    """

    def __init__(self, task: asyncio.Task[object] | None) -> None:
        self.task = task
        self.error: Exception | None = None

    def arrived(self, err: Exception) -> None:
        # a refused subscription (an inbox, say) is left to the failure it causes: the
        # refused publish of the same request follows it and names the service
        if self.error is None and "permissions violation for publish" in str(err).lower():
            self.error = err
            if self.task is not None:
                self.task.cancel()


@contextlib.asynccontextmanager
async def connected(args: argparse.Namespace, name: str) -> AsyncIterator[Client]:
    """
    :func:`connect`, closed on the way out; the server's refusal of a publish ends what
    the block awaits at once, and a failure after it refused a subject is reported as
    that refusal

    :raises OperatorError: if the server refused one of the connection's subjects
    """
    import asyncio

    from broker.errors import OperatorError
    from remote_agent.protocol.connect import close

    task = asyncio.current_task()
    refusal = _Refusal(None)
    nc = await connect(args, name, on_error=refusal.arrived)
    refusal.task, cancelling = task, task.cancelling() if task else 0
    try:
        yield nc
    except asyncio.CancelledError:
        if refusal.error is None or task is None or task.uncancel() > cancelling:
            raise  # cancelled by someone else too
    except Exception:
        if line := refused(nc):
            raise OperatorError(line) from None
        raise
    finally:
        refusal.task = None
        await close(nc)
    if refusal.error is not None:  # also when the block swallowed the cancel
        if task is not None and task.cancelling() > cancelling:
            task.uncancel()
        raise OperatorError(_refusal_line(refusal.error))


def add_seconds(
    parser: argparse.ArgumentParser, flag: str, default: float, help: str, metavar: str = "SECONDS"
) -> None:
    """Add an option that takes a number of seconds"""
    parser.add_argument(flag, type=float, default=default, metavar=metavar, help=help)
