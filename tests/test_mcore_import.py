"""Rank and Ray actor processes import megatron.core without wandb (about 1 s of CPU each)."""

import subprocess
import sys

PROBE = """
import sys
import megatron_dapo.actor.mcore_import
import megatron.core.timers as timers
import megatron.core.inference.contexts.dynamic_context as dc
print(timers.wandb is None, dc.HAVE_WANDB, "wandb" in sys.modules)
import wandb  # still importable for driver/run_dir.py's own metrics
print(wandb.__name__, sys.modules["wandb"] is wandb)
"""


def test_megatron_loads_without_wandb_and_wandb_stays_importable():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["True False False", "wandb True"]


def test_a_process_that_imported_wandb_keeps_it():
    probe = "import wandb\n" + PROBE.replace("True False False", "")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False True True", "wandb True"]


EAGER_PROBE = """
import sys, torch
compile_ = torch.compile
import megatron_dapo.actor.mcore_import
from megatron.core import activations, jit
x = torch.linspace(-3, 3, 7, dtype=torch.float64)
print("torch._inductor" in sys.modules, torch.compile is compile_, jit.jit_fuser is jit.noop_decorator)
print(torch.equal(activations.quick_gelu(x), x * torch.sigmoid(1.702 * x)))
"""


def test_on_cpu_megatron_loads_without_the_compiler_and_its_fusions_run_eager():
    """The CPU path never runs megatron's torch.compile'd fusions, so it does not load torch's
    compiler for them; torch.compile is torch's again afterwards, and a fused function (defined
    at import with megatron's jit_fuser) computes the plain formula."""
    out = subprocess.run([sys.executable, "-c", EAGER_PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["False True True", "True"]
