"""Stage 4, hub: what a run publishes, and the checks that guard it. The DP model card (`card`: rendered from the
one template, model_cards/dp_model_card.md, shipped here as `templates/`; its values in `card_values`), the names a
card may carry (`public_names`: no local path), and the pushes (`push`: an allow-list of a run folder's files,
Hub access checked before any work). It sits below training, not after it: the trainer writes the card next to
every model it saves and pushes checkpoints during training, so the training stage imports this one; hub itself
needs only privacy (the ledger, the accountant, the unit) and nothing above it.
"""

from .card import ModelCardInfo, format_epsilon, refresh_model_card, render_model_card, template_path, write_model_card
from .push import (
                   check_hub_access,
                   check_pushable,
                   create_repo,
                   explained_hub_errors,
                   files_to_push,
                   is_private_metric,
                   public_metrics,
                   push_dp_model,
                   push_run_folder,
                   save_public_metrics,
                   upload_run,
)

__all__ = ["ModelCardInfo", "check_hub_access", "check_pushable", "create_repo",
           "explained_hub_errors", "files_to_push", "format_epsilon", "is_private_metric", "public_metrics",
           "push_dp_model", "push_run_folder", "refresh_model_card", "render_model_card", "save_public_metrics",
           "template_path", "upload_run", "write_model_card"]

