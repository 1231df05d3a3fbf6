"""Errors the executor raises while loading a model."""


class ModelLoadError(Exception):
    """A model could not be loaded; the message names the file and what was expected."""
