"""The one error type for a setting that cannot work (imports nothing of ``app``).

Library parts raise it with the setting's own name; the face (the ``feedline``
command) adds where the setting comes from (flag, environment variable) and
prints it as one ``configuration error:`` line, exit code 2, no traceback.
It is a ``ValueError``, so code that caught ``ValueError`` still does.
"""

from __future__ import annotations


class SettingError(ValueError):
    """A setting with a value that cannot work; the message says which setting and what would work."""

    def __init__(self, setting: str, message: str):
        super().__init__(f"{setting}: {message}")
        self.setting = setting
        self.message = message
