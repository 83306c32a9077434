"""
Helpers of the tests, imported as ``support.<module>`` (pytest puts ``tests/`` on the path)

``servers`` NATS servers, credentials and a cuttable proxy; ``agent`` in-process agents and
reading their events back; ``manager`` the manager service; ``drones`` fake drones
speaking the wire schema; ``tardis`` fake TARDIS adapters; ``processes`` PIDs, ports
and the command-line launchers; ``vectors`` the documented wire examples.
"""
