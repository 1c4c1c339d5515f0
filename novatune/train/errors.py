"""The trainer's user-facing errors, in a module of their own so every train module can raise them."""


class SetupError(RuntimeError):
    """A model/environment problem the user can fix; the message names the config key and the fix."""


class ConfigError(ValueError):
    """A bad config value; the message names the key and the fix."""

    def __init__(self, key: str, problem: str, fix: str = ""):
        self.key = key
        msg = f"config error at {key or '<root>'}: {problem}"
        if fix:
            msg += f"\n  fix: {fix}"
        super().__init__(msg)
