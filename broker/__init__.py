"""The central side of cobald-remote: server, JetStream layer, manager, TARDIS glue, commands"""
