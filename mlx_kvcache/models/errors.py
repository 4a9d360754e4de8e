"""The one error every model-loading path raises."""


class ModelLoadError(ValueError):
    """A model file or spec could not be loaded; the message says why."""
