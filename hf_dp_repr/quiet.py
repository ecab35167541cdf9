"""Warnings that ask for no action, silenced narrowly: each by its message (and category), never a whole module or
category, so every other warning, and these same words from elsewhere with another meaning, still shows.

- torch: "Full backward hook is firing when gradients are computed with respect to module outputs since no inputs
  require gradients". Opacus computes per-example gradients from each module's *output* gradient and activations;
  a module whose inputs need no gradient (the first trainable block after frozen layers, pixel inputs) makes torch
  say its input gradient is None, which Opacus never reads (the brute-force tests check the gradients).
- torch: "'pin_memory' argument is set as true but no accelerator is found": on a CPU-only machine the Trainer's
  default `dataloader_pin_memory=True` is a no-op.
- Opacus, inside `privacy.accountants` (its calls to Opacus' accountants) only: "Optimal order is the largest
  alpha. Please consider expanding the range of alphas". The PRV accountant uses RDP only to bound its integration
  domain (the ε it reports is the PRV one); under accountant="rdp" the orders are Opacus' own, which no argument
  here changes, and the ε reported is still an upper bound (the default "prv" is tighter).
- transformers 5: "`is_gradient_checkpointing` is deprecated": avoided at the source (`privacy.ghost_clipping`
  reads the new name); PEFT's PeftModel still reads the old one, so `scope.lora` filters it around its
  `get_peft_model` call only.

    >>> import warnings
    >>> silence_known_noise()
    >>> with warnings.catch_warnings(record=True) as seen:
    ...     warnings.simplefilter("default")
    ...     silence_known_noise()
    ...     warnings.warn(FULL_BACKWARD_HOOK + " (see docs)", UserWarning)
    ...     warnings.warn("something that asks for action", UserWarning)
    >>> [str(w.message) for w in seen]
    ['something that asks for action']
"""

from __future__ import annotations

import warnings

FULL_BACKWARD_HOOK = ("Full backward hook is firing when gradients are computed with respect to module outputs since "
                      "no inputs require gradients")
PIN_MEMORY_ON_CPU = "'pin_memory' argument is set as true but no accelerator is found"
RDP_LARGEST_ALPHA = "Optimal order is the largest alpha"


def silence_known_noise() -> None:
    """Install the message filters of this module's docstring (idempotent: `warnings` drops duplicate filters)."""
    for message in (FULL_BACKWARD_HOOK, PIN_MEMORY_ON_CPU):
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
