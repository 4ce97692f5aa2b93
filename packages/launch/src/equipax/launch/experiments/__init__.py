"""Built-in experiments; every module here is imported by the registry."""

__all__: list[str] = []
