"""The framework's configuration error, in a module of its own so that config.py and the modules it
calls (parallel.py) both import it without importing each other."""


class ConfigError(ValueError):
    """A configuration that cannot run; reported as one line, before any run starts (exit code 2)."""
