"""User-facing errors.

Anything a user can cause (a bad path, an impossible sampling parameter, a prompt that does not fit)
raises a :class:`VerispecError` whose message says what was wrong and what to do. The CLI prints the
message on one line and exits with status 2; the server turns it into an HTTP 400.
"""


class VerispecError(Exception):
    """An error caused by the user's input, with a message meant for that user."""


class CheckpointError(VerispecError):
    """A checkpoint directory is missing, malformed or of an unsupported architecture."""


class SamplingError(VerispecError):
    """Sampling parameters are outside their valid ranges."""


class ContextError(VerispecError):
    """A prompt (plus the requested output) does not fit in the model's context."""
