"""
Every NATS name cobald-remote uses: subjects, streams, buckets, API prefixes, inboxes, headers

One prefix derives the drone subjects, the event stream and the buckets
(:class:`Namespace`); the JetStream and KV conventions (``$JS.<domain>.API``,
``KV_<bucket>``, ``$KV.<bucket>.<key>``) and header names are spelled here and
nowhere else.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from typing import Final

from remote_agent.protocol.errors import SchemaError

#: the prefix every subject, stream and bucket name derives from unless configured
DEFAULT_PREFIX: Final = "cobald"

#: the characters of a subject token
TOKEN_CHARS: Final = string.ascii_letters + string.digits + "_-"
#: the most characters of a subject token
MAX_TOKEN: Final = 128
#: the subject token of a drone's events, of its commands and of the manager's notes on it
_EVENTS: Final = "evt"
_COMMANDS: Final = "cmd"
_NOTES: Final = "mgr"

# --------------------------------------------------------------------------- headers

#: the publisher's message id: JetStream drops a second message with the same id
MSG_ID: Final = "Nats-Msg-Id"
#: a write that succeeds only if the subject's last sequence is this one (compare-and-set)
EXPECTED_LAST: Final = "Nats-Expected-Last-Subject-Sequence"
#: headers the server puts on its answers to direct gets and message gets, never on a
#: client's publish. nats-server checks a publisher's permissions against the subject,
#: not the reply subject, and publishes its answers (JetStream acks, direct-get
#: responses) to the reply subject as they are: a stream that captures that subject
#: stores them. A stored message carrying these headers is such a relay; one asked
#: for without headers (a direct get with ``no_hdr``) lacks what every writer sends:
#: an event its ``Nats-Msg-Id`` (its ``id``), a record its compare-and-set header.
RELAY_HEADERS: Final = frozenset(
    {"Nats-Stream", "Nats-Subject", "Nats-Sequence", "Nats-Time-Stamp", "Nats-Last-Sequence"}
)
#: KV delete and purge markers (nats-py ``nats/js/kv.py``) and the markers the server
#: writes when it removes a subject's messages: on a record key, the record is gone
KV_OPERATION: Final = "KV-Operation"
KV_MARKER: Final = "Nats-Marker-Reason"
#: the status of a pull request's answer (``404``, ``408``, ``409``) and its text
STATUS: Final = "Status"
DESCRIPTION: Final = "Description"
#: messages left after a pull request's answer
PENDING_MESSAGES: Final = "Nats-Pending-Messages"

# --------------------------------------------------------------------------- JetStream

#: the JetStream API prefix without a domain
DEFAULT_API_PREFIX: Final = "$JS.API"
#: ``$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.<stream>.<consumer>``: the server's
#: note that a message reached ``max_deliver`` (nats-server server/jetstream_api.go:271)
MAX_DELIVERIES_ADVISORY: Final = "$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES"


def api_prefix(domain: str | None = None) -> str:
    """The JetStream API prefix: ``$JS.API``, or ``$JS.<domain>.API`` across a domain"""
    return f"$JS.{domain}.API" if domain else DEFAULT_API_PREFIX


def kv_stream(bucket: str) -> str:
    """The stream behind a KV bucket"""
    return f"KV_{bucket}"


def kv_subjects(bucket: str) -> str:
    """The subject prefix of a KV bucket's keys (``$KV.<bucket>.``)"""
    return f"$KV.{bucket}."


def kv_write_prefix(bucket: str, domain: str | None = None) -> str:
    """Where a client writes a bucket's keys: through the domain's API across a domain"""
    return (f"{api_prefix(domain)}." if domain else "") + kv_subjects(bucket)


def direct_get(bucket: str, key: str, domain: str | None = None) -> str:
    """The subject of a direct read of one key's last value"""
    return f"{api_prefix(domain)}.DIRECT.GET.{kv_stream(bucket)}.{kv_subjects(bucket)}{key}"


#: nats-py's reply-subject prefix, for a connection whose permissions do not confine it
DEFAULT_INBOX: Final = "_INBOX"


def inbox_prefix(drone: str) -> str:
    """The reply-subject prefix of one drone's connections (its subscribe permission)"""
    return f"{DEFAULT_INBOX}_{drone}"


def bootstrap_inbox(site: str) -> str:
    """The reply-subject prefix of a site's bootstrap identity (its subscribe permission)"""
    return f"_BOOTSTRAP_{check_token(site, 'site')}"


def dedupe_id(drone: str, incarnation: str, seq: int) -> str:
    """The :data:`MSG_ID` of a drone's event: stable across resends"""
    return f"{drone}:{incarnation}:{seq}"


# --------------------------------------------------------------------------- subjects


#: what a subject token is, in the words every error about one uses
TOKEN_RULE: Final = f"1-{MAX_TOKEN} of A-Z a-z 0-9 _ -"


def is_token(value: str) -> bool:
    """
    Whether ``value`` can be one subject token (and one KV key part): the one token rule

    A token is 1 to :data:`MAX_TOKEN` of :data:`TOKEN_CHARS`: no dots, wildcards or
    whitespace. The wire schema's ``Token`` fields and :func:`check_token` apply it.
    """
    return 0 < len(value) <= MAX_TOKEN and not value.strip(TOKEN_CHARS)


