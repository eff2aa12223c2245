"""The one exception type for bad user input; the CLI prints it as one line and exits 2."""


class UsageError(Exception):
    """Bad input a user can fix: the message names the file/key/value and what to do."""
