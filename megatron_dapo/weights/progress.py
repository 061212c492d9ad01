"""Progress bars for conversions of large models (rich, rank 0 only)."""

from __future__ import annotations


class progress_bar:
    """A rich progress bar on global rank 0 when enabled; a no-op counter otherwise."""

    def __init__(self, enabled: bool, total: int, description: str) -> None:
        import torch.distributed as dist

        self.enabled = enabled and (not dist.is_initialized() or dist.get_rank() == 0)
        self.total, self.description = total, description

    def __enter__(self):
        if not self.enabled:
            return lambda n=1: None
        from rich.progress import Progress

        self._bar = Progress(transient=False)
        self._bar.start()
        task = self._bar.add_task(self.description, total=self.total)
        return lambda n=1: self._bar.advance(task, n)

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._bar.stop()
