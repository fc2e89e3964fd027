"""bench/tp_comm.py prints one JSON object whose measured bytes (gloo ranks on CPU)
equal the partition's formula, and whose computed shares follow S-LoRA's analysis:
LoRA traffic grows with the rank, the naive partition's with the output widths."""
from __future__ import annotations

from pathlib import Path

from tests.test_bench_scripts import run_json


def test_tp_comm_json(tmp_path: Path) -> None:
    report = run_json("tp_comm.py", ["--tp", "2", "4", "--ranks", "5", "64", "--measure-tp", "2"], tmp_path)
    assert report["benchmark"] == "tp_comm"
    rows = {(r["tp"], r["targets"], r["rank"]): r for r in report["computed"]}
    assert len(rows) == 2 * 3 * 2
    # q/v at rank 64: two x·A all-gathers of 64 values against two all-reduces of 4096, in float16
    assert rows[(2, "qv", 64)]["lora_slora_bytes"] == 2 * 64 * 2
    assert rows[(2, "qv", 64)]["base_bytes"] == 2 * 4096 * 2
    assert rows[(2, "qv", 64)]["naive_share"] == 1.0  # q and v outputs, 4096 each, gathered whole
    # rank 5 on 4 ranks: the five column-parallel modules gather ceil(5/4)*4 = 8, the two row-parallel reduce 5
    assert rows[(4, "all", 5)]["lora_slora_bytes"] == (5 * 8 + 2 * 5) * 2
    measured = report["measured"]["runs"]
    assert [m["rank"] for m in measured] == [5, 64]
    for m in measured:
        assert m["matches_formula"], m
        assert m["collectives_per_layer"] == {"lora": 4.0, "base": 2.0}  # q/k/v, o, gate/up, down
    assert report["goal"]["worst"]["rank"] == 64
