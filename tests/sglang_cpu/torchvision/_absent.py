"""Names for ``from torchvision... import X`` at start-up; calling any of them raises."""


def absent(module: str, name: str):
    if name.startswith("__"):
        raise AttributeError(name)

    def unavailable(*args, **kwargs):
        raise RuntimeError(f"{module}.{name}: the CPU stand-in for torchvision has no image functions")

    unavailable.__name__ = name
    unavailable.__qualname__ = f"{module}.{name}"
    return unavailable
