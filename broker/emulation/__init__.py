"""
The emulators the tests and ``cobald-remote demo`` run against: execution point, site, demo

Not product code: the product never imports them (``docs/htcondor.md``, ``docs/tardis.md``).
"""
