"""Tensor parallelism on CPU: N gloo rank processes running the engine's own orders
(tests/tp_engine_support.py) give the greedy tokens and logprobs of the one-device engine (fp32
tolerance) and the greedy tokens of transformers + PEFT, for mixed batches of base rows and adapters
with odd ranks, rsLoRA, MLP targets and GQA; every rank holds 1/N of each adapter in a layout that
is the same on every rank; models that cannot be split N ways are refused; a rank reads only its
slice of each checkpoint tensor, with the whole read's checks."""
from __future__ import annotations

import pytest
import torch

from loraplex.contracts.tensor_parallel import COLUMN_PARALLEL, TensorParallelPlan
from loraplex.gpu_engine.demo import demo_model_config, write_random_adapter
from loraplex.gpu_engine.lora.peft_adapter import load_peft_adapter
from loraplex.gpu_engine.lora.torch_backend import place_adapter
from loraplex.gpu_engine.model.config import ModelConfig
from loraplex.gpu_engine.pool import UnifiedPool
from loraplex.gpu_engine.tp.partition import shard_adapter
from tests.tolerances import assert_within, forward_tolerance, reduction_bound
from tests.tp_engine_support import EngineCase, collectives, single_device, spawn_engine

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Odd ranks (padded to a multiple of N on the column-parallel side), rsLoRA, MLP-only targets.
ODD = {"odd-r5": (5, ALL, False), "odd-r7-rs": (7, ["q_proj", "v_proj", "o_proj", "down_proj"], True),
       "odd-r3-mlp": (3, ["gate_proj", "up_proj", "down_proj"], False)}


@pytest.fixture(scope="module")
def adapters(demo, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-adapters")
    out = {name: str(path) for name, path in demo.adapters.items()}
    for i, (name, (rank, targets, rs)) in enumerate(ODD.items()):
        write_random_adapter(root / name, demo_model_config(), rank=rank, alpha=1.5 * rank, target_modules=targets,
                             seed=300 + i, use_rslora=rs)
        out[name] = str(root / name)
    return out


def _case(demo, adapters, names, new_tokens, seed=0) -> EngineCase:
    g = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(5, 40, (len(names),), generator=g)]
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]
    return EngineCase(model_dir=str(demo.model_dir), adapters={n: adapters[n] for n in names if n},
                      prompts=prompts, names=names, new_tokens=new_tokens, page_tokens=8)


def _spawn(world_size: int, case: EngineCase, out_dir):
    [result] = spawn_engine(world_size, [case], out_dir)
    return result


def _compare(result, reference, case: EngineCase):
    (tokens, logprobs), (ref_tokens, ref_logprobs) = result, reference
    assert torch.equal(tokens, ref_tokens)
    worst = (logprobs - ref_logprobs).abs().max().item()
    tol = forward_tolerance(ModelConfig.from_dir(case.model_dir))
    assert worst < tol, f"logprobs differ by {worst} over {tol:.2g}"


MIXED = [None, "odd-r5", "qv-r8", "odd-r5", "all-r32", None, "mlp-r64", "odd-r7-rs", "rslora-r16", "odd-r3-mlp",
         "kdown-r8", "attn-r16"]


def test_tp2_equals_single_device_and_peft(demo, adapters, tmp_path):
    from tests.hf_reference import greedy

    case = _case(demo, adapters, MIXED, new_tokens=4)
    result = _spawn(2, case, tmp_path)
    _compare(result, single_device(case), case)
    for row in (0, 1, 7, 9):  # base, odd rank with every target, odd rank with rsLoRA, MLP only
        name = case.names[row]
        ref_tokens, _ = greedy(demo.model_dir, None if name is None else adapters[name], case.prompts[row],
                               case.new_tokens)
        assert result[0][row].tolist() == ref_tokens, f"row {row} ({name})"


def test_tp4_equals_single_device(demo, adapters, tmp_path):
    # the demo's 4 KV heads: one per rank
    case = _case(demo, adapters, MIXED[:8], new_tokens=2, seed=1)
    _compare(_spawn(4, case, tmp_path), single_device(case), case)


