"""Stage 2, scope: what trains, and what a run can skip recomputing. The block stack and the last-k-blocks scope
(`blocks`), layer selections by block and named group (`groups`), the scope of each phase (`phases`), the head's
initialisation (`head_init`), LoRA through peft (`lora`), and the caches of a frozen part's outputs: a linear probe's
features (`cached_head`), the states entering the first trained block (`prefix_cache`), both kept in memory or on
disk (`feature_store`). It needs nothing of privacy: the privacy stage and the trainer import it, never the reverse.
"""

from .blocks import Scope, block_stack_name, describe_trainable, find_block_stack, head_modules, select_scope
from .groups import select_groups
from .phases import phase_scopes

__all__ = ["Scope", "block_stack_name", "describe_trainable", "find_block_stack", "head_modules",
           "phase_scopes", "select_groups", "select_scope"]

