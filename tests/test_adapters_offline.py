"""The offline adapter listing reports the rank the engine serves an adapter at: the largest of
`r` and its rank_pattern's ranks (lower-rank modules are padded to it), or none when unreadable."""
from __future__ import annotations

import json
import random
from pathlib import Path

from loraplex.adapters_offline import adapter_rank


def _adapter(root: Path, config: dict) -> Path:
    root.mkdir(parents=True)
    (root / "adapter_config.json").write_text(json.dumps(config))
    return root


def test_the_rank_is_the_largest_the_pattern_names(tmp_path: Path) -> None:
    r = random.randint(2, 32)
    assert adapter_rank(_adapter(tmp_path / "plain", {"r": r})) == r
    wide = r + random.randint(1, 64)
    patterned = {"r": r, "rank_pattern": {"q_proj": wide, "down_proj": max(1, r - 1)}}
    assert adapter_rank(_adapter(tmp_path / "pattern", patterned)) == wide
    assert adapter_rank(_adapter(tmp_path / "bad", {"r": r, "rank_pattern": {"q_proj": "8"}})) is None
    assert adapter_rank(_adapter(tmp_path / "none", {"lora_alpha": 8})) is None
    assert adapter_rank(tmp_path / "missing") is None