def test_collective_bytes_match_the_plan(demo, adapters, tmp_path):
    """One adapter with every target: what the collectives carried equals the plan's per-token figures."""
    case = _case(demo, adapters, ["odd-r5", "odd-r5"], new_tokens=2, seed=2)
    _spawn(2, case, tmp_path)
    carried = collectives(tmp_path, 0)
    cfg = ModelConfig.from_dir(demo.model_dir)
    plan = TensorParallelPlan.for_model(cfg, 2)
    tokens = sum(len(p) for p in case.prompts) + len(case.prompts)  # prefill, then one decode token per row
    samples = 2 * len(case.prompts)
    per_layer_lora = sum(plan.lora_comm(m, 5) for m in ALL)
    assert carried["lora"] == 4 * tokens * cfg.num_layers * per_layer_lora
    assert carried["base"] == 4 * tokens * cfg.num_layers * plan.base_comm_per_layer()
    assert carried["embed"] == 4 * tokens * plan.base_comm_per_model()["embed"]
    assert carried["lm_head"] == 4 * samples * plan.base_comm_per_model()["lm_head"]


def _demo_plan(n: int) -> TensorParallelPlan:
    return TensorParallelPlan.for_model(ModelConfig.from_hf(demo_model_config()), n)


@pytest.mark.parametrize("n", [2, 4])
def test_each_rank_holds_a_1_over_n_shard_in_a_rank_independent_layout(demo, n):
    cfg = ModelConfig.from_dir(demo.model_dir)
    plan = TensorParallelPlan.for_model(cfg, n)
    geometry = plan.geometry(8)
    adapter = load_peft_adapter("all-r32", demo.adapters["all-r32"], cfg, max_lora_rank=64, dtype=torch.float32)
    layout = plan.adapter_layout(geometry, adapter.spec.targets, adapter.spec.rank)
    pages = [5 + 3 * i for i in range(layout.num_pages)]  # scattered, the same indices on every rank
    gathered_a: dict[str, list[torch.Tensor]] = {m: [] for m in ALL}
    gathered_b: dict[str, list[torch.Tensor]] = {m: [] for m in ALL}
    for rank in range(n):
        shard = shard_adapter(adapter, plan, rank)
        for m in ALL:  # 1/N of each matrix (r = 32 needs no padding), never the whole
            assert shard.a[0][m].numel() * n == adapter.a[0][m].numel()
            assert shard.b[0][m].numel() * n == adapter.b[0][m].numel()
        pool = UnifiedPool(cfg.num_layers, 5 + 3 * layout.num_pages, geometry, device=torch.device("cpu"),
                           dtype=torch.float32)
        resident = place_adapter(pool, shard, layout, pages)
        flat = pool.layer_flat(2)
        for m, (ia, ib) in resident.index.items():
            gathered_a[m].append(flat[ia])
            gathered_b[m].append(flat[ib].t())
    for m in ALL:  # the shards read back from every rank's pages rebuild A and B
        a_dim = 0 if m in COLUMN_PARALLEL else 1
        assert torch.equal(torch.cat(gathered_a[m], dim=a_dim), adapter.a[2][m])
        assert torch.equal(torch.cat(gathered_b[m], dim=0), adapter.b[2][m])


def test_odd_rank_pads_only_the_column_parallel_side():
    plan = _demo_plan(4)
    assert plan.lora_rows("q_proj", 5) == (2, 256, 8, 64)  # A: ceil(5/4) rows of hidden; B^T: 8 rows of q/N
    assert plan.lora_rows("down_proj", 5) == (5, 704 // 4, 5, 64)
    a = torch.randn(5, 256)
    b = torch.randn(256, 5)
    from loraplex.gpu_engine.tp.partition import shard_lora

    shards = [shard_lora("q_proj", a, b, plan, r) for r in range(4)]
    rebuilt = torch.cat([s[1] for s in shards], dim=0) @ torch.cat([s[0] for s in shards], dim=0)
    # both sum products over the rank (zero padding adds exactly) in float32
    assert_within(rebuilt, b @ a, reduction_bound(b.abs() @ a.abs(), 8, torch.float32, computations=2))


def test_layouts_agree_between_ranks_and_the_daemon_side():
    """Nothing in the layout depends on the rank: two plans built independently (a rank and the
    torch-free daemon) give equal layouts, page tokens and KV widths."""
    one, other = _demo_plan(2), _demo_plan(2)
    g1, g2 = one.geometry(8), other.geometry(8)
    assert g1 == g2 and g1.kv_dim == 64 and g1.page_tokens == 8
    for rank in (3, 8, 64):
        assert one.adapter_layout(g1, ALL, rank) == other.adapter_layout(g2, ALL, rank)


@pytest.mark.parametrize("overrides, n, what", [
    (dict(num_attention_heads=8, num_key_value_heads=4), 8, "key/value heads"),
    (dict(num_attention_heads=6, num_key_value_heads=6, head_dim=32), 4, "attention heads"),
    (dict(intermediate_size=702), 4, "intermediate_size"),
    (dict(hidden_size=254), 4, "hidden_size"),
])
def test_models_that_cannot_split_are_refused(overrides, n, what):
    cfg = ModelConfig.from_hf({**demo_model_config(), **overrides})
    with pytest.raises(ValueError, match=what):
        TensorParallelPlan.for_model(cfg, n)
    with pytest.raises(ValueError, match="positive"):
        TensorParallelPlan.for_model(cfg, 0)


def test_tp2_biases_tied_embeddings_and_a_vocabulary_that_does_not_split(tmp_path):
    """q/k/v/o/MLP biases (column biases sliced, row biases added once after the all-reduce), an LM head
    tied to the embedding, and 509 tokens padded to 510 across two ranks."""
    from loraplex.gpu_engine.demo import llama_config, write_random_checkpoint

    config = llama_config(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, vocab_size=509)
    write_random_checkpoint(tmp_path / "model", config, seed=11)
    write_random_adapter(tmp_path / "a", config, rank=3, alpha=6.0, target_modules=ALL, seed=12)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 509, (n,), generator=g).tolist() for n in (9, 30, 17)]
    case = EngineCase(model_dir=str(tmp_path / "model"), adapters={"a": str(tmp_path / "a")}, prompts=prompts,
                      names=["a", None, "a"], new_tokens=3, page_tokens=8)
    out = tmp_path / "out"
    out.mkdir()
    _compare(_spawn(2, case, out), single_device(case), case)


