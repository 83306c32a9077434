"""``cobald-remote demo``: the real COBalD daemon with TARDIS against the emulated site"""
