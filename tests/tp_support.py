"""Test support for tensor parallelism: a greedy generation loop over any model
forward (the single-device LlamaModel or one TpRank), and the body of a rank
process the tests spawn. Results leave rank 0 as a safetensors file, never pickled;
the spawn arguments are plain strings and ints (torch's own process start-up)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from loraplex.contracts.geometry import PageGeometry
from loraplex.gpu_engine.lora.peft_adapter import HostAdapter, load_peft_adapter
from loraplex.gpu_engine.lora.torch_backend import ResidentLora
from loraplex.gpu_engine.model.batch import ForwardBatch
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.model.weights import load_weights
from loraplex.gpu_engine.tp.whole_rows import whole_rows_batch

NUM_PAGES = 512


@dataclass(frozen=True)
class Case:
    """What every rank (and the single-device reference) runs: JSON, so it crosses as a string."""

    model_dir: str
    adapters: dict[str, str]  # name -> PEFT directory
    prompts: list[list[int]]
    names: list[str | None]  # adapter per row, None = base model
    new_tokens: int
    page_tokens: int = 8
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(self.__dict__)

    @classmethod
    def from_json(cls, text: str) -> Case:
        return cls(**json.loads(text))


def load_case_adapters(case: Case, cfg: ModelConfig) -> list[HostAdapter]:
    return [load_peft_adapter(name, path, cfg, max_lora_rank=128, dtype=torch.float32)
            for name, path in case.adapters.items()]


def greedy_run(case: Case, geometry: PageGeometry, adapters: list[HostAdapter],
               place: Callable[[HostAdapter, list[int]], ResidentLora], layout_pages: Callable[[HostAdapter], int],
               forward: Callable[[ForwardBatch], torch.Tensor | None],
               share: Callable[[torch.Tensor], torch.Tensor]) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Prefill every row in one step, then decode `new_tokens - 1` steps; greedy on the logits the forward
    returns (rank 0's), tokens shared by `share` (a broadcast under TP). Pages are handed out in the
    same order everywhere. Returns (logits [steps, rows, vocab] or None, tokens [rows, new_tokens])."""
    with torch.inference_mode():
        return _greedy(case, geometry, adapters, place, layout_pages, forward, share)


def _greedy(case, geometry, adapters, place, layout_pages, forward, share):
    next_page = 0
    resident: dict[str, ResidentLora] = {}
    for adapter in adapters:
        n = layout_pages(adapter)
        resident[adapter.name] = place(adapter, list(range(next_page, next_page + n)))
        next_page += n
    kv_pages = []
    for prompt in case.prompts:
        n = geometry.kv_pages_for(len(prompt) + case.new_tokens)
        kv_pages.append(list(range(next_page, next_page + n)))
        next_page += n
    if next_page > NUM_PAGES:
        raise ValueError(f"case needs {next_page} pages, the pool has {NUM_PAGES}")
    loras = [None if name is None else resident[name] for name in case.names]
    step_rows = [(p, 0, pages, lora) for p, pages, lora in zip(case.prompts, kv_pages, loras)]
    positions = [len(p) for p in case.prompts]
    all_logits, all_tokens = [], []
    for _ in range(case.new_tokens):
        logits = forward(whole_rows_batch(step_rows, geometry))
        tokens = torch.zeros(len(step_rows), dtype=torch.int64)
        if logits is not None:
            all_logits.append(logits)
            tokens = logits.argmax(dim=-1)
        tokens = share(tokens)
        all_tokens.append(tokens)
        step_rows = [([int(t)], pos, pages, lora) for t, pos, pages, lora in zip(tokens, positions, kv_pages, loras)]
        positions = [p + 1 for p in positions]
    logits = torch.stack(all_logits) if all_logits else None
    return logits, torch.stack(all_tokens, dim=1)


def rank_main(rank: int, world_size: int, port: int, case_json: str, out_dir: str) -> None:
    """Body of one spawned rank: join the gloo group, shard the model and the adapters, run the case;
    rank 0 writes logits, tokens and its ledger of collective bytes to out_dir/result.safetensors."""
    from loraplex.gpu_engine.tp.comm import TpComm
    from loraplex.gpu_engine.tp.rank import TpRank

    torch.set_num_threads(1)
    case = Case.from_json(case_json)
    comm = TpComm.init(rank, world_size, port)
    try:
        cfg = ModelConfig.from_dir(case.model_dir)
        weights = load_weights(case.model_dir, cfg, device=torch.device("cpu"), dtype=torch.float32)
        tp = TpRank(cfg, weights, comm, NUM_PAGES, page_tokens=case.page_tokens)
        adapters = load_case_adapters(case, cfg)
        comm.ledger.clear()
        logits, tokens = greedy_run(case, tp.geometry, adapters, tp.place, lambda a: tp.layout(a).num_pages,
                                    tp.forward, lambda t: comm.broadcast(t, "tokens"))
        if rank == 0:
            ledger = {f"bytes.{k}": torch.tensor(v) for k, v in comm.ledger.bytes.items()}
            save_file({"logits": logits.contiguous(), "tokens": tokens, **ledger},
                      str(Path(out_dir) / "result.safetensors"))
    finally:
        comm.close()


def spawn_ranks(world_size: int, case: Case, out_dir: Path) -> dict[str, torch.Tensor]:
    """Run the case on `world_size` gloo ranks; rank 0's result."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from loraplex.gpu_engine.tp.comm import free_port

    mp.spawn(rank_main, args=(world_size, free_port(), case.to_json(), str(out_dir)), nprocs=world_size, join=True)
    return load_file(str(out_dir / "result.safetensors"))


def single_device_run(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The same case on the unsplit engine path: LlamaModel, its pool and plan_adapter_layout."""
    from loraplex.contracts.geometry import plan_adapter_layout
    from loraplex.gpu_engine.lora.backend import make_lora_backend
    from loraplex.gpu_engine.lora.torch_backend import place_adapter
    from loraplex.gpu_engine.model.llama import LlamaModel
    from loraplex.gpu_engine.pool import UnifiedPool

    cfg = ModelConfig.from_dir(case.model_dir)
    weights = load_weights(case.model_dir, cfg, device=torch.device("cpu"), dtype=torch.float32)
    geometry = PageGeometry.for_model(cfg.module_shapes(), cfg.kv_dim, case.page_tokens)
    pool = UnifiedPool(cfg.num_layers, NUM_PAGES, geometry, device=torch.device("cpu"), dtype=torch.float32)
    model = LlamaModel(cfg, weights, make_lora_backend("torch"))

    def layout(a: HostAdapter):
        return plan_adapter_layout(geometry, cfg.module_shapes(), a.spec.targets, a.spec.rank)

    return greedy_run(case, geometry, load_case_adapters(case, cfg),
                      lambda a, pages: place_adapter(pool, a, layout(a), pages), lambda a: layout(a).num_pages,
                      lambda b: model.forward(b, pool), lambda t: t)
