"""Files shipped inside the package (package data): the drafters under `drafters/`.

`drafters/smollm2-135m-instruct/`: the DSpark drafter trained by `specserve train-drafter` for the embedded
default model (see its README.md model card). It makes DSPARK the default for that model.
"""

from __future__ import annotations

import os
from typing import Optional

EMBEDDED_MODEL_DRAFTER = "smollm2-135m-instruct"


def default_drafter_path() -> Optional[str]:
    """The shipped drafter for the embedded model, or None if this install has none."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters", EMBEDDED_MODEL_DRAFTER)
    return path if os.path.isfile(os.path.join(path, "config.json")) else None
