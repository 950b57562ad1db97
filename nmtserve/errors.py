"""The project's exception types. The CLI prints them as one line and exits 2; the server maps
them to gRPC status codes in one place (server/service.py: `_status_of`, and `_EARLY_FINISH` beside it)."""


class NmtserveError(Exception):
    """Base class: a problem the user can fix, described in one line."""


class CorpusError(NmtserveError):
    """A corpus file is missing or malformed (the message names the file and line)."""


class CheckpointError(NmtserveError):
    """A checkpoint is missing, corrupt or incompatible."""


class ConfigError(NmtserveError):
    """A configuration value is out of range or inconsistent."""


class BundleError(NmtserveError):
    """A bundle is missing, incomplete, modified or of another schema (the message names the file)."""
