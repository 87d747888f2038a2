"""Per-kernel profile of the decode programs and the engine's loop, with JAX's profiler.

    python scripts/gpu_profile.py --config configs/qwen3_8b_shape.yaml --batches 64,1 \\
        --json $OUT/profile_8b.json --hlo-dir $OUT/profile_hlo      # on a GPU (~5-7 min)
    python scripts/gpu_profile.py --config configs/tiny.yaml --batches 2 --context 64 \\
        --new-tokens 6 --json p.json                                # on CPU (the test)

Times, each under `jax.profiler.trace`: the inspector's decode, verify_k3 and tree_n16
programs (jaxspec.gpu_targets.inspect.build_program: the same loops, random weights, a cache
filled to near --context), then the engine itself (`generate`, plain and with oracle drafts
at k = 3 taken from what its verify forward emits) at each batch. Per case: every kernel's calls and time, named by the `hlo_op`
the profiler gives it (the optimized HLO's instruction name, which the inspector's
estimate uses; a kernel without one, e.g. inside a CUDA graph, keeps its kernel name), the
wall time of the calls, the device's busy time and the gaps between consecutive kernels
(the host's share), and for the engine the time per compiled program (hlo_module) and the
gaps where one program hands over to the next (the host loop between segments). The read
bandwidth is measured in the same run. On a known GPU (H100, H200, GB200) each program case
also gets the inspector's estimate of its own optimized HLO, measured beside estimated
(`scripts/inspect_gpu.py --profile` does the same against a compile made without a GPU).
Cases run in priority order until --budget-s is spent; the JSON is written after each.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

GAP_US = 10.0  # gaps between kernels longer than this are counted
# A GPU plane's lines that the profiler derives from its streams' kernels (xprof).
_DERIVED = {"XLA Modules", "XLA Ops", "XLA TraceMe", "Steps", "Launch Stats", "Framework Ops",
            "Framework Name Scope", "Source code", "TensorFlow Name Scope", "TensorFlow Ops"}
PROGRAMS = ("verify_k3", "decode", "tree_n16")


def _parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--config", required=True, help="a run config (YAML)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override (repeatable)")
    p.add_argument("--batches", default="64,1", help="comma list, profiled in this order")
    p.add_argument("--context", type=int, default=2048, help="cache capacity of the programs")
    p.add_argument("--calls", type=int, default=3, help="profiled calls of each program")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per engine call")
    p.add_argument("--programs", default=",".join(PROGRAMS) + ",engine",
                   help="comma list of decode, verify_k3, tree_n16, engine")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="start no case after this many seconds")
    p.add_argument("--json", required=True, help="write the profile here")
    p.add_argument("--hlo-dir", default=None, help="write each program's optimized HLO here")
    p.add_argument("--trace-dir", default=None,
                   help="keep each case's raw profile (.xplane.pb) here, to read again offline")
    return p.parse_args(argv)


def _xplane(trace_dir: str) -> str:
    """The profile file `trace_dir` is, or the newest one under it."""
    if os.path.isfile(trace_dir):
        return trace_dir
    files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    if not files:
        raise RuntimeError(f"no .xplane.pb under {trace_dir}: the profiler wrote nothing")
    return max(files, key=os.path.getmtime)


def kernel_events(trace_dir: str) -> list[dict]:
    """The kernels of the profile `trace_dir` (an .xplane.pb, or the newest under a folder): [{"name", "module", "start_ns",
    "end_ns", "line"}] sorted by start. On a GPU the device planes' stream lines (a
    kernel's `hlo_op`, else its kernel name); without one, the host's XLA op events
    (XLA:CPU's thunks) that contain no other."""
    from jax.profiler import ProfileData

    data = ProfileData.from_file(_xplane(trace_dir))
    gpu, host = [], []
    for plane in data.planes:
        on_gpu = plane.name.startswith("/device:GPU")
        for line in plane.lines:
            if on_gpu and line.name in _DERIVED:
                continue  # these repeat the streams' kernels as ops, modules, steps
            for e in line.events:
                stats = dict(e.stats)
                if not on_gpu and "hlo_op" not in stats:
                    continue
                event = {"name": str(stats.get("hlo_op", e.name)), "kernel": str(e.name),
                         "module": str(stats.get("hlo_module", "")),
                         "start_ns": float(e.start_ns),
                         "end_ns": float(e.start_ns) + float(e.duration_ns), "line": line.name}
                (gpu if on_gpu else host).append(event)
    events = gpu or _leaves(host)
    return sorted(events, key=lambda e: e["start_ns"])


def _leaves(events: list[dict]) -> list[dict]:
    """The events that hold no other event of their line (a loop's event holds its body's)."""
    out = []
    by_line = {}
    for e in events:
        by_line.setdefault(e["line"], []).append(e)
    for line in by_line.values():
        line.sort(key=lambda e: (e["start_ns"], -e["end_ns"]))
        for i, e in enumerate(line):
            nxt = line[i + 1] if i + 1 < len(line) else None
            if nxt is None or nxt["start_ns"] >= e["end_ns"]:
                out.append(e)
    return out


def _name(event: dict, names: set | None) -> str:
    """An event's kernel as the HLO names it: its kernel name or its `hlo_op`, whichever is
    an instruction of the program (`names`: their `estimate.kernel_key`s; a kernel replayed
    from a CUDA graph may carry the graph's op, not its own), else the `hlo_op`."""
    from jaxspec.gpu_targets.estimate import kernel_key

    if names:
        for candidate in (event["kernel"], event["name"]):
            if kernel_key(candidate) in names:
                return candidate
    return event["name"]


def summarize(events: list[dict], wall_s: float, iterations: int,
              names: set | None = None) -> dict:
    """Per-kernel totals, busy time (the union of kernel intervals), the gaps between
    consecutive kernels, and per module, of one case's kernel events (named by `_name`)."""
    kernels = {}
    for e in events:
        e["name"] = _name(e, names)
        k = kernels.setdefault(e["name"], {"name": e["name"], "module": e["module"], "calls": 0,
                                           "total_us": 0.0, "kernel_names": []})
        k["calls"] += 1
        k["total_us"] += (e["end_ns"] - e["start_ns"]) / 1e3
        if e["kernel"] not in k["kernel_names"] and len(k["kernel_names"]) < 3:
            k["kernel_names"].append(e["kernel"])
    for k in kernels.values():
        k["us_per_call"] = k["total_us"] / k["calls"]
    busy, gaps, end, prev = 0.0, [], None, None
    for e in events:
        if end is None or e["start_ns"] >= end:
            if end is not None:
                gaps.append(((e["start_ns"] - end) / 1e3, prev, e))
            busy += e["end_ns"] - e["start_ns"]
            end = e["end_ns"]
        elif e["end_ns"] > end:
            busy += e["end_ns"] - end
            end = e["end_ns"]
        prev = e if prev is None or e["end_ns"] >= prev["end_ns"] else prev
    span = (events[-1]["end_ns"] - events[0]["start_ns"]) / 1e3 if events else 0.0
    handovers = [g for g in gaps if g[1]["module"] != g[2]["module"]]
    modules = {}
    for e in events:
        m = modules.setdefault(e["module"], {"module": e["module"], "kernels": 0, "us": 0.0})
        m["kernels"] += 1
        m["us"] += (e["end_ns"] - e["start_ns"]) / 1e3
    return {
        "iterations": iterations,
        "wall_ms": 1e3 * wall_s,
        "kernel_ms": sum(k["total_us"] for k in kernels.values()) / 1e3,
        "busy_ms": busy / 1e6,
        "span_ms": span / 1e3,
        "kernel_launches": len(events),
        "trace_lines": sorted({e["line"] for e in events}),
        "gaps": {"total_ms": sum(g[0] for g in gaps) / 1e3,
                 f"over_{GAP_US:.0f}us": sum(g[0] > GAP_US for g in gaps),
                 "largest": [{"us": g[0], "after": g[1]["name"], "before": g[2]["name"]}
                             for g in sorted(gaps, key=lambda g: -g[0])[:8]]},
        "module_handovers": {"count": len(handovers),
                             "total_ms": sum(g[0] for g in handovers) / 1e3},
        "modules": sorted(modules.values(), key=lambda m: -m["us"]),
        "kernels": sorted(kernels.values(), key=lambda k: -k["total_us"]),
    }


def _profiled(run, calls: int, keep: str | None = None) -> tuple[list[dict], float]:
    """(kernel events, wall seconds) of `calls` calls of `run` under the profiler; the raw
    profile copied to the path `keep` when given."""
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            start = time.perf_counter()
            for _ in range(calls):
                run()
            wall = time.perf_counter() - start
        if keep:
            os.makedirs(os.path.dirname(keep), exist_ok=True)
            shutil.copyfile(_xplane(trace), keep)
        return kernel_events(trace), wall


def _materialize(tree, key, length: int):
    """Arrays for an abstract program argument tree: floats random (scaled 0.02), the cache
    lengths `length`, boolean masks lower-triangular, other integers small ids."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    floats = [i for i, (_, a) in enumerate(leaves) if jnp.issubdtype(a.dtype, jnp.floating)]

    @jax.jit
    def normal(key):  # every float leaf in one program (one compile)
        return [(jax.random.normal(jax.random.fold_in(key, i), leaves[i][1].shape,
                                   leaves[i][1].dtype) * 0.02).astype(leaves[i][1].dtype)
                for i in floats]
    drawn = dict(zip(floats, normal(key)))
    out = []
    for i, (path, a) in enumerate(leaves):
        k = jax.random.fold_in(key, i)
        name = jax.tree_util.keystr(path)
        shape, dtype = tuple(a.shape), a.dtype
        if i in drawn:
            x = drawn[i]
        elif dtype == jnp.bool_:
            x = jnp.broadcast_to(jnp.tril(jnp.ones(shape[-2:], bool)), shape) if len(shape) >= 2 \
                else jnp.ones(shape, bool)
        elif "lengths" in name:
            x = jnp.full(shape, length, dtype)
        else:
            x = jax.random.randint(k, shape, 0, 8, dtype)
        out.append(x)
    return jax.tree_util.tree_unflatten(treedef, out)


def _device_target():
    """The gpu_targets entry of this device (by its kind), or None."""
    kind = jax.devices()[0].device_kind.lower()
    for name in ("h100", "h200", "gb200"):
        if name in kind:
            return name
    return None


def profile_program(name: str, model, batch: int, args, key) -> dict:
    """Compile and profile one inspector program at `batch` on this device."""
    from jaxspec.gpu_targets import estimate, hlo, inspect
    from jaxspec.kernels import compiler_options, platform

    mesh = jax.make_mesh((1, 1, 1, 1), ("data", "fsdp", "expert", "tensor"))
    with jax.set_mesh(mesh):
        program = inspect.build_program(name, model, batch=batch, context=args.context,
                                        mesh=mesh, platform=platform())
        fed = int(program.args[2].shape[1])
        grow = (args.calls + 1) * inspect.LOOP_STEPS * fed
        if grow >= args.context:
            raise ValueError(f"--context {args.context} is too small for {args.calls + 1} calls "
                             f"of {inspect.LOOP_STEPS} steps of {fed} tokens")
        values = _materialize(program.args, key, args.context - grow)
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as dump:  # XLA's thunks: which kernels are graphed
            compiled = jax.jit(program.fn, donate_argnums=program.donate).lower(*values).compile(
                compiler_options={**compiler_options(), "xla_dump_to": dump})
            thunks = sorted(glob.glob(os.path.join(dump, "*thunk_sequence_after_thunk_passes.txt")))
            thunks = inspect.thunk_kernels(open(thunks[-1]).read()) if thunks else None
        compile_s = time.perf_counter() - start
        state = {"args": list(values)}

        def run():  # the loop's cache and tokens feed the next call (the cache is donated)
            cache, tokens = compiled(*state["args"])
            state["args"][1], state["args"][2] = cache, tokens
            jax.block_until_ready(tokens)
        run()
        keep = os.path.join(args.trace_dir, f"{name}_b{batch}.xplane.pb") if args.trace_dir else None
        events, wall = _profiled(run, args.calls, keep)
    text = compiled.as_text()
    module = hlo.parse(text)
    names = {estimate.kernel_key(i) for c in module.computations.values() for i in c.instructions}
    tag = f"{name}_b{batch}"
    if args.hlo_dir:
        os.makedirs(args.hlo_dir, exist_ok=True)
        with open(os.path.join(args.hlo_dir, f"{tag}.hlo.txt"), "w") as fh:
            fh.write(text)
    case = {"program": name, "batch": batch, "context": args.context, "compile_s": compile_s,
            "thunks": thunks,
            **summarize(events, wall, args.calls * inspect.LOOP_STEPS, names)}
    target = _device_target()
    if target is not None:
        try:  # the measured case is kept whatever happens here
            case.update(_estimated(module, program, case, target, thunks, args.calls))
        except Exception as e:
            case["estimate_error"] = f"{type(e).__name__}: {str(e)[:300]}"
    return case


def _estimated(module, program, case: dict, target: str, thunks, calls: int) -> dict:
    """The estimate of the program's own optimized HLO on `target`, per iteration of its
    loop (per call where XLA left no loop), and the case's measured kernels beside it."""
    from jaxspec import gpu_targets
    from jaxspec.gpu_targets import estimate, hlo, inspect

    trip = lambda inst: program.unknown_trip
    loops = hlo.loop_costs(module, trip, custom_reads=inspect.stacked_attention_reads)
    if loops:
        cost, per = max(loops, key=lambda c: c.bytes), case["iterations"]
    else:
        cost, per = hlo.program_cost(module, trip, custom_reads=inspect.stacked_attention_reads), calls
    share = thunks["in_command_buffer"] / thunks["kernels"] if thunks and thunks["kernels"] else None
    kernels = estimate.estimate_loop(module, cost, gpu_targets.target(target), share)
    measured = {estimate.kernel_key(k["name"]): {"us": k["us_per_call"], "count": k["calls"] / per}
                for k in case["kernels"]}
    return {"estimate": estimate.summary(kernels), "estimate_per": "iteration" if loops else "call",
            "measured_vs_estimated": estimate.compare(kernels, measured)}


def profile_engine(model, batch: int, args, key, policy) -> list[dict]:
    """The engine's `generate` at `batch`, plain, then with oracle drafts at k = 3 taken from
    what the verify forward emits (`oracle.verify_reference`: tau = 4 unless the engine's
    verify and the reference's window forwards round apart, which acceptance_length shows)."""
    from jaxspec.decoding import SamplingConfig
    from jaxspec.decoding.engine import generate, pad_prompts
    from jaxspec.decoding.oracle import oracle_drafter, verify_reference

    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, min(model.vocab_size, 1000), size=int(n)))
               for n in rng.integers(8, 24, size=batch)]
    tokens, lengths = pad_prompts(prompts)
    common = dict(sampling=SamplingConfig(temperature=1.0), max_new_tokens=args.new_tokens,
                  key=jax.random.key(3))
    cases = []
    reference = verify_reference(policy, (tokens, lengths), 3, **common)
    drafter = oracle_drafter(tokens, lengths, reference.tokens, [1.0] * 3,
                             vocab_size=model.vocab_size)
    for mode, kwargs in (("engine_plain", {}), ("engine_k3", {"drafter": drafter})):
        def run(kwargs=kwargs):
            out = generate(policy, (tokens, lengths), **common, **kwargs)
            jax.block_until_ready(out.tokens)
            run.out = out
        run()  # compile
        keep = os.path.join(args.trace_dir, f"{mode}_b{batch}.xplane.pb") if args.trace_dir else None
        events, wall = _profiled(run, 1, keep)
        new = int(np.asarray(run.out.lengths).sum())
        cases.append({"program": mode, "batch": batch, "new_tokens": new,
                      "acceptance_length": float(getattr(run.out.stats, "acceptance_length", 1.0)),
                      **summarize(events, wall, 1)})
    return cases


