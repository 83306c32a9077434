"""
The emulated site TARDIS drives: a local batch system, an overlay pool, and
the fake HTCondor tools and TARDIS adapters in front of them
"""
