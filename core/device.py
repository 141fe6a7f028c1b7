"""Where models run and in what precision: ``--device cpu|cuda[:n]`` and ``--dtype``.

One :class:`Placement` serves ``specops serve``, ``specops train`` and ``specops bootstrap``.
CPU float32 is the default and what CI tests.

- **serve**: the target runs on ``device`` in ``dtype``; drafts run on the same device in
  ``--draft-dtype``. The verifier's acceptance rules run on the CPU in float32 over the
  ``[k+1, vocab]`` logits of each step (a few hundred KB copied per step), so a request's
  seeded sampling draws the same numbers whatever the device, and greedy output is the
  target's on that device and dtype.
- **train**: the drafts (and, for student / mixed sampling, the target) are placed on
  ``device``; ``dtype`` is the precision the draft's weights train in.
- **bootstrap**: the draft's distillation and held-out evaluation run on ``device``, under
  autocast to ``dtype`` when it is not float32; the saved weights stay float32.

``float16`` is refused on a CPU: several CPU kernels lack it or run it far slower than
bfloat16, which is the CPU's half precision.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from specops.core.errors import ModelConfigError

if TYPE_CHECKING:  # torch is imported where a placement is used, not where flags are parsed
    import torch

DTYPES = ("float32", "bfloat16", "float16")
"""Precision names; ``torch.<name>`` is the dtype."""
DEVICE_PATTERN = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class Placement:
    """A device and a precision, validated where they are given."""

    device: str = "cpu"
    """``cpu``, ``cuda`` (the current GPU) or ``cuda:N``."""
    dtype: str = "float32"
    """``float32``, ``bfloat16`` or ``float16`` (GPU only)."""

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not DEVICE_PATTERN.match(self.device):
            raise ModelConfigError(f"--device {self.device!r} is not a device: say cpu, cuda or cuda:N")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"--dtype {self.dtype!r} is not a precision: choose one of {', '.join(DTYPES)}")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ModelConfigError(
                    f"--device {self.device}: no CUDA GPU is visible to this process (torch "
                    f"{torch.__version__}, CUDA build: {torch.version.cuda or 'no'}); use --device cpu"
                )
            index = int(self.device.split(":")[1]) if ":" in self.device else 0
            if index >= torch.cuda.device_count():
                raise ModelConfigError(f"--device {self.device}: only {torch.cuda.device_count()} GPU(s) visible")
        elif self.dtype == "float16":
            raise ModelConfigError("--dtype float16 needs a GPU: on a CPU use bfloat16 (or float32)")

    @property
    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def is_cpu(self) -> bool:
        return self.device == "cpu"


def add_arguments(parser: argparse.ArgumentParser, *, dtype_help: str) -> None:
    """``--device`` and ``--dtype`` with help that says what they change here."""
    parser.add_argument(
        "--device",
        default="cpu",
        metavar="cpu|cuda[:N]",
        help="where the models run: cpu (default), cuda (the current GPU) or cuda:N (GPU number N)",
    )
    parser.add_argument(
        "--dtype", default="float32", choices=tuple(DTYPES), help=dtype_help + " (default: %(default)s)"
    )
