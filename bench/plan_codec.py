"""Encode + decode of one engine step plan, the daemon -> engine message of every step:
the project's msgpack codec (typed dataclasses, checked field by field) against msgspec
Structs of the same shape (msgspec.msgpack, typed decode, unknown fields refused).

The plan is `--rows` rows (256 by default): decode rows of one token plus `--prefill-rows`
prefill chunks of `--chunk` tokens, each with its whole page table (`--context` tokens on
average, uniform in [context/4, 2*context - context/4], `--page-tokens` per page, page ids
spread over `--num-pages`), an adapter out of `--adapters`, its own sampling seed, and a few
adapter placements. Both sides encode the same values; msgspec is timed from its own
Structs, as the daemon would build them if it adopted msgspec. Needs msgspec installed for
its half (`pip install msgspec`); without it only the current codec is measured.
`--json` prints one JSON object on stdout; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Any, Callable

from loraplex.ipc.codec import DecodeLimits, decode, encode
from loraplex.ipc.engine_plan import AdapterPlacement, RowPlan, SamplingSpec, StepPlan
from loraplex.ipc.protocol import PROTOCOL_VERSION, EngineStep

try:
    import msgspec
except ImportError:  # the comparison's other half is optional
    msgspec = None


def _log(msg: str) -> None:
    print(f"[plan_codec] {msg}", file=sys.stderr, flush=True)


def build_plan(rows: int, prefill_rows: int, chunk: int, context: int, page_tokens: int, num_pages: int,
               adapters: int, seed: int) -> StepPlan:
    rng = random.Random(seed)
    names = [f"adapter-{i:04d}" for i in range(adapters)]
    out = []
    for i in range(rows):
        length = rng.randint(max(1, context // 4), 2 * context - context // 4)
        prefill = i < prefill_rows
        tokens = [rng.randrange(32_000) for _ in range(chunk if prefill else 1)]
        start = length - len(tokens)
        pages = rng.sample(range(num_pages), -(-length // page_tokens))
        out.append(RowPlan(
            request_id=f"lpx-{rng.getrandbits(128):032x}", token_ids=tokens, start_pos=max(0, start), kv_pages=pages,
            adapter=rng.choice(names + [None]), sample=not prefill or rng.random() < 0.5,
            sampling=SamplingSpec(temperature=rng.choice((0.0, 0.7, 1.0)), top_p=rng.choice((1.0, 0.9)),
                                  top_k=rng.choice((-1, 40)), seed=rng.getrandbits(63), logprobs=rng.random() < 0.1),
            sample_index=0 if prefill else rng.randrange(1, 512)))
    place = [AdapterPlacement(name, rng.sample(range(num_pages), 8), load_groups=4) for name in names[:4]]
    return StepPlan(step_id=rng.randrange(1 << 40), rows=out, place=place, evict=names[4:6])


if msgspec is not None:
    # msgspec Structs with the fields, types and defaults of ipc/engine_plan.py's plan and of
    # EngineStep's envelope (`v`, and `type` as the tag). Module level: their annotations are
    # strings (from __future__) that msgspec resolves in this module's namespace.
    class MsSampling(msgspec.Struct, forbid_unknown_fields=True):
        temperature: float = 1.0
        top_p: float = 1.0
        top_k: int = -1
        seed: int = 0
        logprobs: bool = False

    class MsRow(msgspec.Struct, forbid_unknown_fields=True):
        request_id: str
        token_ids: list[int]
        start_pos: int
        kv_pages: list[int]
        adapter: str | None
        sample: bool
        sampling: MsSampling
        sample_index: int = 0
        cpu_layers: int = 0
        cpu_row: int = 0

    class MsPlacement(msgspec.Struct, forbid_unknown_fields=True):
        name: str
        pages: list[int]
        load_groups: int = 1

    class MsCpuStep(msgspec.Struct, forbid_unknown_fields=True):
        seq: int
        workers_per_layer: list[int]
        exchange_rows: int

    class MsPlan(msgspec.Struct, forbid_unknown_fields=True):
        step_id: int
        rows: list[MsRow]
        place: list[MsPlacement] = []
        evict: list[str] = []
        cpu: MsCpuStep | None = None
        merged_adapter: str | None = None

    class MsStep(msgspec.Struct, tag="engine_step", tag_field="type", forbid_unknown_fields=True):
        plan: MsPlan
        v: int = PROTOCOL_VERSION


def to_msgspec(plan: StepPlan) -> Any:
    """The same plan as msgspec Structs."""
    rows = [MsRow(r.request_id, r.token_ids, r.start_pos, r.kv_pages, r.adapter, r.sample,
               MsSampling(r.sampling.temperature, r.sampling.top_p, r.sampling.top_k, r.sampling.seed,
                          r.sampling.logprobs), r.sample_index, r.cpu_layers, r.cpu_row) for r in plan.rows]
    place = [MsPlacement(p.name, p.pages, p.load_groups) for p in plan.place]
    return MsStep(MsPlan(plan.step_id, rows, place, plan.evict, None, plan.merged_adapter))


def time_us(fn: Callable[[], Any], repeats: int, batches: int) -> float:
    """Median over `batches` of the mean microseconds of one call (`repeats` calls a batch)."""
    fn()  # warm-up
    samples = []
    for _ in range(batches):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        samples.append((time.perf_counter() - start) / repeats * 1e6)
    return statistics.median(samples)


def measure(plan: StepPlan, repeats: int, batches: int) -> dict[str, Any]:
    limits = DecodeLimits(max_message_bytes=64 << 20)
    data = encode(EngineStep(plan=plan), limits)
    back = decode(data, limits)
    assert isinstance(back, EngineStep) and back.plan == plan
    _log("timing the msgpack codec ...")
    results = {"msgpack": {
        "bytes": len(data),
        # Encoding starts from the plan: building EngineStep is where the codec checks every field.
        "encode_us": time_us(lambda: encode(EngineStep(plan=plan), limits), repeats, batches),
        "decode_us": time_us(lambda: decode(data, limits), repeats, batches),
    }}
    if msgspec is None:
        _log("msgspec is not installed: measured the current codec only")
        results["msgspec"] = None
        return results
    step = to_msgspec(plan)
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(MsStep)
    packed = encoder.encode(step)
    assert decoder.decode(packed) == step
    _log("timing msgspec ...")
    results["msgspec"] = {
        "bytes": len(packed),
        "encode_us": time_us(lambda: encoder.encode(step), repeats, batches),
        "decode_us": time_us(lambda: decoder.decode(packed), repeats, batches),
    }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--prefill-rows", type=int, default=8, help="rows carrying a prefill chunk (default 8)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens of a prefill chunk (default 256)")
    parser.add_argument("--context", type=int, default=2048, help="mean tokens in a row's page table (default 2048)")
    parser.add_argument("--page-tokens", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=65_536)
    parser.add_argument("--adapters", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=50, help="calls per timed batch (default 50)")
    parser.add_argument("--batches", type=int, default=7, help="timed batches; the median is reported (default 7)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not 0 <= args.prefill_rows <= args.rows or min(args.rows, args.chunk, args.context, args.page_tokens) < 1:
        parser.error("need rows >= prefill-rows >= 0 and positive rows, chunk, context, page-tokens")
    plan = build_plan(args.rows, args.prefill_rows, args.chunk, args.context, args.page_tokens, args.num_pages,
                      args.adapters, args.seed)
    _log(f"{len(plan.rows)} rows, {sum(len(r.kv_pages) for r in plan.rows)} page ids, {plan.num_tokens} tokens")
    results = measure(plan, args.repeats, args.batches)
    for codec in results.values():
        if codec is not None:
            codec["total_us"] = codec["encode_us"] + codec["decode_us"]
    fast = results["msgspec"]
    report = {
        "bench": "plan_codec",
        "plan": {"rows": len(plan.rows), "prefill_rows": args.prefill_rows, "tokens": plan.num_tokens,
                 "page_ids": sum(len(r.kv_pages) for r in plan.rows), "context": args.context,
                 "page_tokens": args.page_tokens},
        "results": results,
        "speedup_total": None if fast is None else results["msgpack"]["total_us"] / fast["total_us"],
        "repeats": args.repeats, "batches": args.batches,
        "host": {"python": platform.python_version(), "msgspec": None if msgspec is None else msgspec.__version__,
                 "cpu_count": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]},
    }
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{report['plan']['rows']} rows, {report['plan']['page_ids']} page ids, {report['plan']['tokens']} tokens")
    print(f"{'codec':<10} {'bytes':>9} {'encode us':>10} {'decode us':>10} {'total us':>10}")
    for name, codec in results.items():
        if codec is not None:
            print(f"{name:<10} {codec['bytes']:>9} {codec['encode_us']:>10.0f} {codec['decode_us']:>10.0f} "
                  f"{codec['total_us']:>10.0f}")
    if fast is not None:
        print(f"msgspec is {report['speedup_total']:.1f}x faster (encode + decode)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
