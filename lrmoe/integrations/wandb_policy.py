"""How a run meets W&B: its mode (the user's ``WANDB_MODE``, online with an API key, else offline) and its
project and group (the command line's flags, then the environment's ``WANDB_PROJECT`` / ``WANDB_RUN_GROUP``, then
the script's own choice). The job type is always the script's name (:class:`lrmoe.integrations.tracking.Tracker`).
Nothing here imports W&B."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_PROJECT = "lrmoe"


def wandb_mode() -> tuple[str, str]:
    """The W&B mode to use and why: the user's ``WANDB_MODE``, online with an API key, else offline."""
    explicit = os.environ.get("WANDB_MODE")
    if explicit:
        return explicit, "WANDB_MODE is set"
    login = wandb_login()
    if login:
        return "online", login
    return "offline", "no W&B login was found"


def wandb_login() -> str | None:
    """Where this process's W&B API key comes from (None: it has none)."""
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY is set"
    netrc = Path.home() / ".netrc"
    if netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore"):
        return "a W&B login was found in ~/.netrc"
    return None


def wandb_names(config: dict, project: str | None = None, group: str | None = None) -> tuple[str, str | None]:
    """The W&B project and group of a run: the command line's --wandb-project / --wandb-group (in ``config``), then
    the environment's WANDB_PROJECT / WANDB_RUN_GROUP, then the script's own ``project`` / ``group``, then
    :data:`DEFAULT_PROJECT` and no group. The job type is always the script's name."""
    project = config.get("wandb_project") or os.environ.get("WANDB_PROJECT") or project or DEFAULT_PROJECT
    group = config.get("wandb_group") or os.environ.get("WANDB_RUN_GROUP") or group
    return project, group