class _SpyFile:
    """safe_open's file, recording the elements every get_slice read hands out; get_tensor is refused."""

    def __init__(self, inner, read: dict[str, int]) -> None:
        self.inner, self.read = inner, read

    def keys(self):
        return self.inner.keys()

    def get_tensor(self, key: str):
        raise AssertionError(f"{key} read whole")

    def get_slice(self, key: str):
        spy, part = self, self.inner.get_slice(key)

        class Slice:
            def get_shape(self):
                return part.get_shape()

            def __getitem__(self, index):
                out = part[index]
                spy.read[key] = spy.read.get(key, 0) + out.numel()
                return out

        return Slice()


def test_each_rank_reads_only_its_shard_of_the_checkpoint(tmp_path, monkeypatch):
    """Biases, an untied LM head and 509 tokens over 2 ranks, in a checkpoint of two files: a rank's
    sliced read equals slicing the whole model, tensor by tensor, and never reads a tensor whole."""
    from contextlib import contextmanager

    from safetensors import safe_open

    from loraplex.gpu_engine.demo import llama_config, write_random_checkpoint
    from loraplex.gpu_engine.model import weights as weights_module
    from loraplex.gpu_engine.model.weights import expected_shapes, load_weights
    from loraplex.gpu_engine.tp.partition import rank_selector, shard_weights

    write_random_checkpoint(tmp_path, llama_config(attention_bias=True, mlp_bias=True, vocab_size=509), seed=21,
                            num_shards=2)
    cfg = ModelConfig.from_dir(tmp_path)
    assert cfg.qkv_bias and cfg.o_bias and cfg.mlp_bias and not cfg.tie_word_embeddings
    cpu, plan = torch.device("cpu"), TensorParallelPlan.for_model(cfg, 2)
    whole = load_weights(tmp_path, cfg, device=cpu, dtype=torch.float32)
    read: dict[str, int] = {}

    @contextmanager
    def spy_open(*args, **kwargs):
        with safe_open(*args, **kwargs) as f:
            yield _SpyFile(f, read)

    monkeypatch.setattr(weights_module, "safe_open", spy_open)
    for rank in range(2):
        read.clear()
        got = load_weights(tmp_path, cfg, device=cpu, dtype=torch.float32, select=rank_selector(plan, rank))
        want = shard_weights(whole, plan, rank)
        assert got.embed.shape == (255, cfg.hidden_size) and torch.equal(got.embed, want.embed)
        assert torch.equal(got.lm_head, want.lm_head) and torch.equal(got.norm, want.norm)
        for lg, lw in zip(got.layers, want.layers, strict=True):
            assert torch.equal(lg.input_norm, lw.input_norm) and torch.equal(lg.post_norm, lw.post_norm)
            for kind, got_t, want_t in (("proj", lg.proj, lw.proj), ("bias", lg.bias, lw.bias)):
                assert got_t.keys() == want_t.keys() == set(ALL), kind
                for m in ALL:
                    assert got_t[m].shape == want_t[m].shape and torch.equal(got_t[m], want_t[m]), (kind, m)
        for key, shape in expected_shapes(cfg).items():  # every projection: exactly half of it left the file
            if key.endswith(".weight") and key.split(".")[-2] in ALL:
                assert read[key] * 2 == shape[0] * shape[1], key
        assert read["lm_head.weight"] == min(255, 509 - 255 * rank) * cfg.hidden_size  # rank 1: 254 rows


