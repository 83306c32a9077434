"""The drone side of cobald-remote: the agent that runs inside each drone"""

__version__ = "0.1.0"
