"""The NATS server side: the embedded server, provisioning, connections, credentials"""

from broker.server.embedded import BINARY_NAME, EmbeddedServer, find_binary

__all__ = ["BINARY_NAME", "EmbeddedServer", "find_binary"]