@pytest.mark.parametrize("edit, error", [
    ("extra", "unexpected tensor 'model.layers.0.mlp.extra.weight'"),
    ("shape", r"q_proj.weight has shape \(63, 64\), expected \(64, 64\)"),
    ("missing", "missing 1 tensors"),
    ("ignored", None),
])
def test_the_sliced_read_checks_the_checkpoint_as_the_whole_read_does(tmp_path, edit, error):
    """Unknown tensors, wrong full shapes and missing tensors are refused on both paths alike; rotary
    inverse frequencies and the LM head of a tied model are skipped."""
    from safetensors.torch import load_file, save_file

    from loraplex.gpu_engine.demo import llama_config, write_random_checkpoint
    from loraplex.gpu_engine.model.config import UnsupportedModelError
    from loraplex.gpu_engine.model.weights import load_weights
    from loraplex.gpu_engine.tp.partition import rank_selector

    write_random_checkpoint(tmp_path, llama_config(tie_word_embeddings=True), seed=23)
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    q = "model.layers.0.self_attn.q_proj.weight"
    if edit == "extra":
        tensors["model.layers.0.mlp.extra.weight"] = torch.randn(3)
    elif edit == "shape":
        tensors[q] = tensors[q][:63]
    elif edit == "missing":
        del tensors[q]
    else:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(16)
        tensors["lm_head.weight"] = torch.randn_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, file)
    cfg = ModelConfig.from_dir(tmp_path)
    cpu = torch.device("cpu")
    for select in (None, rank_selector(TensorParallelPlan.for_model(cfg, 2), 1)):
        if error is None:
            weights = load_weights(tmp_path, cfg, device=cpu, dtype=torch.float32, select=select)
            assert weights.lm_head is weights.embed
        else:
            with pytest.raises(UnsupportedModelError, match=error):
                load_weights(tmp_path, cfg, device=cpu, dtype=torch.float32, select=select)


def _differ(got, want) -> list[str]:
    """Names of the tensors where two ModelWeights differ (shape or value)."""
    def same(a, b) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and a.shape == b.shape
                                             and torch.equal(a, b))

    diff = [top for top in ("embed", "lm_head", "norm", "norm_bias", "lm_head_bias")
            if not same(getattr(got, top), getattr(want, top))]
    for i, (lg, lw) in enumerate(zip(got.layers, want.layers, strict=True)):
        for kind in ("proj", "bias", "norms", "norm_bias"):
            a, b = getattr(lg, kind), getattr(lw, kind)
            diff += [f"layer {i} {kind} {m}" for m in a.keys() | b.keys() if not same(a.get(m), b.get(m))]
        diff += [f"layer {i} {n}" for n in ("input_norm", "post_norm") if not same(getattr(lg, n), getattr(lw, n))]
    return diff


@pytest.mark.parametrize("family", ["phi", "phi3", "qwen3", "gemma", "gemma2", "gemma3_text"])
def test_every_family_reads_its_checkpoint_sliced_as_slicing_the_whole(tmp_path, family):
    """The sliced read names each checkpoint tensor by the engine's module (Phi's `dense`, `fc1`, `fc2`,
    `final_layernorm` are o_proj, up_proj, down_proj, the final norm), so each rank reads the slice that
    slicing the whole model gives (a served Phi engine of 2 ranks once failed its first step on an
    o_proj read whole)."""
    from loraplex.gpu_engine.demo import write_random_checkpoint
    from loraplex.gpu_engine.model.weights import load_weights
    from loraplex.gpu_engine.tp.partition import rank_selector, shard_weights

    write_random_checkpoint(tmp_path, demo_model_config(family), seed=5)
    cfg = ModelConfig.from_dir(tmp_path)
    cpu, plan = torch.device("cpu"), TensorParallelPlan.for_model(cfg, 2)
    whole = load_weights(tmp_path, cfg, device=cpu, dtype=torch.float32)
    for rank in range(2):
        got = load_weights(tmp_path, cfg, device=cpu, dtype=torch.float32, select=rank_selector(plan, rank))
        differ = _differ(got, shard_weights(whole, plan, rank))
        assert not differ, f"rank {rank}: {differ[:6]}"
