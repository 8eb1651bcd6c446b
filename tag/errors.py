"""Error types. Every user-facing failure is a :class:`TagError` whose message is ONE line
naming the file / field / value at fault and what was expected; the CLI prints it and exits 2."""


class TagError(Exception):
    """Base class for errors caused by user input (files, arguments, models, plans)."""


class TopologyError(TagError):
    """A topology file or value is malformed."""


class WorkloadError(TagError):
    """A model name, factory or model could not be loaded or captured."""


class PlanError(TagError):
    """A plan is malformed or does not fit the graph / topology."""


class OutOfMemoryError(TagError):
    """A plan does not fit the devices' memory."""


class Interrupted(KeyboardInterrupt):
    """A command stopped by Ctrl-C or SIGTERM; its message (one line) says what was kept, e.g. the
    run folder of ``tag execute``. The CLI prints it and exits 130."""