def check_token(value: str, what: str = "subject token") -> str:
    """
    Return ``value`` if it can be one subject token (:func:`is_token`)

    :raises SchemaError: for empty values, dots, wildcards, whitespace, other
        characters than ``A-Z a-z 0-9 _ -``, or more than :data:`MAX_TOKEN` characters
    """
    if not is_token(value):
        raise SchemaError(
            f"invalid {what} {value!r}: use {TOKEN_RULE} (no dots, wildcards or whitespace)"
        )
    return value


def event_subject(prefix: str, site: str, drone: str, kind: str) -> str:
    """
    The subject of a drone's event of ``kind``, spelled without checking its tokens

    For values that are tokens already (a decoded event's); :meth:`Namespace.event`
    checks them first.
    """
    return f"{prefix}.{site}.{drone}.{_EVENTS}.{kind}"


def is_note_subject(subject: str) -> bool:
    """Whether ``subject`` is a manager note's (``<prefix>.<site>.<drone>.mgr.<kind>``)"""
    parts = subject.split(".")
    return len(parts) == 5 and parts[3] == _NOTES


@dataclass(frozen=True, slots=True)
class Namespace:
    """
    Names of every subject, stream and bucket, derived from one prefix

    Subjects are scoped per drone, so that NATS permissions can confine one
    drone's credentials to ``<prefix>.<site>.<drone>.evt.>``, its command
    subject and its own handshake key.
    """

    prefix: str = DEFAULT_PREFIX

    def __post_init__(self) -> None:
        check_token(self.prefix, "subject prefix")

    @property
    def event_stream(self) -> str:
        """JetStream stream holding every drone event and TARDIS's own timeline"""
        return f"{self.prefix.upper().replace('-', '_')}_EVENTS"

    @property
    def record_bucket(self) -> str:
        """KV bucket holding one handshake record per drone"""
        return f"{self.prefix}-drones"

    @property
    def manager_bucket(self) -> str:
        """KV bucket of the manager's own secrets (the record proof key); drones cannot read it"""
        return f"{self.prefix}-manager"

    @property
    def grant_bucket(self) -> str:
        """KV bucket of the bootstrap grants (token hashes, enrolled keys); drones cannot read it"""
        return f"{self.prefix}-grants"

    @property
    def record_stream(self) -> str:
        """The stream behind :attr:`record_bucket`"""
        return kv_stream(self.record_bucket)

    @property
    def all_records(self) -> str:
        """Wildcard of every handshake record's subject"""
        return f"{kv_subjects(self.record_bucket)}>"

    def record_subject(self, site: str, drone: str) -> str:
        """Subject of one drone's handshake record (what a write to its key publishes)"""
        return kv_subjects(self.record_bucket) + self.record_key(site, drone)

    @property
    def all_events(self) -> str:
        """Wildcard of every drone event"""
        return f"{self.prefix}.*.*.{_EVENTS}.>"

    @property
    def all_manager_notes(self) -> str:
        """Wildcard of every manager-side note (TARDIS's view of each drone)"""
        return f"{self.prefix}.*.*.{_NOTES}.>"

    def bootstrap(self, site: str) -> str:
        """Subject of the issuer's requests from one site's drones"""
        return f"{self.prefix}.bootstrap.{check_token(site, 'site')}"

    @property
    def all_bootstrap(self) -> str:
        """Wildcard of the issuer's requests from every site"""
        return f"{self.prefix}.bootstrap.*"

    def drone_root(self, site: str, drone: str) -> str:
        """Prefix of everything about one drone, e.g. to read its timeline"""
        return f"{self.prefix}.{check_token(site, 'site')}.{check_token(drone, 'drone uuid')}"

    def event(self, site: str, drone: str, kind: str) -> str:
        """Subject of one drone's event of ``kind``"""
        return self._under(site, drone, _EVENTS, check_token(kind, "event kind"))

    def drone_events(self, site: str, drone: str) -> str:
        """Wildcard of one drone's events (its publish permission)"""
        return self._under(site, drone, _EVENTS, ">")

    def command(self, site: str, drone: str) -> str:
        """Subject on which one drone's agent answers commands"""
        return self._under(site, drone, _COMMANDS)

    def manager_note(self, site: str, drone: str, kind: str) -> str:
        """Subject of a manager-side note about one drone"""
        return self._under(site, drone, _NOTES, check_token(kind, "note kind"))

    def timeline_subjects(self, drone: str, site: str | None = None) -> list[str]:
        """
        Wildcards of one drone's events and the manager's notes on it, at ``site`` or
        at any site; ``drone`` and ``site`` go in as given (a reader's filter)
        """
        root = f"{self.prefix}.{site or '*'}.{drone}"
        return [f"{root}.{_EVENTS}.>", f"{root}.{_NOTES}.>"]

    def _under(self, site: str, drone: str, *tokens: str) -> str:
        return ".".join((self.drone_root(site, drone), *tokens))

    def record_key(self, site: str, drone: str) -> str:
        """Key of one drone's handshake record in :attr:`record_bucket`"""
        return f"{check_token(site, 'site')}.{check_token(drone, 'drone uuid')}"

    def parse_event_subject(self, subject: str) -> tuple[str, str, str]:
        """
        Split an event subject into ``(site, drone, kind)``

        :raises SchemaError: if ``subject`` is not an event subject of this namespace
        """
        parts = subject.split(".")
        if len(parts) != 5 or parts[0] != self.prefix or parts[3] != _EVENTS:
            raise SchemaError(f"not an event subject of {self.prefix!r}: {subject!r}")
        return parts[1], parts[2], parts[4]
