"""The central side of cobald-remote: broker, provisioning, registry and TARDIS glue"""
