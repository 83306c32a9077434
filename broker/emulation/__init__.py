"""
The emulators the tests and ``cobald-remote demo`` run against; not product code

Three of them, one subpackage each: ``execution_point`` (a drone's HTCondor
master and startd with fake ``condor_*`` tools), ``site`` (what TARDIS drives:
a local batch system, an overlay pool and the tools and adapters in front of
them) and ``demo`` (the demonstration that runs the real COBalD daemon against
the other two). The product never imports them; ``docs/htcondor.md`` and
``docs/tardis.md`` describe them.
"""
