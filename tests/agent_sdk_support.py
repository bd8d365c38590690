"""What the agent SDK tool guards' tests share: the failures they simulate."""

from __future__ import annotations


class ModelDown(Exception):
    """The model provider failed after the tools ran (the process died there)."""


class Killed(BaseException):
    """The process died at a failpoint."""
