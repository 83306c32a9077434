"""
The TARDIS/COBalD glue: the only code of cobald-remote that imports ``tardis`` and ``cobald``

``broker.tardis_adapter`` re-exports its public names for the entry point and the docs.
"""