def main(argv=None) -> int:
    args = _parse(argv)
    from jaxspec.timing import positive_ints

    try:
        batches = positive_ints(args.batches, "batches")
        programs = args.programs.split(",")
        bad = [p for p in programs if p not in PROGRAMS + ("engine",)]
        if bad:
            raise ValueError(f"--programs {','.join(bad)} unknown; valid: "
                             f"{', '.join(PROGRAMS + ('engine',))}")
        if args.calls < 1 or args.new_tokens < 1:
            raise ValueError(f"--calls {args.calls} / --new-tokens {args.new_tokens}: must be >= 1")
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    from bench_rollout import read_bandwidth_gbps

    from jaxspec.config import load_config
    from jaxspec.models import Policy
    from jaxspec.rl.trainer import prepare_run

    model = prepare_run(load_config(args.config, args.set)).model_config
    start = time.perf_counter()
    result = {"device": jax.devices()[0].device_kind, "platform": jax.default_backend(),
              "jax": jax.__version__, "config": args.config, "overrides": args.set,
              "command": "python scripts/gpu_profile.py " + " ".join(argv or sys.argv[1:]),
              "read_bandwidth_gbps": read_bandwidth_gbps(), "cases": [], "skipped": []}

    def write():
        result["seconds"] = time.perf_counter() - start
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
            fh.write("\n")

    key = jax.random.key(0)
    todo = [(p, b) for b in batches for p in programs]  # each batch's programs, then its engine
    policy = None
    for name, batch in todo:
        if time.perf_counter() - start > args.budget_s:
            result["skipped"].append(f"{name} b{batch}: budget spent")
            continue
        print(f"=== {name} batch {batch} (+{time.perf_counter() - start:.0f} s)", flush=True)
        try:
            if name == "engine":
                policy = policy or Policy.init(model, jax.random.key(1))
                result["cases"] += profile_engine(model, batch, args, key, policy)
            else:
                result["cases"].append(profile_program(name, model, batch, args, key))
        except Exception as e:  # one case failing (e.g. out of memory) leaves the others
            result["skipped"].append(f"{name} b{batch}: {type(e).__name__}: {str(e)[:300]}")
            print(result["skipped"][-1], flush=True)
        for c in result["cases"][-2:]:
            if c["batch"] == batch and c["program"].startswith(name):
                print(f"  {c['program']}: wall {c['wall_ms']:.2f} ms, kernels "
                      f"{c['kernel_ms']:.2f} ms, busy {c['busy_ms']:.2f} ms, gaps "
                      f"{c['gaps']['total_ms']:.2f} ms, {c['kernel_launches']} launches", flush=True)
        write()
    write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
