"""What the commands print for a failure, and their exit code"""

from __future__ import annotations


class CliError(Exception):
    """A failure to report in one line and exit 1"""
