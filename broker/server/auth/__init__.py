"""Per-drone NATS credentials in operator mode: the authority, each identity's users, revocation"""
